"""The lookup proposer fused with the drafter in the shared round: lossless (greedy token-identical, sampling χ²
per position with a wrong-q negative control), used where it pays, scoped history, opt-out, engine lookup-only."""

from __future__ import annotations

import pytest
import torch
from conftest import flat_cost, make_tiny_drafter, make_tiny_llama
from scipy.stats import chi2_contingency

import hf_dspark.speculation.round as round_module
from hf_dspark import DSparkEngine
from hf_dspark.speculation.lookup import LookupProposal, LookupProposer
from hf_dspark.speculation.shared_state import forget, salt_scope, shared_state_for
from hf_dspark.scheduling import ScheduledPolicy, StepCostProfile, make_policy

VOCAB = 16


@pytest.fixture(scope="module")
def target():
    # no end-of-sequence token: a long greedy continuation of this random model falls into repeats (as agent text
    # re-emits its context), which is what the lookup proposer exists for
    model = make_tiny_llama(seed=3, vocab_size=VOCAB)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def draft(target):
    return make_tiny_drafter(target, seed=12, block_size=4, markov_rank=8)


# a prompt that repeats itself: the lookup proposer matches from the first round on
PROMPT = torch.tensor([[5, 9, 3, 12, 7, 4, 5, 9, 3, 12, 7, 4, 5, 9]])


def plain(target, ids, **kwargs):
    return target.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **kwargs)


class OracleLookup:
    """Replaces LookupProposer.propose: each row's proposal is the target's own continuation with the first k
    drafts right and the rest wrong (k cycling), so accept-all, partial and reject-first lookup rounds happen.
    ``continuations``: prompt (tuple) -> its plain greedy continuation; a row is recognised by its prompt."""

    def __init__(self, continuations: dict, pattern=(6, 0, 3, 8, 1)):
        self.continuations, self.pattern, self.calls = continuations, pattern, 0

    def __call__(self, proposer, row_ids, max_tokens=None):
        out = []
        for row, cap in zip(row_ids, max_tokens):
            tokens = proposer._row(row).index.tokens
            prompt = next(p for p in self.continuations if tuple(tokens[:len(p)]) == p)
            done = len(tokens) - len(prompt)
            k = self.pattern[self.calls % len(self.pattern)]
            self.calls += 1
            cont = self.continuations[prompt][done:done + min(cap, 8)]
            drafts = tuple(t if j < k else (t + 1) % VOCAB for j, t in enumerate(cont))
            out.append(LookupProposal(drafts, match_length=4, counts=(2,) * len(drafts), totals=(2,) * len(drafts)))
        return out

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(LookupProposer, "propose", lambda proposer, rows, max_tokens=None: self(proposer, rows,
                                                                                                   max_tokens))


def continuations_of(target, prompts: list[list[int]], num: int) -> dict:
    return {tuple(p): plain(target, torch.tensor([p]), do_sample=False, max_new_tokens=num)[0, len(p):].tolist()
            for p in prompts}


