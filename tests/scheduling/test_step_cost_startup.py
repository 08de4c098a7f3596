"""The engine's start-up step-cost profile: coarse and time-limited by default, announced with its estimated duration
and the way to skip it, a progress bar on request, and a fine grid on demand (then reused from the cache). The
profiles run on a fake clock (forward_clock.py): what gets measured must not depend on how busy this machine is."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama
from forward_clock import ForwardClock

from hf_dspark.scheduling import profile_step_cost, step_cost
from hf_dspark.scheduling.cost_grids import coarse_row_grid, coarse_width_grid

SMALL = {"max_rows": 16, "max_width": 8, "context_len": 8, "repeats": 3}


@pytest.fixture
def target(monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    model = make_tiny_llama(num_layers=2)
    ForwardClock().install(monkeypatch, model)
    yield model
    torch.set_num_threads(before)


def _count_forwards(model) -> list[int]:
    calls = [0]
    model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_coarse_grids():
    assert coarse_row_grid(64) == [1, 2, 4, 16, 64] and coarse_row_grid(4) == [1, 2, 4]
    assert coarse_row_grid(10) == [1, 2, 4, 10] and coarse_row_grid(1) == [1] and coarse_row_grid(200)[-2:] == [64, 200]
    # the skinny kernel's jumps in rows: 9-16 rows cost what 16 do, more than 16 go through stock F.linear
    assert coarse_row_grid(64, skinny=True) == [1, 2, 4, 8, 9, 16, 17, 64]
    assert coarse_row_grid(16, skinny=True) == [1, 2, 4, 8, 9, 16] and coarse_row_grid(4, skinny=True) == [1, 2, 4]
    assert coarse_width_grid(8) == [1, 2, 3, 4, 8] and coarse_width_grid(4) == [1, 2, 3, 4]
    assert coarse_width_grid(16) == [1, 2, 3, 4, 8, 16] and coarse_width_grid(1) == [1]
    # with the skinny kernel: per row count, the first width padded to 16 rows (past 8) and the first width on the
    # stock kernel (past 16), where the cost jumps (R=1: 9, 17; R=2: 5, 9; R=4: 3, 5; R=16: 1, 2)
    assert coarse_width_grid(17, [1, 2, 4, 16], skinny=True) == [1, 2, 3, 4, 5, 8, 9, 16, 17]
    assert coarse_width_grid(8, [1], skinny=True) == [1, 2, 3, 4, 8]
    assert coarse_width_grid(17, [1, 2, 4, 16]) == [1, 2, 3, 4, 8, 16, 17]


def test_default_profile_is_coarse_and_refine_is_on_demand(target, tmp_path, monkeypatch):
    calls = _count_forwards(target)
    coarse = profile_step_cost(target, cache_dir=tmp_path / "a", **SMALL)
    coarse_forwards, calls[0] = calls[0], 0
    assert coarse.rows == (1, 2, 4, 16) and coarse.widths == (1, 2, 3, 4, 8)
    assert coarse.metadata["grid"] == "coarse"
    fine = profile_step_cost(target, cache_dir=tmp_path / "a", refine=True, **SMALL)
    assert fine.rows == (1, 2, 4, 8, 16) and fine.widths == tuple(range(1, 9))
    assert coarse_forwards < 0.6 * calls[0], (coarse_forwards, calls[0])  # the default costs well under the fine grid
    # interpolated coarse lookups stay non-decreasing and cover every width the engine asks for
    assert all(coarse.verify(r, w) <= coarse.verify(r, w + 1) for r in (1, 3, 8, 16) for w in range(1, 8))

    def no_timing(*args, **kwargs):
        raise AssertionError("profiled again despite a cached fine table")

    monkeypatch.setattr(step_cost, "time_padded_verify", no_timing)
    again = profile_step_cost(target, cache_dir=tmp_path / "a", recheck=False, **SMALL)
    assert again.metadata["source"] == "cache" and again.widths == fine.widths  # a cached fine table wins


def test_start_up_profile_announces_its_duration_and_how_to_skip_it(target, tmp_path, monkeypatch, caplog, capsys):
    monkeypatch.setattr(step_cost, "ANNOUNCE_AFTER_S", 0.0)  # a tiny target is fast; pretend it is a slow one
    with caplog.at_level("INFO", logger="hf_dspark.scheduling"):
        profile_step_cost(target, cache_dir=tmp_path, progress=True, **SMALL)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "s to measure the engine" in warnings[0] and f"cached in {tmp_path / 'sps'}" in warnings[0]
    assert "DSparkEngine(sps=...)" in warnings[0] and "sps_cache_dir=" in warnings[0]
    assert "step-cost profile" in capsys.readouterr().err  # the progress bar
    caplog.clear()
    with caplog.at_level("INFO", logger="hf_dspark.scheduling"):
        profile_step_cost(target, cache_dir=tmp_path, recheck=False, **SMALL)
    assert "cache hit" in caplog.text and "WARNING" not in [r.levelname for r in caplog.records]


def test_time_limit_stops_adding_row_counts_and_extrapolates(target, tmp_path, caplog):
    with caplog.at_level("INFO", logger="hf_dspark.scheduling"):
        cost = profile_step_cost(target, cache_dir=tmp_path, max_seconds=0.0, **SMALL)
    assert cost.rows == (1,)  # the first row count is always measured
    assert "R > 1 not measured (max_seconds=0.0)" in caplog.text and "refine=True" in caplog.text
    assert cost.verify(16, 8) == pytest.approx(16 * cost.verify(1, 8))  # proportional beyond the last row count
