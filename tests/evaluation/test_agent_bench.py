"""The agent-loop benchmark: every arm runs every generation, outputs are compared with plain, arms share nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from chat_data import make_chat_tokenizer  # noqa: E402

from hf_dspark import DSparkDraftModel  # noqa: E402
from hf_dspark.evaluation.agent_bench import (DEFAULT_ARMS, TOOL_SCENARIOS, prepare_arms, run_conversation,  # noqa: E402
                                              run_workloads, summarize, table, tool_call_generations)
from hf_dspark.speculation.shared_state import shared_state_for  # noqa: E402


@pytest.fixture(scope="module")
def setup():
    target = make_tiny_llama().eval()
    torch.manual_seed(0)
    drafter = DSparkDraftModel.from_target(target, num_layers=1).eval()
    return target, make_chat_tokenizer(), drafter


def test_tool_scenarios_are_a_call_and_an_answer_per_tool():
    for scenario in TOOL_SCENARIOS:
        steps = [step for _, step, _ in tool_call_generations(scenario)]
        assert steps == ["call", None, "answer"] * len(scenario.uses)


def test_every_arm_matches_plain_and_speculative_arms_share_nothing(setup):
    target, tokenizer, drafter = setup
    arms = prepare_arms(target, drafter)
    speculative = [arm for arm in arms if arm.speculative]
    assert len({id(arm.target) for arm in speculative} | {id(target)}) == len(speculative) + 1
    rows = run_conversation(arms, tokenizer, TOOL_SCENARIOS[0].system, tool_call_generations(TOOL_SCENARIOS[0]))
    assert len(rows) == 6 and all(all(r["identical"].values()) for r in rows)
    assert set(rows[0]["seconds"]) == {arm.name for arm in DEFAULT_ARMS}
    assert not shared_state_for(target).history.keys()  # the shared target ran plain calls only
    for arm in speculative:  # each arm with lookup kept its conversation in its own target's default scope
        scopes = [key.scope for key in shared_state_for(arm.target).history.keys()]
        assert scopes == ([] if arm.kwargs.get("dspark_lookup") is False else [""])


def test_summary_and_table(setup):
    target, tokenizer, drafter = setup
    repeats = [run_workloads(target, tokenizer, drafter, long_turns=1, repeat=r) for r in range(2)]
    summary = summarize(repeats, [arm.name for arm in DEFAULT_ARMS])
    assert set(summary) == {"tool calls", "long turns"} and summary["tool calls"]["generations"] == 12
    plain = summary["tool calls"]["arms"]["plain"]
    assert plain["speedup_vs_plain"] == 1.0 and len(plain["seconds"]) == 2 and plain["identical"]
    assert "| tool calls (12 calls" in table(summary)
