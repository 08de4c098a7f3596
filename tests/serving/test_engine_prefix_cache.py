"""The engine's prefix cache per scope: a scope's finished request leaves its caches for the scope's next request,
which prefills only what is new; outputs stay plain greedy's, rows with holes are kept correctly, and nothing is
kept or shared without a scope or when turned off."""

from __future__ import annotations

import pytest
import torch
from conftest import flat_cost, make_tiny_drafter, make_tiny_llama

from hf_dspark.serving.engine import DSparkEngine


@pytest.fixture(scope="module")
def target():
    model = make_tiny_llama(seed=5)
    model.generation_config.eos_token_id = model.config.eos_token_id = None  # every reply runs its full length
    return model


@pytest.fixture(scope="module")
def draft(target):
    return make_tiny_drafter(target, seed=4, block_size=4, markov_rank=8)


def plain(target, ids: list[int], max_new_tokens: int) -> list[int]:
    x = torch.tensor([ids])
    out = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                          pad_token_id=0)
    return out[0, len(ids):].tolist()


def conversations(engine: DSparkEngine, scopes: list[str | None], turns: int, new_tokens: int = 10,
                  isolate: bool = False):
    """One agent-like conversation per scope, all in flight together: each turn's prompt is the previous prompt +
    its reply + a new message. Returns per scope the prompts and replies, and per turn the prompt tokens the
    engine reused."""
    g = torch.Generator().manual_seed(9)
    prompts = {i: [torch.randint(3, 96, (30 + 7 * i,), generator=g).tolist()] for i in range(len(scopes))}
    replies: dict[int, list[list[int]]] = {i: [] for i in range(len(scopes))}
    reused = []
    for _ in range(turns):
        before = engine.metrics()["reused_prompt_tokens"]
        handles = [engine.submit(prompts[i][-1], new_tokens, cache_salt=scope, isolate=isolate)
                   for i, scope in enumerate(scopes)]
        for i, handle in enumerate(handles):
            replies[i].append(handle.result().token_ids)
        reused.append(engine.metrics()["reused_prompt_tokens"] - before)
        for i in range(len(scopes)):
            prompts[i].append(prompts[i][-1] + replies[i][-1] + torch.randint(3, 96, (6,), generator=g).tolist())
    return {i: prompts[i][:turns] for i in prompts}, replies, reused


@pytest.mark.parametrize("policy, with_drafter", [("scheduled", True), ("fixed", True), ("scheduled", False)])
def test_a_scope_reuses_the_previous_turn_and_outputs_stay_plain(target, draft, policy, with_drafter):
    """Two scopes at once (ragged rows; "fixed" drafts with a random drafter, so rejected slots leave holes), and
    lookup only without a drafter: every later turn reuses the whole previous prompt and every reply token whose
    K/V was written (the last one is the anchor)."""
    engine = DSparkEngine(target, draft if with_drafter else None, policy, sps=flat_cost(),
                          policy_kwargs={"num_tokens": 3} if policy == "fixed" else None)
    prompts, replies, reused = conversations(engine, ["alice", "bob"], turns=3)
    for i in prompts:
        for prompt, reply in zip(prompts[i], replies[i]):
            assert reply == plain(target, prompt, 10)
    assert reused[0] == 0
    for turn in (1, 2):
        assert reused[turn] == sum(len(prompts[i][turn - 1]) + len(replies[i][turn - 1]) - 1 for i in prompts)


def test_default_conversations_reuse_their_prefixes_and_isolated_requests_keep_nothing(target, draft):
    """Two conversations without a salt share the default scope and each reuses its own previous turn; isolated
    requests and an engine without a prefix cache keep nothing."""
    engine = DSparkEngine(target, draft, "scheduled", sps=flat_cost())
    prompts, replies, reused = conversations(engine, [None, None], turns=2)
    assert reused == [0, sum(len(prompts[i][0]) + len(replies[i][0]) - 1 for i in prompts)]
    engine = DSparkEngine(target, draft, "scheduled", sps=flat_cost())
    _, _, reused = conversations(engine, [None, None], turns=2, isolate=True)
    assert reused == [0, 0] and len(engine._prefixes) == 0
    engine = DSparkEngine(target, draft, "scheduled", sps=flat_cost(), prefix_cache=False)
    _, _, reused = conversations(engine, ["alice"], turns=2)
    assert reused == [0, 0] and engine._prefixes is None


def test_scopes_never_share_and_a_diverging_prompt_reuses_only_the_common_part(target, draft):
    engine = DSparkEngine(target, draft, "scheduled", sps=flat_cost())
    prompt = list(range(3, 63))
    engine.submit(prompt, 8, cache_salt="alice").result()
    engine.submit(prompt + [70, 71], 8, cache_salt="bob").result()
    assert engine.metrics()["reused_prompt_tokens"] == 0  # alice's caches are not bob's
    edited = prompt[:30] + [90] * 40
    out = engine.submit(edited, 8, cache_salt="alice").result()
    assert engine.metrics()["reused_prompt_tokens"] == 30
    assert out.token_ids == plain(target, edited, 8)


