"""A process's first speculative call pays no spot check of a cached step-cost table: its own steps review the table
afterwards, and a table measured on a busy machine is dropped then (issue #41)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_llama

from hf_dspark import DSparkDraftModel
from hf_dspark.speculation.shared_state import SharedState, forget, shared_state_for
from hf_dspark.scheduling import step_cost

PROMPT = torch.tensor([[1, 5, 9, 22, 7, 3, 40, 41, 12, 13]])
KWARGS = {"do_sample": False, "max_new_tokens": 12}


@pytest.fixture
def models(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DSPARK_CACHE", str(tmp_path))
    monkeypatch.setattr(step_cost, "_cache_root", step_cost._cache_root.__wrapped__)  # this test's own folder
    torch.manual_seed(0)
    target = make_tiny_llama()
    yield target, DSparkDraftModel.from_target(target, num_layers=1).eval()
    forget(target)


def cached_table(target) -> step_cost.StepCostProfile:
    (cost,) = [c for c in shared_state_for(target).costs.values() if c.rows == (1,)]
    return cost


def test_a_cached_table_is_used_without_a_spot_check_and_kept_when_the_steps_confirm_it(models, monkeypatch):
    target, draft = models
    expected = target.generate(PROMPT, **KWARGS)
    assert torch.equal(target.generate(PROMPT, assistant_model=draft, **KWARGS), expected)  # measures, caches
    forget(target)  # a new process, as far as the target's memory goes

    def no_spot_check(*args, **kwargs):
        raise AssertionError("a cached table was spot-checked before the call's first token")

    monkeypatch.setattr(step_cost, "_measured_on_a_busy_machine", no_spot_check)
    # the first call measured the table on a machine other tests may load unevenly: the steps here "confirm" it
    # however they compare (the review's threshold has a test of its own below), so the test reads no timing
    monkeypatch.setattr(step_cost, "STALE_PROFILE_FACTOR", 1e9)
    assert torch.equal(target.generate(PROMPT, assistant_model=draft, **KWARGS), expected)
    table = cached_table(target)
    assert table.metadata["source"] == "cache" and Path(table.metadata["cache_file"]).is_file()


def test_the_review_keeps_a_table_the_steps_confirm_and_drops_a_stale_one(tmp_path):
    state = SharedState()
    path = tmp_path / "step-x.json"
    path.write_text("{}")
    table = step_cost.StepCostProfile((1,), (1, 2), ((0.1, 0.2),), (0.0,),
                                      {"source": "cache", "cache_file": str(path)})
    state.costs["key"] = table
    state.review_cost(table, 0.9)  # the steps took 0.9x the prediction: the table holds up
    assert id(table) in state.reviewed and path.exists() and state.costs == {"key": table}
    state.review_cost(table, 0.01)  # reviewed already: not again in this process
    assert path.exists()
    stale = step_cost.StepCostProfile((1,), (1, 2), ((0.1, 0.2),), (0.0,),
                                      {"source": "cache", "cache_file": str(path)})
    state.costs["key"] = stale
    state.review_cost(stale, 0.5)  # below 1 / STALE_PROFILE_FACTOR: measured on a busy machine
    assert not path.exists() and state.costs == {}
    measured = step_cost.StepCostProfile((1,), (1,), ((0.1,),), (0.0,), {"source": "measured"})
    state.review_cost(measured, 0.01)  # measured by this process: nothing to review
    assert id(measured) in state.reviewed


def test_a_table_measured_on_a_busy_machine_is_dropped_after_the_call(models):
    target, draft = models
    expected = target.generate(PROMPT, **KWARGS)
    target.generate(PROMPT, assistant_model=draft, **KWARGS)
    forget(target)
    target.generate(PROMPT, assistant_model=draft, **KWARGS)
    path = Path(cached_table(target).metadata["cache_file"])
    # as if measured while other work ran: every step 10^4 times dearer (far beyond any machine's own noise)
    data = json.loads(path.read_text())
    data["verify_seconds"] = [[1e4 * t for t in line] for line in data["verify_seconds"]]
    data["metadata"]["raw_verify_seconds"] = [[1e4 * t for t in line]
                                              for line in data["metadata"]["raw_verify_seconds"]]
    path.write_text(json.dumps(data))
    forget(target)
    assert torch.equal(target.generate(PROMPT, assistant_model=draft, **KWARGS), expected)
    assert not path.exists() and not [c for c in shared_state_for(target).costs.values() if c.rows == (1,)]
    assert torch.equal(target.generate(PROMPT, assistant_model=draft, **KWARGS), expected)  # measured again
    assert cached_table(target).metadata["source"] == "measured" and path.exists()
