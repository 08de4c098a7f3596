"""Calibration flow: STS temperatures written into the saved drafter lower ECE on an over-confident trace;
a tiny end-to-end run; evaluation prompts refused; held-out prompt selection."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from eval_fixtures import MATH, make_setup, write_eval_dir

from hf_dspark import DSparkDraftModel
from hf_dspark.evaluation.calibration_run import (calibrate, fit_from_trace, held_out_prompts, load_rounds_for,
                                                  save_calibrated)
from hf_dspark.evaluation.recorder import RoundTrace
from hf_dspark.training.calibration import calibration_report

HELD_OUT = ["what green car ?", "please count from six to nine book ?", "what blue lamp ?"]


def overconfident_trace(num_rounds=6000, gamma=5, inflate=3.0, seed=0) -> RoundTrace:
    """True conditional survival σ(u_k), drafts accepted left to right until the first rejection; the head
    reports z = inflate · u (over-confident, as a raw BCE-trained head is)."""
    rng = np.random.default_rng(seed)
    u = rng.normal(1.0, 1.2, size=(num_rounds, gamma))
    accepted = np.cumprod(rng.random((num_rounds, gamma)) < 1 / (1 + np.exp(-u)), axis=1).sum(1)
    return RoundTrace.from_rounds([gamma] * num_rounds, accepted, confidence_logits=inflate * u)


@pytest.fixture(scope="module")
def setup():
    return make_setup()


def test_saved_temperatures_lower_ece_on_an_overconfident_trace(setup, tmp_path):
    target, _, dspark, _ = setup
    trace = overconfident_trace()
    run = fit_from_trace(trace, serving_temperature=1.0, num_prompts=0, offsets=False)  # the paper's STS
    written = save_calibrated(dspark, run, tmp_path / "calibrated")
    assert dspark.config.confidence_temperatures is None  # the passed drafter is left as it was
    saved = json.loads((tmp_path / "calibrated" / "config.json").read_text())["confidence_temperatures"]
    assert saved == pytest.approx(run.temperatures) and saved == pytest.approx([3.0] * 5, rel=0.25)
    reloaded = DSparkDraftModel.from_pretrained(tmp_path / "calibrated", target=target)
    report = calibration_report(trace.confidence_logits, trace.num_accepted, trace.num_proposed,
                                temperatures=reloaded.config.confidence_temperatures)
    for row in report:
        assert row.ece_before > 0.05 and row.ece_after < row.ece_before / 3, row
    z = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    torch.testing.assert_close(reloaded.confidence_from_logits(z), torch.sigmoid(z / torch.tensor(saved)))
    data = json.loads((tmp_path / "calibrated" / "calibration.json").read_text())
    assert data["confidence_temperatures"] == pytest.approx(saved) and len(data["positions"]) == 5
    assert "ECE raw" in (tmp_path / "calibrated" / "calibration.md").read_text()
    assert open(written["reliability"], "rb").read(4) == b"\x89PNG"
    assert len(RoundTrace.load(written["rounds"])) == len(trace)


def test_saved_offsets_are_reloaded_and_applied(setup, tmp_path):
    target, _, dspark, _ = setup
    trace = overconfident_trace()
    shifted = RoundTrace.from_rounds(trace.num_proposed, trace.num_accepted,
                                     confidence_logits=trace.confidence_logits + 3.0)
    grids = {"grid": np.logspace(-1, 1, 41), "offset_grid": np.linspace(-4, 4, 33)}  # coarse: a fast test
    run = fit_from_trace(shifted, serving_temperature=1.0, num_prompts=0, **grids)  # temperatures + offsets
    temps_only = fit_from_trace(shifted, serving_temperature=1.0, num_prompts=0, offsets=False, grid=grids["grid"])
    # z = 3u + 3 for a true logit u: position 1 recovers σ(z / 3 − 1)
    assert run.offsets is not None and len(run.offsets) == 5
    assert run.temperatures[0] == pytest.approx(3.0, rel=0.15) and run.offsets[0] == pytest.approx(-1.0, abs=0.3)
    assert run.report[0].ece_after < temps_only.report[0].ece_after
    save_calibrated(dspark, run, tmp_path / "calibrated")
    assert getattr(dspark.config, "confidence_offsets", None) is None  # the passed drafter is left as it was
    reloaded = DSparkDraftModel.from_pretrained(tmp_path / "calibrated", target=target)
    assert reloaded.config.confidence_offsets == pytest.approx(run.offsets)
    z = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    expected = torch.sigmoid(z / torch.tensor(run.temperatures) + torch.tensor(run.offsets))
    torch.testing.assert_close(reloaded.confidence_from_logits(z), expected)
    data = json.loads((tmp_path / "calibrated" / "calibration.json").read_text())
    assert data["confidence_offsets"] == pytest.approx(run.offsets)
    assert "b_k" in (tmp_path / "calibrated" / "calibration.md").read_text()
    # out of sample (split halves) the offsets still beat temperatures alone at position 1
    assert run.split_half_ece[0] < temps_only.split_half_ece[0]
    assert data["split_half_ece"] == pytest.approx(run.split_half_ece)
    assert data["split_half_noise_floor"] == pytest.approx(run.split_half_noise_floor)
    assert "Noise floor" in (tmp_path / "calibrated" / "calibration.md").read_text()


def test_calibrate_end_to_end_on_a_tiny_target(setup, tmp_path):
    target, tok, dspark, _ = setup
    run = calibrate(target, tok, dspark, HELD_OUT, temperature=1.0, max_new_tokens=10, batch_size=2,
                    eval_dir=write_eval_dir(tmp_path), progress=False)
    assert len(run.trace) > 0 and run.trace.has_confidence and set(run.trace.tags) == {"calibration"}
    assert len(run.temperatures) == 5 and all(t > 0 for t in run.temperatures)
    assert [p.position for p in run.report] == [1, 2, 3, 4, 5] and run.num_prompts == 3
    assert dspark.config.confidence_temperatures is None and dspark.config.confidence_threshold == 0.0


def test_eval_overlap_is_refused(setup, tmp_path):
    target, tok, dspark, _ = setup
    with pytest.raises(ValueError, match="overlap the evaluation sets"):
        calibrate(target, tok, dspark, HELD_OUT + [MATH[0]], max_new_tokens=4, eval_dir=write_eval_dir(tmp_path),
                  progress=False)
    with pytest.raises(FileNotFoundError, match="refuse eval overlap"):
        calibrate(target, tok, dspark, HELD_OUT, max_new_tokens=4, eval_dir=tmp_path / "missing", progress=False)


def test_a_drafter_without_confidence_head_is_refused(setup, tmp_path):
    target, tok, _, dflash = setup
    with pytest.raises(ValueError, match="no confidence head"):
        calibrate(target, tok, dflash, HELD_OUT, eval_dir=write_eval_dir(tmp_path), progress=False)
    with pytest.raises(ValueError, match="confidence head"):
        fit_from_trace(RoundTrace.from_rounds([5], [2], block_size=5))


def test_held_out_prompts_take_the_tail(tmp_path):
    path = tmp_path / "train.jsonl"
    records = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"},
                                            {"role": "assistant", "content": "answer"}]} for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert [p.first_turn for p in held_out_prompts(path, 2)] == ["question 4", "question 5"]
    assert len(held_out_prompts(path)) == 6


@pytest.mark.parametrize("damage", ["text file", "truncated npz", "other arrays"])
def test_rounds_that_are_not_a_calibration_run_name_the_file(damage, tmp_path):
    """numpy's errors ("contains pickled (object) data", BadZipFile, KeyError) named neither the file nor what it
    should hold; hf-dspark calibrate --rounds shows this message as its one error line."""
    path = tmp_path / "calibration_rounds.npz"
    if damage == "text file":
        path.write_text("not rounds")
    elif damage == "truncated npz":
        overconfident_trace(num_rounds=20).save(path)
        path.write_bytes(path.read_bytes()[:100])
    else:
        np.savez(path, x=np.zeros(3))
    with pytest.raises(ValueError, match=re.escape(f"{path} is not the calibration_rounds.npz of an hf-dspark "
                                                   "calibrate run (")):
        load_rounds_for(SimpleNamespace(config=SimpleNamespace(block_size=5)), path)