@pytest.mark.parametrize("first, second", [(None, ""), ("", None)])
def test_an_empty_salt_is_not_the_default_scope(target, first, second):
    """``cache_salt=""`` is a salt like any other: it shares neither the prefix caches nor the lookup history of
    requests without one (both were kept under ""). The second request repeats the first's prompt and reply, so it
    would reuse the first's caches and copy the rest of its reply from the history if they were shared."""
    engine = DSparkEngine(target, None, "scheduled", sps=flat_cost())
    prompt = list(range(3, 43))
    reply = engine.submit(prompt, 24, cache_salt=first).result().token_ids
    sources, propose = [], engine._lookup.propose

    def recording(row_ids, max_tokens=None):
        proposals = propose(row_ids, max_tokens=max_tokens)
        sources.extend(p.source for p in proposals if len(p))
        return proposals

    engine._lookup.propose = recording
    out = engine.submit(prompt + reply[:8], 16, cache_salt=second).result()
    assert out.token_ids == plain(target, prompt + reply[:8], 16) == reply[8:]
    assert engine.metrics()["reused_prompt_tokens"] == 0 and "history" not in sources
    assert len(engine._lookup.history.keys()) == 2
    engine.submit(prompt + reply[:8], 4, cache_salt=first).result()  # the same salt still shares
    assert engine.metrics()["reused_prompt_tokens"] > 0


def test_a_cancelled_request_leaves_nothing(target, draft):
    engine = DSparkEngine(target, draft, "scheduled", sps=flat_cost())
    handle = engine.submit(list(range(3, 50)), 30, cache_salt="alice")
    engine.step()
    engine.step()
    handle.cancel()
    while engine.step():
        pass
    assert len(engine._prefixes) == 0


def test_kept_caches_equal_a_fresh_prefill_of_the_same_tokens(target, draft):
    """The entry a finished request leaves (its row cut out of a ragged batch with holes) holds, position by
    position, the K/V a fresh prefill of its tokens computes, for the target and for the drafter."""
    from transformers import DynamicCache

    from hf_dspark.speculation.shared_state import shared_state_for
    from hf_dspark.speculation.ragged_batch import cache_kwarg
    from hf_dspark.modeling.draft_cache import DraftCache
    from hf_dspark.modeling.target_taps import TargetFeatureTap

    engine = DSparkEngine(target, draft, "fixed", sps=flat_cost(), policy_kwargs={"num_tokens": 3})
    # a second, shorter and longer-running row: the batch is ragged (padding and rejected slots are holes) when
    # alice's row leaves it
    handles = [engine.submit(list(range(3, 40)), 12, cache_salt="alice"),
               engine.submit(list(range(50, 60)), 20, cache_salt="bob")]
    outputs = [handle.result() for handle in handles]
    alice = shared_state_for(target).prefix_key("alice", draft)
    (entry,) = [entry for key, entry in engine._prefixes.store._entries.values() if key == alice]
    tokens = list(range(3, 40)) + outputs[0].token_ids
    assert entry.token_ids == tokens and entry.num_tokens == len(tokens) - 1  # the last token is the anchor
    n = entry.num_tokens
    fresh, fresh_draft = DynamicCache(config=target.config), DraftCache()
    with torch.no_grad(), TargetFeatureTap(target, draft.config.target_layer_ids) as tap:
        target(input_ids=torch.tensor([tokens[:n]]), use_cache=True, **{cache_kwarg(target): fresh})
        draft.extend_context(fresh_draft, tap.features(), torch.arange(n)[None], packed=True, counts=[n])
    for kept, new in zip(entry.cache.layers, fresh.layers):
        torch.testing.assert_close(kept.keys[:, :, :n], new.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(kept.values[:, :, :n], new.values, rtol=1e-4, atol=1e-5)
    for kept, new in zip(entry.draft_cache.keys, fresh_draft.keys):
        torch.testing.assert_close(kept[:, :, :n], new, rtol=1e-4, atol=1e-5)
    assert torch.equal(entry.draft_cache.positions[0, :n], torch.arange(n))


def test_kept_caches_hold_no_autograd_graph(target, draft):
    """Retiring runs outside the decode step's no_grad block: the kept K/V must not drag an autograd graph along."""
    engine = DSparkEngine(target, draft, "scheduled", sps=flat_cost())
    engine.submit(list(range(3, 40)), 9, cache_salt="alice").result()
    ((_, entry),) = engine._prefixes.store._entries.values()
    tensors = [t for layer in entry.cache.layers for t in (layer.keys, layer.values)]
    tensors += entry.draft_cache.keys + entry.draft_cache.values
    assert not any(t.requires_grad for t in tensors)


def test_a_failure_keeping_caches_fails_no_request(target, draft, monkeypatch):
    """Keeping a finished request's caches is an optimisation: when it raised (out of memory cutting the row out),
    the step failed every running request with an error, and the finished one never left the batch (its id stayed
    in use)."""
    engine = DSparkEngine(target, draft, "scheduled", sps=flat_cost())

    def fails(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated out of memory while keeping a prefix")

    monkeypatch.setattr(engine._prefixes, "keep", fails)
    prompts = [list(range(3, 40)), list(range(50, 70))]
    handles = [engine.submit(prompts[0], 6, request_id="short"), engine.submit(prompts[1], 14)]
    assert [h.result().token_ids for h in handles] == [plain(target, prompts[0], 6), plain(target, prompts[1], 14)]
    assert engine.metrics()["finished_requests"] == {"length": 2}
    assert not engine.has_work()
    assert engine.submit(prompts[0], 3, request_id="short").result().token_ids == plain(target, prompts[0], 3)
