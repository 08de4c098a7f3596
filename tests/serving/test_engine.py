"""DSparkEngine end to end on tiny random targets: every request's output equals plain greedy ``generate`` of that
prompt alone, under every policy, concurrency and arrival pattern (between steps, from other threads, chunked
prefills, finishing mid-block, cancellation); sampling keeps the target distribution (χ² per position, with a
wrong-q negative control); a stress run loses or duplicates nothing; limits, failures and metrics behave."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
from conftest import make_tiny_drafter, make_tiny_llama
from scipy import stats
from transformers import DynamicCache
from transformers.generation.logits_process import LogitsProcessorList

from hf_dspark import DSparkDraftModel
from hf_dspark import kv_cache
from hf_dspark.speculation.ragged_batch import cache_kwarg
from hf_dspark.modeling.draft_cache import DraftCache
from hf_dspark.modeling.target_taps import TargetFeatureTap
from hf_dspark.scheduling import SPSProfile, StepCostProfile
from hf_dspark.serving.engine import DSparkEngine
from hf_dspark.serving.requests import (
    FinishReason,
    RequestRejectedError,
    SamplingParams,
)

VOCAB = 96
GAMMA = 5
# flat while latency-bound, then falling: the shape the scheduler trades against
SPS = SPSProfile.from_user_table({1: 100.0, 8: 95.0, 16: 70.0, 32: 40.0, 64: 20.0, 128: 10.0})
POLICIES = [("none", {}), ("fixed", {"num_tokens": 3}), ("fixed", {}), ("threshold", {"threshold": 0.5}),
            ("scheduled", {}), ("scheduled-async", {})]


def random_prompts(n: int, seed: int = 0, low: int = 3, high: int = 17) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(low, high, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def plain_greedy(target, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    out = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens, **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def target():
    return make_tiny_llama(seed=0)


@pytest.fixture(scope="module")
def draft(target):
    return make_tiny_drafter(target, seed=1, block_size=GAMMA, markov_rank=16)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(10)


@pytest.fixture(scope="module")
def continuations(target, prompts):
    """Long greedy continuations: the reference for any max_new_tokens ≤ 24 and the oracle's source."""
    return {tuple(p): plain_greedy(target, p, 24 + GAMMA) for p in prompts}


class OracleDrafter:
    """Wraps draft_block: greedy rows get the target's own continuation with the first k slots right and the rest
    wrong (k cycling through ``pattern``), and confidences that are high on right slots and low on wrong ones,
    so accept-all, partial and reject-first rounds all happen and the scheduler sees informative scores."""

    def __init__(self, draft, continuations, pattern=(5, 0, 2, 4, 5, 1, 3)):
        self.original, self.continuations, self.pattern, self.calls = draft.draft_block, continuations, pattern, 0

    def __call__(self, cache, anchor_ids, anchor_positions, *, logits_processor=None, **kwargs):
        block = self.original(cache, anchor_ids, anchor_positions, logits_processor=logits_processor, **kwargs)
        gamma = block.tokens.shape[1]
        confidence = torch.full((len(anchor_ids), gamma), 0.2)
        for row, request in enumerate(logits_processor.requests):
            cont = self.continuations[tuple(request.prompt_ids)][len(request.tokens):]
            cont = (cont + [7] * gamma)[:gamma]
            k = self.pattern[self.calls % len(self.pattern)]
            self.calls += 1
            block.tokens[row] = torch.tensor([t if j < k else (t + 1) % VOCAB for j, t in enumerate(cont)])
            confidence[row, :k] = 0.9
        block.confidence = confidence
        return block


def make_engine(target, draft, policy="scheduled", policy_kwargs=None, **kwargs):
    return DSparkEngine(target, draft, policy, policy_kwargs=policy_kwargs, sps=SPS, **kwargs)


@pytest.mark.parametrize("policy,policy_kwargs", POLICIES, ids=[f"{p}{k}" for p, k in POLICIES])
@pytest.mark.parametrize("max_running", [1, 4, 10])
def test_greedy_identical_to_plain_generate(target, draft, prompts, continuations, monkeypatch, policy,
                                            policy_kwargs, max_running):
    monkeypatch.setattr(draft, "draft_block", OracleDrafter(draft, continuations))
    engine = make_engine(target, draft, policy, policy_kwargs, max_running_requests=max_running)
    outputs = engine.generate(prompts, max_new_tokens=20)
    assert [o.token_ids for o in outputs] == [continuations[tuple(p)][:20] for p in prompts]
    metrics = engine.metrics()
    assert metrics["generated_tokens"] == sum(len(o.token_ids) for o in outputs)
    if policy != "none":
        assert metrics["tau"] > 1.5  # the oracle's accepted drafts were really used
        assert metrics["mean_verify_budget"] > 0
    else:
        assert metrics["tau"] == 1.0 and metrics["mean_verify_budget"] == 0


