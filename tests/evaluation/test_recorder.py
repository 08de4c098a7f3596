"""RoundRecorder / RoundTrace: τ and per-position rates of a scripted acceptance trace computed by hand, the
generate hook, save/load, and the threshold override."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from eval_fixtures import make_setup

from hf_dspark.evaluation.harness import count_new_tokens
from hf_dspark.evaluation.recorder import RoundRecorder, RoundTrace

# Scripted rounds (γ = 5): proposed, accepted, committed. The last round was cut by EOS after 3 tokens.
PROPOSED = [5, 5, 5, 3]
ACCEPTED = [5, 2, 0, 3]
COMMITTED = [6, 3, 1, 3]


def scripted_recorder() -> RoundRecorder:
    """Feed the rounds through the generate hook's interface, as two batches of two rows, two benchmarks."""
    recorder = RoundRecorder(block_size=5)
    logits = torch.arange(20, dtype=torch.float32).reshape(4, 5) / 10
    for rows, tag in ((slice(0, 2), "gsm8k"), (slice(2, 4), "mt-bench")):
        recorder.tag = tag
        recorder.observe_round(torch.tensor(PROPOSED[rows]), torch.tensor(ACCEPTED[rows]),
                               torch.tensor(COMMITTED[rows]), logits[rows])
    return recorder


def test_tau_and_per_position_rates_by_hand():
    trace = scripted_recorder().trace()
    assert len(trace) == 4
    assert trace.tau == pytest.approx((6 + 3 + 1 + 3) / 4)  # bonus included, the EOS round counts its 3 tokens
    assert trace.select("gsm8k").tau == pytest.approx((6 + 3) / 2)
    assert trace.select("mt-bench").tau == pytest.approx((1 + 3) / 2)
    stats = trace.stats()
    assert (stats.rounds, stats.committed_tokens, stats.proposed_tokens, stats.accepted_tokens) == (4, 13, 18, 10)
    # position k: rounds proposing it / reaching it (drafts < k accepted) / accepting it
    # k=1: 4/4/3  k=2: 4/3/3  k=3: 4/3/2  k=4: 3/1/1  k=5: 3/1/1
    assert stats.conditional_acceptance == pytest.approx([3 / 4, 3 / 3, 2 / 3, 1 / 1, 1 / 1])
    assert stats.unconditional_acceptance == pytest.approx([3 / 4, 3 / 4, 2 / 4, 1 / 3, 1 / 3])
    np.testing.assert_allclose(trace.confidence_logits[3], [1.5, 1.6, 1.7, 1.8, 1.9], rtol=1e-6)


def test_from_rounds_defaults_and_validation():
    trace = RoundTrace.from_rounds(PROPOSED, ACCEPTED, block_size=5)
    assert trace.num_committed.tolist() == [6, 3, 1, 4] and not trace.has_confidence
    with pytest.raises(ValueError, match="num_accepted must lie in"):
        RoundTrace.from_rounds([2], [3], block_size=5)
    with pytest.raises(ValueError, match="num_committed must lie in"):
        RoundTrace.from_rounds([2], [1], [3], block_size=5)
    with pytest.raises(ValueError, match="one entry per round"):
        RoundTrace.from_rounds([2, 2], [1, 1], [2], block_size=5)


def test_save_load_round_trip(tmp_path):
    trace = scripted_recorder().trace()
    loaded = RoundTrace.load(trace.save(tmp_path / "rounds.npz"))
    for name in ("num_proposed", "num_accepted", "num_committed", "confidence_logits"):
        np.testing.assert_array_equal(getattr(loaded, name), getattr(trace, name))
    assert loaded.tags.tolist() == ["gsm8k", "gsm8k", "mt-bench", "mt-bench"]
    assert len(RoundRecorder(5).trace()) == 0


def test_generate_hook_records_every_round():
    target, _, dspark, dflash = make_setup()
    ids = torch.tensor([[0, 0, 5, 6, 7], [9, 10, 11, 12, 13]])
    mask = (ids != 0).long()
    for drafter in (dspark, dflash):
        recorder = RoundRecorder(drafter.config.block_size, tag="x")
        out = target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=14,
                              do_sample=False, pad_token_id=0, dspark_recorder=recorder)
        trace, stats = recorder.trace(), drafter.stats
        assert len(trace) == stats.rounds > 0 and set(trace.tags) == {"x"}
        assert trace.tau == pytest.approx(stats.tau)
        assert trace.stats().conditional_acceptance == pytest.approx(stats.conditional_acceptance, nan_ok=True)
        # every generated token (through EOS) but each row's first, which the prefill produced, was
        # committed by exactly one recorded round
        assert int(trace.num_committed.sum()) == count_new_tokens(out, ids.shape[1], {2}) - len(ids)
        assert trace.has_confidence == (drafter is dspark)


def test_recorder_refused_without_a_dspark_assistant():
    target, *_ = make_setup()
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="needs a DSpark assistant_model"):
        target.generate(input_ids=ids, max_new_tokens=2, dspark_recorder=RoundRecorder(5))
