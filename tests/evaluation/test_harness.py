"""Evaluation harness: threshold sweep derived by hand, token counting, and evaluate() end to end on a tiny
target with two tiny benchmark files (markdown, strict JSON, PNGs, lossless greedy token counts)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from eval_fixtures import make_setup, write_eval_dir

from hf_dspark.evaluation.harness import (
    count_new_tokens,
    drafter_label,
    evaluate,
    sampling_kwargs,
    threshold_sweep,
)
from hf_dspark.evaluation.recorder import RoundTrace


def logit(p):
    return math.log(p / (1 - p))


# γ = 4. Confidences c_k per round, proposed / accepted / committed. Round 3 was cut by the length budget.
CONFIDENCE = [[0.9, 0.8, 0.3, 0.9], [0.6, 0.2, 0.9, 0.9], [0.4, 0.9, 0.9, 0.9], [0.9, 0.9, 0.9, 0.9]]
HAND_TRACE = dict(num_proposed=[4, 4, 4, 2], num_accepted=[4, 1, 0, 2], num_committed=[5, 2, 1, 3],
                  confidence_logits=[[logit(c) for c in row] for row in CONFIDENCE])


def test_threshold_sweep_by_hand():
    sweep = threshold_sweep(RoundTrace.from_rounds(**HAND_TRACE), thresholds=[0.0, 0.25, 0.5, 0.85])
    # verified drafts m_t = min(proposed, first k with c_k < t); accepted_t = min(accepted, m_t);
    # committed_t = committed if m_t >= accepted else m_t + 1
    # t=0    : m = 4 4 4 2, a = 4 1 0 2, committed 5 2 1 3
    # t=0.25 : m = 4 1 4 2, a = 4 1 0 2, committed 5 2 1 3
    # t=0.5  : m = 2 1 0 2, a = 2 1 0 2, committed 3 2 1 3
    # t=0.85 : m = 1 0 0 2, a = 1 0 0 2, committed 2 1 1 3
    assert sweep.thresholds == [0.0, 0.25, 0.5, 0.85]
    assert sweep.acceptance_rate == pytest.approx([7 / 14, 7 / 11, 5 / 5, 3 / 3])
    assert sweep.drafts_per_round == pytest.approx([14 / 4, 11 / 4, 5 / 4, 3 / 4])
    assert sweep.tau == pytest.approx([11 / 4, 11 / 4, 9 / 4, 7 / 4])


def test_threshold_sweep_uses_the_drafters_temperatures():
    trace = RoundTrace.from_rounds(**HAND_TRACE)
    plain = threshold_sweep(trace, thresholds=[0.65])
    soft = threshold_sweep(trace, thresholds=[0.65], temperatures=[10.0] * 4)  # every c_k falls to ~0.5 < 0.65
    assert plain.drafts_per_round == pytest.approx([(2 + 0 + 0 + 2) / 4])
    assert soft.drafts_per_round == [0.0] and soft.tau == pytest.approx([1.0]) and math.isnan(soft.acceptance_rate[0])
    assert threshold_sweep(trace, [0.65], temperatures=[1.0] * 4) == plain


def test_threshold_sweep_needs_confidence():
    with pytest.raises(ValueError, match="confidence head"):
        threshold_sweep(RoundTrace.from_rounds([4], [1], block_size=4))


def test_threshold_sweep_of_no_rounds_says_the_trace_is_empty():
    # not "needs confidence logits": the drafter may well have a confidence head, it just recorded no round
    with pytest.raises(ValueError, match="at least one recorded round"):
        threshold_sweep(RoundTrace.from_rounds([], [], np.zeros((0, 4))))


def test_count_new_tokens_stops_at_the_first_eos():
    seqs = torch.tensor([[9, 9, 5, 2, 0, 0], [9, 9, 5, 6, 7, 8], [9, 9, 2, 0, 0, 0]])
    assert count_new_tokens(seqs, 2, {2}) == 2 + 4 + 1
    assert count_new_tokens(seqs, 2, set()) == 12


def test_sampling_kwargs():
    assert sampling_kwargs(0.0) == {"do_sample": False}
    assert sampling_kwargs(1.0) == {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    target, tok, dspark, dflash = make_setup()
    assert (drafter_label(dspark), drafter_label(dflash)) == ("DSpark", "DFlash")
    dspark.config.confidence_temperatures = [2.0] * 5  # as if calibrated: 'after' must use these
    eval_dir = write_eval_dir(tmp_path_factory.mktemp("eval"))
    result = evaluate(target, tok, {"DSpark": dspark, "DFlash": dflash}, benchmarks=["gsm8k", "mt-bench"],
                      eval_dir=eval_dir, temperatures=(0.0, 1.0), max_new_tokens=12, max_samples=3, batch_size=2,
                      progress=False)
    out = tmp_path_factory.mktemp("out")
    return result, result.save(out), out


def test_evaluate_metrics_come_from_the_recorded_rounds(evaluated):
    result, _, _ = evaluated
    assert result.settings["num_prompts"] == {"gsm8k": 3, "mt-bench": 3}
    assert len(result.results) == 2 * 2 * 2  # drafters x benchmarks x temperatures
    for r in result.results:
        trace = result.traces[(r.drafter, r.temperature)].select(r.benchmark)
        assert len(trace) == r.stats["rounds"] > 0
        assert r.tau == pytest.approx(trace.num_committed.sum() / len(trace))
        assert r.generated_tokens == int(trace.num_committed.sum()) + r.num_prompts  # + each prompt's first token
        assert r.plain_tokens_per_second > 0 and r.speedup > 0 and r.stats["verify_seconds"] > 0
        if r.drafter == "DSpark":  # threshold 0 reproduces the run itself
            assert r.threshold_sweep.tau[0] == pytest.approx(r.tau)
            assert r.threshold_sweep.acceptance_rate[0] == pytest.approx(r.stats["acceptance_rate"])
            assert [p.temperature for p in r.calibration] == [2.0] * 5
        else:
            assert r.threshold_sweep is None and r.calibration is None
        if r.temperature == 0.0:  # greedy speculative decoding is lossless: same tokens as plain generate
            assert r.generated_tokens == r.plain_tokens
    assert set(result.calibration) == {("DSpark", 0.0), ("DSpark", 1.0)}


def test_evaluate_writes_markdown_json_and_plots(evaluated):
    result, written, out = evaluated
    md = (out / "results.md").read_text()
    assert "τ DSpark/DFlash" in md and "| gsm8k | 0 | 3 |" in md and "| **mean** | 1 | 6 |" in md
    assert "## Confidence calibration" in md and "threshold sweep" in md
    data = json.loads((out / "results.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert data["drafters"] == ["DSpark", "DFlash"] and len(data["results"]) == 8
    first = data["results"][0]
    assert first["tau"] == pytest.approx(result.results[0].tau) and "speedup" in first
    for name in ("position_acceptance_T0.png", "position_acceptance_T1.png", "threshold_sweep_DSpark_T1.png",
                 "reliability_DSpark_T0.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert not (out / "threshold_sweep_DFlash_T0.png").exists()
    loaded = RoundTrace.load(out / "rounds_DSpark_T1.npz")
    np.testing.assert_array_equal(loaded.num_accepted, result.traces[("DSpark", 1.0)].num_accepted)


def test_evaluate_single_drafter_without_speedup(tmp_path):
    target, tok, dspark, _ = make_setup()
    result = evaluate(target, tok, dspark, benchmarks=["mt-bench"], eval_dir=write_eval_dir(tmp_path),
                      temperatures=(1.0,), max_new_tokens=6, max_samples=1, measure_speedup=False, progress=False)
    (r,) = result.results
    assert result.drafters == ["DSpark"] and r.speedup is None and r.plain_tokens is None
    assert dspark.config.confidence_threshold == 0.0  # untouched
    assert "τ DSpark" in result.to_markdown() and "/DFlash" not in result.to_markdown()


def test_three_drafters_give_a_ratio_to_each_baseline(tmp_path):
    """An Eagle3 baseline next to DSpark and DFlash: labelled, scored on the same prompts, one τ ratio per baseline."""
    from hf_dspark import Eagle3DraftModel

    target, tok, dspark, dflash = make_setup()
    torch.manual_seed(2)
    eagle3 = Eagle3DraftModel.from_target(target, block_size=dspark.config.block_size).eval()
    assert drafter_label(eagle3) == "Eagle3"
    result = evaluate(target, tok, {"DSpark": dspark, "DFlash": dflash, "Eagle3": eagle3}, benchmarks=["gsm8k"],
                      eval_dir=write_eval_dir(tmp_path), temperatures=(0.0,), max_new_tokens=10, max_samples=2,
                      batch_size=2, progress=False)
    taus = {r.drafter: r.tau for r in result.results}
    assert set(taus) == {"DSpark", "DFlash", "Eagle3"} and all(t >= 1 for t in taus.values())
    eagle3_row = next(r for r in result.results if r.drafter == "Eagle3")
    assert eagle3_row.generated_tokens == eagle3_row.plain_tokens  # greedy: lossless
    md = result.to_markdown()
    assert "τ DSpark/DFlash" in md and "τ DSpark/Eagle3" in md