def test_random_drafter_without_oracle(target, draft, prompts, continuations):
    outputs = make_engine(target, draft, max_running_requests=6).generate(prompts, max_new_tokens=12)
    assert [o.token_ids for o in outputs] == [continuations[tuple(p)][:12] for p in prompts]


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 13])
def test_length_limit_mid_block(target, draft, prompts, continuations, monkeypatch, max_new_tokens):
    monkeypatch.setattr(draft, "draft_block", OracleDrafter(draft, continuations, pattern=(5,)))
    outputs = make_engine(target, draft, "fixed", max_running_requests=4).generate(prompts, max_new_tokens)
    assert [o.token_ids for o in outputs] == [continuations[tuple(p)][:max_new_tokens] for p in prompts]
    assert all(o.finish_reason is FinishReason.LENGTH for o in outputs)


def test_eos_inside_an_accepted_block(target, draft, prompts, continuations, monkeypatch):
    monkeypatch.setattr(draft, "draft_block", OracleDrafter(draft, continuations, pattern=(5,)))
    engine = make_engine(target, draft, "fixed", max_running_requests=5)
    handles, expected, eos_ids = [], [], []
    for prompt in prompts:
        eos_ids.append(continuations[tuple(prompt)][9])  # a token the target emits mid-way ends the sequence
        expected.append(plain_greedy(target, prompt, 24, eos_token_id=eos_ids[-1]))
        handles.append(engine.submit(prompt, 24, eos_token_id=eos_ids[-1]))
    outputs = [h.result() for h in handles]
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason is FinishReason.STOP and o.token_ids[-1] == eos for o, eos in zip(outputs, eos_ids))


def test_requests_join_between_steps(target, draft, prompts, continuations, monkeypatch):
    monkeypatch.setattr(draft, "draft_block", OracleDrafter(draft, continuations))
    engine = make_engine(target, draft, max_running_requests=4, max_prefill_tokens=5)  # prompts span steps
    handles = []
    for i, prompt in enumerate(prompts):
        handles.append(engine.submit(prompt, 6 + 2 * i))
        for _ in range(i % 3):
            engine.step()
    while engine.step():
        pass
    for i, (handle, prompt) in enumerate(zip(handles, prompts)):
        assert handle.result().token_ids == continuations[tuple(prompt)][:6 + 2 * i]


