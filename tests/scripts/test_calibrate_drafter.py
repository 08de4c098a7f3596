"""``hf-dspark calibrate --rounds`` (the step the recipes in scripts/*.sh run): refit STS (with offsets by default)
from recorded rounds, without generating."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hf_dspark import DSparkDraftModel
from hf_dspark.cli import main as hf_dspark_main
from hf_dspark.evaluation.recorder import RoundTrace


def calibrate(argv: list[str]) -> int:
    return hf_dspark_main(["calibrate", *argv])


def shifted_trace(num_rounds: int = 3000, gamma: int = 5, seed: int = 0) -> RoundTrace:
    """Realised acceptance follows σ(u); the head reports u + 2 (over-confident on every round)."""
    rng = np.random.default_rng(seed)
    u = rng.normal(0.0, 1.0, size=(num_rounds, gamma))
    accepted = np.cumprod(rng.random((num_rounds, gamma)) < 1 / (1 + np.exp(-u)), axis=1).sum(1)
    return RoundTrace.from_rounds([gamma] * num_rounds, accepted, confidence_logits=u + 2.0)


def test_refit_from_rounds_writes_offsets(tmp_path, tiny_target, tiny_drafter):
    tiny_target.save_pretrained(tmp_path / "target")
    tiny_drafter.save_pretrained(tmp_path / "drafter")
    rounds = shifted_trace().save(tmp_path / "rounds.npz")
    assert calibrate(["--drafter", str(tmp_path / "drafter"), "--out", str(tmp_path / "out"), "--rounds",
                      str(rounds), "--rounds-temperature", "1", "--target", str(tmp_path / "target"),
                      "--no-plots"]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["confidence_offsets"][0] == pytest.approx(-2.0, abs=0.4)
    report = json.loads((tmp_path / "out" / "calibration.json").read_text())
    assert report["positions"][0]["ece_after"] < 0.03 < report["positions"][0]["ece_before"]
    loaded = DSparkDraftModel.from_pretrained(tmp_path / "out", target=tiny_target)
    z = torch.zeros(1, 5)
    assert float(loaded.confidence_from_logits(z)[0, 0]) < 0.3  # σ(0 / T + b) with b ≈ −2


def test_rounds_of_another_block_size_are_refused(tmp_path, tiny_target, tiny_drafter, capsys):
    tiny_target.save_pretrained(tmp_path / "target")
    tiny_drafter.save_pretrained(tmp_path / "drafter")
    rounds = shifted_trace(num_rounds=50, gamma=3).save(tmp_path / "rounds.npz")
    with pytest.raises(SystemExit) as exit_:  # a user error: one line on stderr, exit code 2
        calibrate(["--drafter", str(tmp_path / "drafter"), "--out", str(tmp_path / "out"), "--rounds", str(rounds),
                   "--target", str(tmp_path / "target"), "--no-plots"])
    assert exit_.value.code == 2
    assert "block size 3" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_refit_refuses_rounds_of_another_drafter(tiny_drafter, tmp_path):
    from hf_dspark.evaluation.calibration_run import load_rounds_for

    rounds = shifted_trace(num_rounds=50, gamma=3).save(tmp_path / "rounds.npz")
    with pytest.raises(ValueError, match="holds rounds of block size 3, the drafter drafts 5"):
        load_rounds_for(tiny_drafter, rounds)
