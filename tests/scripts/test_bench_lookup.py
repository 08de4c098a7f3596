"""bench_lookup: the greedy replay's accounting and the scripted agent replies (no tokenizer, no model)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from hf_dspark.speculation.lookup import LookupHistory, LookupHistoryKey, LookupProposer
from hf_dspark.speculation.lookup_calibration import LookupCalibrator

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location("bench_lookup", SCRIPTS / "bench_lookup.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_replay_commits_every_reply_token_once(bench):
    prompt = list(range(100, 130))
    generations = [("plan", prompt, prompt[5:20] + [7]), ("answer", prompt, [1, 2, 3, 7])]
    key = LookupHistoryKey("t", "k")
    stats = bench.replay(LookupProposer(LookupHistory(), key), generations, LookupCalibrator(), block=8,
                         survival_cut=0.0)
    assert stats["tokens"] == 16 + 4
    assert stats["tau_full"] == pytest.approx(stats["tokens"] / stats["rounds"])
    assert stats["tau_cut"] == pytest.approx(stats["tau_full"])  # no cut: every draft verified
    assert stats["acceptance"] <= 1 and stats["accepted_per_round"] <= stats["mean_proposal_len"]
    assert stats["rounds"] < 16 + 4  # the copied span was drafted


def test_scripted_replies_copy_the_tool_result(bench):
    for turn in bench.agent.TURNS:
        call = json.loads(bench.scripted_reply("tool_call", turn))
        assert call["tool"] == turn.tool and set(call["arguments"]) == set(bench.ARGUMENT_KEYS[turn.tool])
        other = bench.perturbed(turn)
        assert other.tool == turn.tool and other.result != turn.result