@torch.no_grad()
def test_short_prompts_admitted_together_share_one_prefill_forward(target, draft, prompts):
    """The left-padded group prefill leaves each request exactly the state a prefill of its own would: the same
    first token, the same target K/V on its prompt slots and the same drafter context (what it drafts from)."""
    engine = make_engine(target, draft, "fixed", max_prefill_tokens=256)
    group_prompts = prompts[:4]
    assert len({len(p) for p in group_prompts}) > 1  # ragged: the group really is left-padded
    for prompt in group_prompts:
        engine.submit(prompt, max_new_tokens=8)
    engine._take_incoming()
    with engine._feature_tap() as tap:
        joining = engine._prefill_admitted(tap)
    assert engine.engine_metrics.prefill_forwards == 1 and len(joining) == 1
    group = joining[0]
    assert [r.prompt_ids for r in group.requests] == group_prompts
    anchors_at = torch.tensor(group.anchor_positions)
    grouped_block = draft.forward_block(group.draft_cache, torch.tensor(group.anchors), anchors_at)
    for row, prompt in enumerate(group_prompts):
        cache = DynamicCache(config=target.config)
        with TargetFeatureTap(target, draft.config.target_layer_ids) as own_tap:
            out = target(input_ids=torch.tensor([prompt]), use_cache=True, **{cache_kwarg(target): cache})
            own_context = draft.extend_context(DraftCache(), own_tap.features(), torch.arange(len(prompt))[None])
        first = int(out.logits[0, -1].argmax())
        assert group.anchors[row] == first and group.anchor_positions[row] == len(prompt)
        slots = group.mask[row].bool()
        assert int(slots.sum()) == len(prompt)
        for grouped_layer, own_layer in zip(group.cache.layers, cache.layers):
            torch.testing.assert_close(grouped_layer.keys[row][:, slots], own_layer.keys[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(grouped_layer.values[row][:, slots], own_layer.values[0], rtol=1e-5,
                                       atol=1e-5)
        own_block = draft.forward_block(own_context, torch.tensor([first]), torch.tensor([len(prompt)]))
        torch.testing.assert_close(grouped_block[row:row + 1], own_block, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("max_prefill_tokens", [8, 40, 1024])
def test_grouped_prefill_outputs_and_first_token_finishes(target, draft, prompts, continuations, monkeypatch,
                                                          max_prefill_tokens):
    """Grouped, partly grouped (padded size over the budget) and chunked prefills give plain greedy's output,
    including requests that end at their first token inside a group (max_new_tokens = 1)."""
    monkeypatch.setattr(draft, "draft_block", OracleDrafter(draft, continuations))
    engine = make_engine(target, draft, "scheduled", max_prefill_tokens=max_prefill_tokens)
    lengths = [1 if i % 3 == 0 else 12 for i in range(len(prompts))]
    handles = [engine.submit(prompt, n) for prompt, n in zip(prompts, lengths)]
    while engine.step():
        pass
    for handle, prompt, n in zip(handles, prompts, lengths):
        assert handle.result().token_ids == continuations[tuple(prompt)][:n]
    if max_prefill_tokens == 1024:
        assert engine.engine_metrics.prefill_forwards == 1


def test_prompts_of_very_different_lengths_are_prefilled_in_separate_groups(target, draft):
    """Padding costs as much as a prompt token: three short prompts share one forward, the long one runs alone,
    and every output still equals plain greedy."""
    prompts = random_prompts(3, seed=4, low=10, high=13) + random_prompts(1, seed=5, low=60, high=61)
    engine = make_engine(target, draft, "fixed", max_prefill_tokens=1024)
    handles = [engine.submit(prompt, max_new_tokens=6) for prompt in prompts]
    engine._take_incoming()
    with engine._feature_tap() as tap:
        joining = engine._prefill_admitted(tap)
    assert engine.engine_metrics.prefill_forwards == 2
    assert sorted(len(group.requests) for group in joining) == [1, 3]
    engine._batch.join(joining)
    while engine.step():
        pass
    for handle, prompt in zip(handles, prompts):
        assert handle.result().token_ids == plain_greedy(target, prompt, 6)


def test_submissions_from_other_threads_during_steps(target, draft, prompts, continuations, monkeypatch):
    monkeypatch.setattr(draft, "draft_block", OracleDrafter(draft, continuations))
    engine = make_engine(target, draft, max_running_requests=6)
    handles, lock = [], threading.Lock()

    def client(offset):
        for prompt in prompts[offset::3]:
            handle = engine.submit(prompt, 16)
            with lock:
                handles.append((prompt, handle))

    with engine:  # background loop; clients submit while steps run
        threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        results = [(prompt, handle.result(timeout=60)) for prompt, handle in handles]
    assert len(results) == len(prompts)
    for prompt, out in results:
        assert out.token_ids == continuations[tuple(prompt)][:16]


def test_streaming_yields_exactly_the_result(target, draft, prompts, continuations):
    engine = make_engine(target, draft, max_running_requests=3).start()
    try:
        handles = [engine.submit(p, 10) for p in prompts[:4]]
        streamed = [list(h) for h in handles]
    finally:
        engine.stop()
    assert streamed == [h.result().token_ids for h in handles] == [continuations[tuple(p)][:10] for p in prompts[:4]]


def test_cancelled_requests_keep_a_prefix(target, draft, prompts, continuations, monkeypatch):
    monkeypatch.setattr(draft, "draft_block", OracleDrafter(draft, continuations))
    engine = make_engine(target, draft, max_running_requests=3)
    handles = [engine.submit(p, 20) for p in prompts]
    engine.step()
    engine.step()
    handles[0].cancel()  # running
    handles[-1].cancel()  # still waiting
    while engine.step():
        pass
    for i, (handle, prompt) in enumerate(zip(handles, prompts)):
        out = handle.result()
        reference = continuations[tuple(prompt)][:20]
        if i in (0, len(prompts) - 1):
            assert out.finish_reason is FinishReason.CANCELLED
            assert out.token_ids == reference[:len(out.token_ids)] and len(out.token_ids) < 20
        else:
            assert out.token_ids == reference
    assert handles[-1].result().token_ids == []
    assert engine.metrics()["finished_requests"]["cancelled"] == 2


def test_compaction_every_step_keeps_outputs(target, draft, prompts, continuations, monkeypatch):
    monkeypatch.setattr(draft, "draft_block", OracleDrafter(draft, continuations))
    engine = make_engine(target, draft, "fixed", max_running_requests=5, max_hole_fraction=0.0)
    outputs = engine.generate(prompts, 18)
    assert [o.token_ids for o in outputs] == [continuations[tuple(p)][:18] for p in prompts]
    assert engine.metrics()["compactions"] > 0


def test_requests_that_never_fit_are_rejected_others_wait(target, draft, prompts, continuations):
    engine = make_engine(target, draft, "fixed", max_batch_tokens=80, max_request_tokens=60)
    with pytest.raises(RequestRejectedError, match="max_request_tokens"):
        engine.submit(list(range(3, 50)), 20)
    with pytest.raises(RequestRejectedError, match="empty"):
        engine.submit([], 4)
    with pytest.raises(ValueError, match="raise max_batch_tokens"):
        make_engine(target, draft, "fixed", max_batch_tokens=40, max_request_tokens=36)  # 36 + γ + 1 > 40
    # each needs 3..16 + 10 + γ + 1 slots, so only 2-3 fit the 80-slot budget at once: the rest wait
    handles = [engine.submit(p, 10) for p in prompts]
    waited = False
    while engine.step():
        m = engine.metrics()
        assert m["reserved_slots"] <= 80 and m["running"] * m["cache_slots"] <= 80
        waited |= m["waiting"] > 0 and m["running"] > 0
    assert waited
    assert [h.result().token_ids for h in handles] == [continuations[tuple(p)][:10] for p in prompts]
    assert engine.metrics()["rejected_requests"] == 2
    too_long = DSparkEngine(target, draft, "fixed", sps=SPS, max_batch_tokens=4096, max_request_tokens=1000)
    with pytest.raises(RequestRejectedError, match="max_position_embeddings"):
        too_long.submit([5] * 500, 20)  # the tiny target has 512 positions


def test_a_failed_step_loses_no_request_and_the_loop_survives(target, draft, prompts, continuations, monkeypatch):
    """A one-off failure inside a shared decode step (the drafter runs out of memory) is nobody's fault: the
    step's requests resume from their committed tokens instead of failing (issue #18), in the engine's own
    thread, and every output still equals plain greedy."""
    engine = make_engine(target, draft, max_running_requests=4)
    original = draft.draft_block
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.OutOfMemoryError("simulated out of memory")
        return original(*args, **kwargs)

    monkeypatch.setattr(draft, "draft_block", flaky)
    with engine:
        first = [engine.submit(p, 8) for p in prompts[:3]]
        assert [h.result(timeout=60).token_ids for h in first] == [continuations[tuple(p)][:8] for p in prompts[:3]]
        later = [engine.submit(p, 8) for p in prompts[3:6]]
        assert [h.result(timeout=60).token_ids for h in later] == [continuations[tuple(p)][:8] for p in prompts[3:6]]
    assert calls["n"] > 2 and engine.metrics()["isolated_step_failures"] == 1
    assert engine.metrics()["finished_requests"] == {"length": 6}


def test_an_unwritable_step_cost_cache_folder_fails_no_request(target, draft, prompts, continuations, tmp_path,
                                                               caplog):
    """The engine measures its step cost with a cache folder it cannot write (here under a regular file): one
    warning, and every request still equals plain greedy (each failed "inside the engine" before)."""
    (tmp_path / "a-file").write_text("")
    engine = DSparkEngine(target, draft, "scheduled", sps_cache_dir=str(tmp_path / "a-file" / "sub"),
                          max_running_requests=2)
    with caplog.at_level("WARNING", logger="hf_dspark.scheduling"), engine:
        handles = [engine.submit(p, 8) for p in prompts[:3]]
        assert [h.result(timeout=120).token_ids for h in handles] == [continuations[tuple(p)][:8]
                                                                       for p in prompts[:3]]
    assert caplog.text.count("cannot write the cache folder") == 1


def test_scheduled_budget_adapts_to_load(target, draft, continuations, monkeypatch):
    """Same confidences, two machines: where verifying is free the scheduler verifies long prefixes; where every
    verify token costs, it verifies only the confident ones. And on one machine, more load -> shorter budget."""
    prompts = random_prompts(16, seed=3)
    continuations = {tuple(p): plain_greedy(target, p, 12 + GAMMA) for p in prompts}
    monkeypatch.setattr(draft, "draft_block", OracleDrafter(draft, continuations, pattern=(3,)))
    budgets = {}
    for name, table in {"idle": {1: 100.0, 512: 99.0}, "loaded": {1: 100.0, 2: 50.0, 512: 100.0 / 512}}.items():
        engine = DSparkEngine(target, draft, "scheduled", sps=table, max_running_requests=4)
        engine.generate(prompts[:4], 12)
        budgets[name] = engine.metrics()["mean_verify_budget"]
    assert budgets["idle"] > 4.0 and budgets["loaded"] < budgets["idle"]
    by_load = {}
    for running in (1, 16):
        engine = make_engine(target, draft, "scheduled", max_running_requests=running)
        engine.generate(prompts, 12)
        by_load[running] = engine.metrics()["mean_verify_budget"]
    assert by_load[16] < by_load[1]


def test_scheduled_skips_the_drafter_when_it_cannot_pay(target, draft, continuations, monkeypatch):
    """With the engine's own step cost: a drafter pass that costs more than verifying can win back makes the
    scheduler skip drafting (after learning the confidences once, plus periodic probes) and the output is still
    plain greedy; a cheap drafter on a latency-bound machine is used every step."""
    prompts = random_prompts(6, seed=5)
    continuations = {tuple(p): plain_greedy(target, p, 16 + GAMMA) for p in prompts}
    monkeypatch.setattr(draft, "draft_block", OracleDrafter(draft, continuations, pattern=(3,)))
    rows, widths = (1, 2, 4, 8), tuple(range(1, GAMMA + 2))
    flat = tuple(tuple(0.01 for _ in widths) for _ in rows)
    results = {}
    for name, draft_seconds in {"dear": 1.0, "cheap": 0.0001}.items():
        cost = StepCostProfile(rows, widths, flat, tuple(draft_seconds for _ in rows))
        engine = DSparkEngine(target, draft, "scheduled", sps=cost, policy_kwargs={"probe_interval": 4},
                              max_running_requests=3)
        outputs = engine.generate(prompts, 16)
        assert [o.token_ids for o in outputs] == [continuations[tuple(p)][:16] for p in prompts]
        results[name] = engine.metrics()
    assert results["cheap"]["skipped_draft_steps"] == 0 and results["cheap"]["mean_verify_budget"] > 2.0
    dear = results["dear"]
    assert dear["skipped_draft_steps"] > dear["decode_steps"] / 2  # probes (every 4th) and the first step draft
    assert dear["mean_verify_budget"] < results["cheap"]["mean_verify_budget"]


def test_the_step_cost_measurement_is_setup_not_serving_time(target, draft, prompts, continuations, monkeypatch):
    """The first engine on a machine measures its step cost (~30 s) inside its first step: that was counted as
    drafting and busy time, so draft_s and tok/s (~0.25 tok/s) described the measurement. Here it takes a (fake)
    hour: the clock jumps while it runs."""
    import time

    from conftest import flat_cost

    from hf_dspark.serving import step_cost_source

    hour, clock, real = 3600.0, {"offset": 0.0}, time.perf_counter

    def measure(*args, **kwargs):
        clock["offset"] += hour
        return flat_cost(max_rows=4, max_width=GAMMA + 1)

    monkeypatch.setattr(time, "perf_counter", lambda: real() + clock["offset"])
    monkeypatch.setattr(step_cost_source, "profile_step_cost", measure)
    engine = DSparkEngine(target, draft, "scheduled", max_running_requests=2)
    outputs = engine.generate(prompts[:2], 8)
    assert [o.token_ids for o in outputs] == [continuations[tuple(p)][:8] for p in prompts[:2]]
    m = engine.metrics()
    assert clock["offset"] == hour and m["step_cost_s"] >= hour  # measured once, reported apart
    assert m["draft_s"] < hour and m["busy_s"] < hour and m["throughput_tok_s"] == 16 / m["busy_s"]


def test_metrics_dict_and_log(target, draft, prompts, continuations, monkeypatch, caplog):
    monkeypatch.setattr(draft, "draft_block", OracleDrafter(draft, continuations))
    engine = make_engine(target, draft, "fixed", max_running_requests=4, log_interval_s=0.0)
    with caplog.at_level("INFO", logger="hf_dspark.serving"):
        outputs = engine.generate(prompts[:6], 12)
    m = engine.metrics()
    for key in ("throughput_tok_s", "mean_verify_budget", "tau", "wasted_verify_tokens", "mean_ttft_s",
                "mean_itl_s", "mean_request_tok_s", "padding_tokens"):
        assert m[key] is not None, key
    assert m["generated_tokens"] == 72 and m["finished_requests"] == {"length": 6}
    assert m["wasted_verify_tokens"] > 0 and m["tau"] > 1.5
    for out in outputs:
        assert out.metrics["ttft_s"] > 0 and out.metrics["num_generated_tokens"] == 12
        assert out.metrics["tokens_per_second"] > 0
    assert any("mean verify budget" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------------------------------------
# Sampling
# ------------------------------------------------------------------------------------------------------------
SMALL_VOCAB = 8
PROMPT = [5, 3, 7, 4]
NUM_POSITIONS = 3


@pytest.fixture(scope="module")
def small_target():
    return make_tiny_llama(seed=5, vocab_size=SMALL_VOCAB)


@pytest.fixture(scope="module")
def small_draft(small_target):
    torch.manual_seed(6)
    return DSparkDraftModel.from_target(small_target, num_layers=1, block_size=3, markov_rank=4).eval()


def exact_marginals(target, processors) -> list[np.ndarray]:
    """P(token at position j) for j = 1..3 by enumerating every prefix (vocab 8: 1 + 8 + 64 rows)."""
    marginals, prefix_probs = [], {(): 1.0}
    for _ in range(NUM_POSITIONS):
        prefixes = list(prefix_probs)
        ids = torch.tensor([PROMPT + list(p) for p in prefixes])
        with torch.no_grad():
            logits = target(input_ids=ids).logits[:, -1].float()
        probs = torch.softmax(processors(ids, logits), -1).double().numpy()
        marginal, nxt = np.zeros(SMALL_VOCAB), {}
        for prefix, row in zip(prefixes, probs):
            marginal += prefix_probs[prefix] * row
            for token in range(SMALL_VOCAB):
                nxt[prefix + (token,)] = prefix_probs[prefix] * row[token]
        marginals.append(marginal)
        prefix_probs = nxt
    return marginals


def chi2_pvalues(samples: list[list[int]], marginals: list[np.ndarray]) -> list[float]:
    pvalues = []
    for j, marginal in enumerate(marginals):
        observed = np.bincount([s[j] for s in samples], minlength=SMALL_VOCAB).astype(float)
        expected = marginal * len(samples)
        big = expected >= 5  # lump rare categories so the χ² approximation holds
        obs = np.append(observed[big], observed[~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        keep = exp > 0
        pvalues.append(float(stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue))
    return pvalues


class FixedDrafts:
    """Drafts are always token 6 (q is one-hot on it); ``report_uniform`` hands verify() a wrong q (uniform)."""

    def __init__(self, draft, report_uniform: bool):
        self.original, self.report_uniform = draft.draft_block, report_uniform

    def __call__(self, *args, **kwargs):
        block = self.original(*args, **kwargs)
        block.tokens.fill_(6)
        q = torch.zeros_like(block.draft_probs)
        q[..., 6] = 1.0
        block.draft_probs = torch.full_like(q, 1.0 / SMALL_VOCAB) if self.report_uniform else q
        return block


def sample_engine(target, draft, n: int, **params) -> list[list[int]]:
    engine = DSparkEngine(target, draft, "fixed", sps=SPS, max_running_requests=64)
    handles = [engine.submit(PROMPT, NUM_POSITIONS, do_sample=True, seed=seed, eos_token_id=[], **params)
               for seed in range(n)]
    return [h.result().token_ids for h in handles]


def test_sampling_preserves_the_target_distribution(small_target, small_draft):
    """The real drafter (Markov head, per-request generators) with temperature and top-k on both p and q."""
    params = {"temperature": 0.8, "top_k": 6}
    processors = SamplingParams(do_sample=True, **params).logits_processors()
    samples = sample_engine(small_target, small_draft, 800, **params)
    assert all(len(s) == NUM_POSITIONS for s in samples)
    pvalues = chi2_pvalues(samples, exact_marginals(small_target, processors))
    assert min(pvalues) > 1e-3, pvalues


@pytest.mark.parametrize("report_uniform", [False, True], ids=["true-q", "wrong-q"])
def test_sampling_needs_the_true_q(small_target, small_draft, monkeypatch, report_uniform):
    """Same drafts both times; only the q handed to verify() differs. The true q passes the χ² test, a wrong one
    must fail it (the test has the power to see a lossy verifier)."""
    monkeypatch.setattr(small_draft, "draft_block", FixedDrafts(small_draft, report_uniform))
    samples = sample_engine(small_target, small_draft, 800)
    pvalues = chi2_pvalues(samples, exact_marginals(small_target, LogitsProcessorList()))
    if report_uniform:
        assert min(pvalues) < 1e-6, pvalues
    else:
        assert min(pvalues) > 1e-3, pvalues


def test_seeded_request_does_not_depend_on_its_batch(target, draft, prompts):
    def run(neighbours: int) -> list[int]:
        engine = make_engine(target, draft, "fixed", max_running_requests=8)
        others = [engine.submit(p, 12, do_sample=True, seed=100 + i) for i, p in enumerate(prompts[1:1 + neighbours])]
        handle = engine.submit(prompts[0], 12, do_sample=True, temperature=0.7, seed=42)
        for other in others:
            other.result()
        return handle.result().token_ids

    assert run(0) == run(5)


def test_mixed_greedy_and_sampled_requests(target, draft, prompts, continuations):
    engine = make_engine(target, draft, max_running_requests=10)
    handles = [engine.submit(p, 12, do_sample=bool(i % 2), seed=i, top_p=0.9) for i, p in enumerate(prompts)]
    for i, (handle, prompt) in enumerate(zip(handles, prompts)):
        tokens = handle.result().token_ids
        if i % 2 == 0:
            assert tokens == continuations[tuple(prompt)][:12]
        else:
            assert len(tokens) == 12 or tokens[-1] == 2


def test_each_request_is_scheduled_on_its_own_modes_calibration(target, draft, prompts, monkeypatch):
    """Greedy rows' confidences use the drafter's greedy fit, sampled rows' the sampling fit (one batch)."""
    gamma = draft.config.block_size
    monkeypatch.setattr(draft.config, "greedy_confidence_temperatures", [100.0] * gamma)
    monkeypatch.setattr(draft.config, "greedy_confidence_offsets", [4.0] * gamma)
    monkeypatch.setattr(draft.config, "confidence_temperatures", [100.0] * gamma)
    monkeypatch.setattr(draft.config, "confidence_offsets", [-4.0] * gamma)
    engine = make_engine(target, draft, "fixed", max_running_requests=10)
    seen = []
    choose = engine.policy.choose
    monkeypatch.setattr(engine.policy, "choose", lambda inputs: seen.append(
        (inputs.confidences.clone(), [not r.params.do_sample for r in engine._batch.requests])) or choose(inputs))
    for i, prompt in enumerate(prompts[:6]):
        engine.submit(prompt, 8, do_sample=bool(i % 2), seed=i)
    while engine.step():
        pass
    assert seen and any(len(set(greedy)) == 2 for _, greedy in seen)  # mixed batches were scheduled
    for confidence, greedy in seen:
        rows = torch.tensor(greedy)
        assert bool((confidence[rows] > 0.95).all()) and bool((confidence[~rows] < 0.05).all())


# ------------------------------------------------------------------------------------------------------------
# Stress
# ------------------------------------------------------------------------------------------------------------
def test_stress_hundreds_of_requests_lose_or_duplicate_nothing(target, draft):
    prompts = random_prompts(24, seed=11, low=1, high=9)
    references = {tuple(p): plain_greedy(target, p, 6) for p in prompts}
    rng = random.Random(0)
    engine = make_engine(target, draft, "scheduled", max_running_requests=24, max_batch_tokens=2048)
    records, lock = [], threading.Lock()

    def client(seed):
        local = random.Random(seed)
        for _ in range(100):
            prompt = local.choice(prompts)
            handle = engine.submit(prompt, local.randint(1, 6))
            cancel = local.random() < 0.1
            if cancel:
                handle.cancel()
            with lock:
                records.append((prompt, handle, cancel))

    with engine:
        threads = [threading.Thread(target=client, args=(seed,)) for seed in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        streamed = {h.request_id: list(h) for _, h, _ in rng.sample(records, 30)}
        results = [(prompt, handle.result(timeout=120), cancel) for prompt, handle, cancel in records]
    assert len(results) == 300 and len({out.request_id for _, out, _ in results}) == 300
    for prompt, out, cancel in results:
        reference = references[tuple(prompt)]
        limit = out.metrics["num_generated_tokens"]
        assert out.token_ids == reference[:limit]
        if out.finish_reason is FinishReason.CANCELLED:
            assert cancel
        else:
            expected_len = min(len(reference), limit)
            assert out.finish_reason in (FinishReason.LENGTH, FinishReason.STOP) and len(out.token_ids) == expected_len
        if out.request_id in streamed:
            assert streamed[out.request_id] == out.token_ids
    finished = engine.metrics()["finished_requests"]
    assert sum(finished.values()) == 300


@pytest.mark.parametrize("policy,policy_kwargs", [("none", {}), ("fixed", {"num_tokens": 3}), ("scheduled", {})])
def test_joining_requests_take_finished_rows_in_place(target, draft, prompts, continuations, monkeypatch, policy,
                                                      policy_kwargs):
    """A closed loop of 3 requests of different lengths: a request joining as another finishes takes its row in
    place (written into the target and drafter caches, no copy of the batch) unless its prompt is wider than the
    batch (then it is stacked); every output equals plain greedy, holes and all."""
    monkeypatch.setattr(draft, "draft_block", OracleDrafter(draft, continuations))
    engine = make_engine(target, draft if policy != "none" else None, policy, policy_kwargs, max_running_requests=3)
    queue, inflight, outputs = list(enumerate(prompts)), [], {}
    while queue or inflight:
        while len(inflight) < 3 and queue:
            index, prompt = queue.pop(0)
            inflight.append((index, engine.submit(prompt, 3 + 4 * (index % 3))))
        engine.step()
        outputs.update((i, h.result().token_ids) for i, h in inflight if h.done())
        inflight = [(i, h) for i, h in inflight if not h.done()]
    for index, prompt in enumerate(prompts):
        assert outputs[index] == continuations[tuple(prompt)][:3 + 4 * (index % 3)]
    assert engine.metrics()["joined_in_place"] > 0
    assert not engine._batch.live_requests and not engine.has_work() and engine.metrics()["running"] == 0
    engine.step()  # the last finished row, vacant until now, is dropped by the next step
    assert len(engine._batch) == 0 and not engine._batch.vacant


@pytest.mark.parametrize("front_room", [True, False])
def test_a_prompt_wider_than_the_batch_widens_it_in_place_or_is_stacked(target, draft, prompts, continuations,
                                                                         monkeypatch, front_room):
    """The vacant row of a finished 3-token request is too narrow for a 16-token prompt: every row is widened to the
    left into the cache buffers' free front slots and the prompt takes the vacant row in place (no copy of the
    batch); with no front room in the buffers it is stacked onto the batch (the vacant row dropped). Both outputs
    stay plain greedy either way."""
    if not front_room:
        monkeypatch.setattr(kv_cache, "MIN_LEAD_SLOTS", 0)
        monkeypatch.setattr(kv_cache, "LEAD_FRACTION", 0.0)
    engine = make_engine(target, draft, "fixed", {"num_tokens": 2}, max_running_requests=2)
    short, done = engine.submit(prompts[2][:3], 8), engine.submit(prompts[3][:3], 2)
    while not done.done():
        engine.step()
    assert engine._batch.vacant
    wide = prompts[0] + prompts[1]
    assert len(wide) > engine._batch.num_slots
    late = engine.submit(wide, 6)
    while engine.step():
        pass
    assert engine.metrics()["joined_in_place"] == int(front_room)
    assert short.result().token_ids == plain_greedy(target, prompts[2][:3], 8)
    assert late.result().token_ids == plain_greedy(target, wide, 6)


@torch.no_grad()
@pytest.mark.parametrize("wider", [False, True])
def test_a_row_joined_in_place_holds_what_a_stacked_row_would(target, draft, prompts, wider):
    """The joining request's committed K/V, mask and drafter context in a vacant row equal those it gets when stacked
    onto the batch (the other rows untouched) — also when its prompt is wider than the batch and every row is
    widened to the left first (the batch as wide as stacking makes it)."""
    joiner = prompts[1] + prompts[2] + prompts[3] if wider else prompts[3][:3]

    def batch_after_join(in_place: bool):
        engine = make_engine(target, draft, "fixed", {"num_tokens": 2}, max_running_requests=2)
        first, second = engine.submit(prompts[0], 2), engine.submit(prompts[1] + prompts[2], 12)
        while not first.done():  # both join; the first finishes and leaves its row
            engine.step()
        assert engine._batch.vacant == {0} and not second.done()
        if not in_place:
            engine._batch.drop_vacant()
        width = engine._batch.num_slots
        assert (len(joiner) > width) is wider
        engine.submit(joiner, 5)
        engine._take_incoming()
        with engine._feature_tap() as tap:
            joining = engine._prefill_admitted(tap)
            engine._batch.flush_context(draft)
            assert engine._batch.join(joining) == int(in_place)
        batch = engine._batch
        row = [r.request_id for r in batch.requests].index(batch.requests[-1 if not in_place else 0].request_id)
        kept = batch.mask[row].bool()
        layers = [(layer.keys[row][:, kept], layer.values[row][:, kept]) for layer in batch.cache.layers]
        context = batch.draft_cache.row(row)
        other = batch.requests.index(next(r for r in batch.requests if r.request_id == second.request_id))
        other_kv = batch.cache.layers[0].keys[other][:, batch.mask[other].bool()]
        assert batch.num_slots == max(width, len(joiner)) == batch.cache.get_seq_length()
        return layers, context, other_kv, batch.anchors[row], batch.anchor_positions[row]

    stacked, in_place = batch_after_join(False), batch_after_join(True)
    for (k1, v1), (k2, v2) in zip(stacked[0], in_place[0]):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    for a, b in zip(stacked[1].keys + stacked[1].values, in_place[1].keys + in_place[1].values):
        assert torch.equal(a, b)
    assert torch.equal(stacked[1].positions, in_place[1].positions)
    assert torch.equal(stacked[2], in_place[2]) and stacked[3:] == in_place[3:]


def test_generate_with_a_refused_prompt_leaves_no_request_behind(target, draft, prompts, continuations):
    """``engine.generate`` submits prompt by prompt: a refused one raised, but the prompts before it stayed queued
    with no handle anyone holds, ran at the next step and left their text in the lookup history and prefix cache."""
    engine = make_engine(target, draft, "scheduled")
    with pytest.raises(RequestRejectedError, match="outside the target's vocabulary"):
        engine.generate([prompts[0], prompts[1], [5, VOCAB]], 8)
    engine.step()
    assert not engine.has_work() and engine.metrics()["generated_tokens"] == 0
    assert engine.metrics()["finished_requests"] == {"cancelled": 2}
    assert not engine._lookup.history.keys() and len(engine._prefixes) == 0
    outputs = engine.generate(prompts[:2], 8)
    assert [o.token_ids for o in outputs] == [continuations[tuple(p)][:8] for p in prompts[:2]]


def test_generation_config_settings_the_engine_does_not_apply_are_named(target, draft, caplog):
    """Plain ``generate`` applies the target's generation config (a repetition penalty changes its greedy tokens);
    the engine does not, and said nothing: its greedy output silently differed from plain greedy's."""
    prompt = random_prompts(1, seed=7)[0]
    penalised = make_tiny_llama(seed=0)
    penalised.generation_config.repetition_penalty = 1.5
    penalised.generation_config.no_repeat_ngram_size = 0  # neutral: not named
    with caplog.at_level("WARNING", logger="hf_dspark.serving"):
        engine = DSparkEngine(penalised, None, "none")
    assert "repetition_penalty=1.5" in caplog.text and "no_repeat_ngram_size" not in caplog.text
    assert engine.submit(prompt, 16).result().token_ids != plain_greedy(penalised, prompt, 16)  # why it warns
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_dspark.serving"):
        make_engine(target, draft)
    assert "generation_config" not in caplog.text
