"""bench_agent_loop.run_step: identical outputs pass; a differing output stops the run, or with allow_mismatch is
recorded (where the outputs part) and both histories continue on the plain reply."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_agent_loop.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_agent_loop", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class FakeSession:
    def __init__(self, token_ids):
        self.messages, self.token_ids, self.max_new_tokens = [], token_ids, None

    def add_message(self, role, content):
        self.messages.append({"role": role, "content": content})

    def reply(self):
        text = " ".join(map(str, self.token_ids))
        self.messages.append({"role": "assistant", "content": text})
        stats = SimpleNamespace(rounds=2, committed_tokens=len(self.token_ids))
        return SimpleNamespace(token_ids=list(self.token_ids), text=text, num_tokens=len(self.token_ids), stats=stats)


def test_run_step_identical_and_mismatch(bench):
    turn = bench.TURNS[0]
    row = bench.run_step(FakeSession([1, 2, 3]), FakeSession([1, 2, 3]), "plan", turn, spec_first=False)
    assert row["identical"] and row["first_difference"] is None and row["tokens"] == 3
    with pytest.raises(AssertionError, match="differs from plain greedy"):
        bench.run_step(FakeSession([1, 2, 3]), FakeSession([1, 5, 3]), "plan", turn, spec_first=True)
    plain, spec = FakeSession([1, 2, 3]), FakeSession([1, 5, 3])
    row = bench.run_step(plain, spec, "plan", turn, spec_first=True, allow_mismatch=True)
    assert not row["identical"] and row["first_difference"] == 1
    assert spec.messages == plain.messages  # the next step sees the same history in both arms
