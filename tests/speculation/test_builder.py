"""speculation/builder.py: generate and the engine assemble the same round from the same inputs."""

from __future__ import annotations

import pytest
from conftest import flat_cost, make_tiny_drafter, make_tiny_llama

from hf_dspark.generation.generate import _round_for
from hf_dspark.serving import DSparkEngine
from hf_dspark.speculation.shared_state import salt_scope, shared_state_for


@pytest.fixture(scope="module")
def target():
    return make_tiny_llama(seed=0)


@pytest.fixture(scope="module")
def draft(target):
    return make_tiny_drafter(target, seed=1, block_size=5, markov_rank=16)


@pytest.mark.parametrize("policy,lookup", [("scheduled", True), ("scheduled", False), ("fixed", True),
                                           ("none", False)])
def test_generate_and_the_engine_build_equivalent_rounds(target, draft, policy, lookup):
    """Both entry points assemble their round with ``speculation/builder.py``: for the same drafter, policy,
    lookup setting and step cost they get the same round. Only the differences the builder names remain: generate
    reads and writes the target's shared lookup history under the salt's key with the salt's calibrator, and keeps
    a drafter its policy never runs; the engine has a history and calibrator of its own and drops such a drafter."""
    cost = flat_cost()
    scope = shared_state_for(target).scope("builder")
    ours, proposer = _round_for(target, draft, shared=shared_state_for(target), policy=policy, num_tokens=None,
                                threshold=None, lookup=lookup, scope=scope, salt="builder", step_cost=cost,
                                tokenizer=None, rows=1, sequential_top_k=None)
    engine = DSparkEngine(target, draft, policy, sps=cost, lookup=lookup)
    theirs = engine._round
    assert type(ours.policy) is type(theirs.policy) and ours.policy is not theirs.policy
    assert ours.max_drafts == theirs.max_drafts
    assert ours.cost is theirs.cost is cost and ours.observe_time is theirs.observe_time is False
    assert ours.verify_fn is theirs.verify_fn and ours.max_deferred_rounds == theirs.max_deferred_rounds
    assert ours.sequential_top_k is theirs.sequential_top_k is None
    assert ours.drafter is draft  # kept under a policy that never drafts ("none"); the engine drops it there
    assert theirs.drafter is (draft if ours.max_drafts else None)
    assert theirs.block_size == (ours.block_size if ours.max_drafts else 0)
    assert (proposer is None) == (engine._lookup is None) == (not (lookup and ours.policy.supports_lookup))
    assert ours.lookup is proposer and theirs.lookup is engine._lookup
    if proposer is not None:
        assert (proposer.max_tokens, proposer.long_match_tokens) == (engine._lookup.max_tokens,
                                                                     engine._lookup.long_match_tokens)
        assert proposer.history is shared_state_for(target).history and engine._lookup.history is not None
        assert engine._lookup.history is not proposer.history
        assert proposer.history_key.scope == salt_scope("builder")  # the salt's scope; the engine's rows give theirs
        assert engine._lookup.history_key is None
        assert ours.calibrator is scope.calibrator and theirs.calibrator is not None
        assert theirs.calibrator is not scope.calibrator