@pytest.mark.parametrize("lookup", [True, "only"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_with_lookup_is_token_identical(target, draft, lookup, batch, monkeypatch):
    forget(target)
    ids = torch.cat([PROMPT, torch.roll(PROMPT, 2, 1), torch.roll(PROMPT, 5, 1)])[:batch]
    expected = plain(target, ids, do_sample=False, max_new_tokens=40)
    OracleLookup(continuations_of(target, ids.tolist(), 48)).install(monkeypatch)
    got = plain(target, ids, do_sample=False, max_new_tokens=40, assistant_model=draft, dspark_lookup=lookup,
                dspark_step_cost=flat_cost())
    assert torch.equal(got, expected)
    by_source = draft.stats.by_source
    lookup_stats = by_source["lookup"]
    assert 0 < lookup_stats.accepted_tokens < lookup_stats.proposed_tokens  # used, and rejected where wrong
    if lookup == "only":
        assert "drafter" not in by_source  # the drafter never ran
    assert "lookup:" in draft.stats.summary()


def test_the_real_matcher_proposes_on_repeating_text(target, draft):
    forget(target)
    got = plain(target, PROMPT, do_sample=False, max_new_tokens=60, assistant_model=draft, dspark_lookup="only",
                dspark_step_cost=flat_cost())
    assert torch.equal(got, plain(target, PROMPT, do_sample=False, max_new_tokens=60))
    assert draft.stats.by_source["lookup"].accepted_tokens > 0


def test_default_scheduler_measures_its_own_step_cost(target, draft):
    """No dspark_step_cost: the step cost is profiled once per target and size (lookup-only: no drafter timing)."""
    forget(target)
    for lookup in ("only", True):
        got = plain(target, PROMPT, do_sample=False, max_new_tokens=12, assistant_model=draft, dspark_lookup=lookup)
        assert torch.equal(got, plain(target, PROMPT, do_sample=False, max_new_tokens=12))
    assert len(shared_state_for(target).costs) == 2  # one profile without the drafter, one with it


def test_each_lookup_mode_keeps_its_own_scheduler(target, draft):
    """The scheduler's history records decisions between the sources a mode offers: calls with lookup proposals
    must not pass theirs (skipped rounds, probe back-off) to calls without them, and repeated calls of one mode
    share theirs."""
    forget(target)
    for lookup in (True, False, "only", False):
        got = plain(target, PROMPT, do_sample=False, max_new_tokens=12, assistant_model=draft, dspark_lookup=lookup,
                    dspark_step_cost=flat_cost())
        assert torch.equal(got, plain(target, PROMPT, do_sample=False, max_new_tokens=12))
    scope = shared_state_for(target).scope(None)  # the default scope's schedulers
    assert len(scope.policies) == 3
    policies = [scope.policy_for(draft, lookup) for lookup in (True, False, "only")]
    assert len({id(p) for p in policies}) == 3 and scope.policy_for(draft, False) is policies[1]


def test_lookup_can_be_turned_off(target, draft):
    forget(target)
    plain(target, PROMPT, do_sample=False, max_new_tokens=20, assistant_model=draft, dspark_lookup=False,
          dspark_step_cost=flat_cost())
    assert "lookup" not in draft.stats.by_source


def assert_plain_greedy_where_verifying_is_dear(target, draft) -> None:
    """16 tokens of PROMPT through generate with the drafter where every verified token costs as much as a plain
    step (and a drafter pass half of one): the output must equal plain greedy."""
    rows, widths = (1, 2, 4), tuple(range(1, 25))
    linear = StepCostProfile(rows, widths, tuple(tuple(0.01 * w * r for w in widths) for r in rows),
                             tuple(0.05 for _ in rows))
    expected = plain(target, PROMPT, do_sample=False, max_new_tokens=16)
    got = plain(target, PROMPT, do_sample=False, max_new_tokens=16, assistant_model=draft, dspark_step_cost=linear)
    assert torch.equal(got, expected)


def test_expensive_verification_falls_back_to_plain_decoding(target, draft):
    """Where every verified token costs as much as a plain step, neither proposer can pay: plain rounds only."""
    forget(target)
    assert_plain_greedy_where_verifying_is_dear(target, draft)
    # the first rounds draft to learn the drafter's acceptance (ScheduledPolicy.min_learning_rows); then plain
    # rounds only
    stats = draft.stats
    assert stats.by_source["none"].rounds >= stats.rounds - ScheduledPolicy.min_learning_rows


def test_rounds_with_nothing_to_verify_skip_the_width_walk(target, draft, monkeypatch):
    """Lookup on, no row with a proposal, the drafter not worth its pass: the round is a plain step decided without
    walking the widths (host work every step of a busy engine); the output is still plain greedy."""
    forget(target)
    monkeypatch.setattr(LookupProposer, "propose", lambda self, row_ids, max_tokens=None: [LookupProposal()] * len(
        row_ids))
    walks = []
    choose = ScheduledPolicy.choose
    monkeypatch.setattr(ScheduledPolicy, "choose", lambda self, *a, **k: walks.append(1) or choose(self, *a, **k))
    assert_plain_greedy_where_verifying_is_dear(target, draft)
    assert len(walks) <= ScheduledPolicy.min_learning_rows < 10 <= draft.stats.rounds  # drafting rounds only


def test_history_is_shared_only_within_a_salt(target, draft):
    forget(target)
    kwargs = dict(do_sample=False, max_new_tokens=12, assistant_model=draft, dspark_step_cost=flat_cost())
    plain(target, PROMPT, dspark_cache_salt="alice", **kwargs)
    plain(target, PROMPT, dspark_cache_salt="bob", **kwargs)
    plain(target, PROMPT, **kwargs)
    plain(target, PROMPT, dspark_cache_salt="", **kwargs)  # an empty salt is not the default scope
    history = shared_state_for(target).history
    assert sorted(key.scope for key in history.keys()) == sorted(salt_scope(s) for s in (None, "", "alice", "bob"))
    assert len(history.keys()) == 4 and salt_scope(None) == ""  # "": the default scope
    forget(target)
    assert not shared_state_for(target).history.keys()


def test_by_default_calls_share_history_and_isolated_calls_share_nothing(target, draft):
    """Calls on one target share the lookup history by default (an agent's next turn copies its earlier replies);
    ``dspark_isolate=True`` reads and leaves nothing, and gets the same tokens."""
    forget(target)
    kwargs = dict(do_sample=False, max_new_tokens=12, assistant_model=draft, dspark_step_cost=flat_cost())
    first = plain(target, PROMPT, dspark_isolate=True, **kwargs)
    assert not shared_state_for(target).history.keys() and not shared_state_for(target).scopes
    assert torch.equal(plain(target, PROMPT, **kwargs), first)
    assert [key.scope for key in shared_state_for(target).history.keys()] == [""]
    assert torch.equal(plain(target, PROMPT, dspark_isolate=True, **kwargs), first)
    assert [key.scope for key in shared_state_for(target).history.keys()] == [""]
    with pytest.raises(ValueError, match="give one or the other"):
        plain(target, PROMPT, dspark_isolate=True, dspark_cache_salt="alice", **kwargs)
    with pytest.raises(ValueError, match="must be a string"):
        plain(target, PROMPT, dspark_cache_salt=7, **kwargs)


# ------------------------------------------------------------------------------------------------------------
# Sampling: χ² per position against plain sampling, lookup proposals verified with q = δ
# ------------------------------------------------------------------------------------------------------------
NUM_NEW, ROWS, CALLS = 4, 500, 4


def sample(target, seed, **kwargs) -> torch.Tensor:
    torch.manual_seed(seed)
    out = [plain(target, PROMPT.expand(ROWS, -1), do_sample=True, temperature=1.0, max_new_tokens=NUM_NEW,
                 **kwargs)[:, PROMPT.shape[1]:] for _ in range(CALLS)]
    out = torch.cat(out)
    return torch.nn.functional.pad(out, (0, NUM_NEW - out.shape[1]), value=0)


def pvalues(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    out = []
    for pos in range(NUM_NEW):
        counts = torch.stack([torch.bincount(a[:, pos], minlength=VOCAB), torch.bincount(b[:, pos], minlength=VOCAB)])
        counts = counts[:, counts.sum(0) > 0]
        out.append(float(chi2_contingency(counts.numpy())[1]))
    return out


def test_sampling_with_lookup_preserves_the_target_distribution(target, draft):
    forget(target)
    reference = sample(target, seed=0)
    # verifying is free on the flat cost and the policy takes any expected gain (no margin): lookup drafts are
    # verified in every call, though few of this random target's are accepted
    eager = make_policy("scheduled", speculation_margin=1.0)
    ours = sample(target, seed=1, assistant_model=draft, dspark_lookup="only", dspark_step_cost=flat_cost(),
                  dspark_policy=eager)
    lookup = draft.stats.by_source["lookup"]
    assert 0 < lookup.accepted_tokens < lookup.proposed_tokens  # accepted and rejected lookup drafts both occur
    assert min(pvalues(reference, ours)) > 1e-3


def test_chi2_catches_a_wrong_lookup_q(target, draft, monkeypatch):
    """Negative control: verifying lookup drafts as if they had been sampled from a uniform q must be detected."""
    real = round_module.assemble_drafts

    def uniform_q(*args, **kwargs):
        drafts, probs = real(*args, **kwargs)
        return drafts, None if probs is None else torch.full_like(probs, 1.0 / probs.shape[-1])

    monkeypatch.setattr(round_module, "assemble_drafts", uniform_q)
    forget(target)
    reference = sample(target, seed=0)
    wrong = sample(target, seed=1, assistant_model=draft, dspark_lookup="only", dspark_step_cost=flat_cost())
    assert min(pvalues(reference, wrong)) < 1e-6


# ------------------------------------------------------------------------------------------------------------
# The engine: lookup fused with the drafter, and lookup only (no drafter at all)
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("with_drafter", [True, False])
def test_engine_with_lookup_equals_plain_greedy(target, draft, with_drafter, monkeypatch):
    prompts = [PROMPT[0].tolist(), torch.roll(PROMPT, 3, 1)[0].tolist(), [7, 4, 5, 9, 3, 7, 4, 5, 9, 3]]
    OracleLookup(continuations_of(target, prompts, 32)).install(monkeypatch)
    engine = DSparkEngine(target, draft if with_drafter else None, "scheduled", sps=flat_cost(64))
    outputs = engine.generate(prompts, 24, eos_token_id=[])  # the module's target has no end-of-sequence token
    for prompt, out in zip(prompts, outputs):
        expected = plain(target, torch.tensor([prompt]), do_sample=False, max_new_tokens=24)[0, len(prompt):]
        assert out.token_ids == expected.tolist()
    by_source = engine.engine_metrics.stats.by_source
    assert 0 < by_source["lookup"].accepted_tokens < by_source["lookup"].proposed_tokens
    assert with_drafter or "drafter" not in by_source


def test_engine_lookup_history_is_shared_by_default_and_separated_by_salt(target):
    engine = DSparkEngine(target, None, "scheduled", sps=flat_cost(64))
    engine.submit(PROMPT[0].tolist(), 8, isolate=True, eos_token_id=[]).result()  # isolated: nothing is stored
    assert engine._lookup.history.num_tokens == 0
    engine.generate([PROMPT[0].tolist()], 8, eos_token_id=[])  # no salt: the default scope
    engine.submit(PROMPT[0].tolist(), 8, cache_salt="user-1", eos_token_id=[]).result()
    assert sorted(key.scope for key in engine._lookup.history.keys()) == ["", salt_scope("user-1")]


def test_salts_keep_their_own_schedulers(target, draft):
    """What one salt's calls taught the scheduler (acceptance, step time: what timing reveals) is not another's."""
    forget(target)
    kwargs = dict(do_sample=False, max_new_tokens=12, assistant_model=draft, dspark_step_cost=flat_cost())
    plain(target, PROMPT, dspark_cache_salt="alice", **kwargs)
    memory = shared_state_for(target)
    alice, bob = memory.scope("alice"), memory.scope("bob")
    assert alice is not bob and alice.calibrator is not bob.calibrator
    assert alice.policies and not bob.policies  # bob's scheduler starts from its priors
    assert memory.scope("alice") is alice and memory.scope(None) is not alice
