"""device_check.py on CPU (--quick): the greedy-identity and χ² checks pass (the wrong-q control is rejected),
the round-cost benchmark runs, the sections a CPU skips say so, and a diverging path fails the check."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def device_check():
    spec = importlib.util.spec_from_file_location("device_check", SCRIPTS / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_quick_cpu_run_passes_and_writes_one_json(device_check, tmp_path):
    doc = device_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "device_check.json").read_text()) == doc
    assert doc["passed"]
    assert {row["dtype"] for row in doc["greedy"]} == {"float32", "bfloat16"}
    paths = {row["path"] for row in doc["greedy"]}
    assert {"generate_b1_oracle", "generate_b3_oracle", "engine_oracle", "engine_random"} <= paths
    # the oracle's blocks were really used (in bf16 a near-tie can make the reference drift from the decode)
    assert all(row["tau"] > 1.5 for row in doc["greedy"] if row["path"].endswith("oracle") and row["identical"]
               == row["prompts"] and row["dtype"] == "float32")
    wrong_q = [row for row in doc["sampling"] if row["path"].startswith("engine_wrong_q")]
    assert len(wrong_q) == 2 and all(row["passed"] and min(row["pvalues"]) < 1e-6 for row in wrong_q)
    assert all(r["status"].startswith(("ok", "n/a")) for r in doc["overhead"]["results"])
    assert "skipped" in doc["smollm2"] and "skipped" in doc["embedded"]


def test_a_diverging_path_fails_the_greedy_check(device_check, monkeypatch):
    real = device_check.greedy_paths

    def diverging(*args, **kwargs):
        paths = real(*args, **kwargs)
        outputs, tau = paths["generate_b1_random"]
        outputs[0][3] = (outputs[0][3] + 1) % 96  # a wrong token where the target is far from a tie
        return paths

    monkeypatch.setattr(device_check, "greedy_paths", diverging)
    import torch

    rows = device_check.check_greedy(torch.device("cpu"), "float32", ["llama"], num_prompts=2, num_new=6)
    broken = next(row for row in rows if row["path"] == "generate_b1_random")
    assert not broken["passed"] and broken["failures"][0]["position"] == 3
    assert all(row["passed"] for row in rows if row is not broken)
