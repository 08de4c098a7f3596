"""SPS(B) and step-cost tables: lookup/interpolation, persistence, and profiling a tiny random Llama (and drafter)
with an on-disk cache. Tests that depend on what the profile measures run on a fake clock (forward_clock.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import make_tiny_llama
from forward_clock import ForwardClock

from hf_dspark import DSparkDraftModel
from hf_dspark.scheduling import SPSProfile, StepCostProfile, profile_step_cost, profile_verify_sps
from hf_dspark.scheduling import forward_timing, profile_cache, step_cost
from hf_dspark.scheduling.cost_grids import default_row_grid
from hf_dspark.scheduling.cost_tables import (
    default_batch_grid,
    isotonic_fit,
    make_monotone,
    make_nondecreasing,
    verify_batch_shape,
)


@pytest.fixture
def one_thread():
    """Tiny forwards are dominated by thread wake-ups on a busy 2-core CI box; the thread count is part of the
    cache key anyway."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_lookup_interpolates_and_extrapolates():
    sps = SPSProfile.from_user_table({2: 10.0, 4: 6.0, 8: 4.0})
    assert [sps(b) for b in (0, 1, 2, 3, 4, 6, 8)] == pytest.approx([10.0, 10.0, 10.0, 8.0, 6.0, 5.0, 4.0])
    assert sps(16) == pytest.approx(2.0)  # beyond the table: constant tokens/s (4 × 8 = 2 × 16)
    assert sps.lookup(torch.tensor([1, 3, 16])).tolist() == pytest.approx([10.0, 8.0, 2.0])
    assert sps.tokens_per_second(4) == pytest.approx(24.0)
    assert sps.is_monotone() and sps.max_batch_tokens == 8


def test_user_table_kept_as_given_even_if_jagged(caplog):
    with caplog.at_level("WARNING", logger="hf_dspark.scheduling"):
        sps = SPSProfile.from_user_table([(4, 5.0), (1, 9.0), (2, 4.0)])
    assert sps.batch_tokens == (1, 2, 4) and sps.steps_per_second == (9.0, 4.0, 5.0)
    assert not sps.is_monotone() and "not monotone" in caplog.text
    assert sps.metadata["source"] == "user"


def test_validation_messages():
    with pytest.raises(ValueError, match="strictly increasing"):
        SPSProfile((2, 2), (1.0, 1.0))
    with pytest.raises(ValueError, match="finite and > 0"):
        SPSProfile((1, 2), (1.0, 0.0))
    with pytest.raises(ValueError, match="equally long"):
        SPSProfile((1, 2), (1.0,))


def test_save_load_roundtrip(tmp_path):
    sps = SPSProfile((1, 3, 9), (5.0, 4.0, 1.5), {"source": "measured", "device": "cpu"})
    sps.save(tmp_path / "a" / "sps.json")
    again = SPSProfile.load(tmp_path / "a" / "sps.json")
    assert again == sps and again.metadata == sps.metadata
    assert json.loads((tmp_path / "a" / "sps.json").read_text())["batch_tokens"] == [1, 3, 9]


def test_make_monotone_and_grid_helpers():
    assert make_monotone([5.0, 6.0, 4.0, 4.5, 1.0]) == [5.0, 5.0, 4.0, 4.0, 1.0]
    grid = default_batch_grid(100)
    assert grid[:16] == list(range(1, 17)) and grid[-1] == 100 and grid == sorted(set(grid))
    assert verify_batch_shape(5, 8) == (1, 5)
    assert verify_batch_shape(16, 8) == (2, 8)
    assert verify_batch_shape(17, 8) == (3, 6)  # 18 tokens: rows as even as possible, overshoot < one row


def test_profile_tiny_llama_is_monotone_and_cached(tmp_path, monkeypatch, one_thread):
    target = make_tiny_llama(num_layers=2)
    grid = [1, 4, 16, 48]
    sps = profile_verify_sps(target, grid, context_len=16, row_len=4, repeats=1, cache_dir=tmp_path)
    assert sps.batch_tokens == tuple(grid) and sps.is_monotone()
    assert sps.metadata["source"] == "measured" and len(sps.metadata["raw_steps_per_second"]) == len(grid)
    assert np.all(np.array(sps.steps_per_second) <= np.array(sps.metadata["raw_steps_per_second"]) + 1e-9)
    assert len(list((tmp_path / "sps").glob("*.json"))) == 1

    def no_timing(*args, **kwargs):
        raise AssertionError("profiled again despite a cached table")

    monkeypatch.setattr(step_cost, "time_verify_forward", no_timing)
    cached = profile_verify_sps(target, grid, context_len=16, row_len=4, repeats=1, cache_dir=tmp_path)
    assert cached == sps and cached.metadata["source"] == "cache"
    user = profile_verify_sps(target, grid, user_table={1: 3.0, 64: 1.0}, cache_dir=tmp_path)
    assert user.batch_tokens == (1, 64) and user.metadata["source"] == "user"
    with pytest.raises(AssertionError, match="profiled again"):  # another grid is another cache entry
        profile_verify_sps(target, [1, 2], context_len=16, row_len=4, repeats=1, cache_dir=tmp_path)


def test_cache_key_depends_on_what_changes_the_curve():
    target = make_tiny_llama(num_layers=2)
    other = make_tiny_llama(num_layers=3)
    kwargs = dict(context_len=16, row_len=4, dtype=torch.float32, device="cpu", repeats=1)
    key = profile_cache.profile_cache_key(target, [1, 2], **kwargs)
    assert key == profile_cache.profile_cache_key(make_tiny_llama(num_layers=2), [1, 2], **kwargs)
    assert key != profile_cache.profile_cache_key(other, [1, 2], **kwargs)
    assert key != profile_cache.profile_cache_key(target, [1, 2, 4], **kwargs)
    assert key != profile_cache.profile_cache_key(target, [1, 2], **{**kwargs, "dtype": torch.bfloat16})


def test_profiling_restores_train_mode(one_thread):
    target = make_tiny_llama(num_layers=1).train()
    sps = profile_verify_sps(target, [2, 8], context_len=8, row_len=4, repeats=1, use_cache=False)
    assert target.training and all(s > 0 for s in sps.steps_per_second)


# ---------------------------------------------------------------------------------------------------------
# StepCostProfile: the engine's real step (drafter pass + padded verify)
# ---------------------------------------------------------------------------------------------------------
def test_step_cost_lookup_interpolates_and_extrapolates():
    cost = StepCostProfile((1, 4), (1, 2, 4), ((1.0, 2.0, 4.0), (2.0, 4.0, 8.0)), (0.5, 1.0))
    assert cost.verify(1, 1) == pytest.approx(1.0) and cost.verify(4, 4) == pytest.approx(8.0)
    assert cost.verify(2, 4) == pytest.approx(4.0 + 4.0 / 3)  # linear in rows between measured ones
    assert cost.verify(1, 3) == pytest.approx(3.0)  # linear in width between measured ones
    assert cost.verify(8, 2) == pytest.approx(8.0)  # beyond the last row count: its cost for as many tokens
    assert cost.verify(1, 9) == cost.verify(1, 4) and cost.verify(1, 0) == cost.verify(1, 1)  # widths clipped
    assert cost.verify_widths(1).tolist() == pytest.approx([1.0, 2.0, 3.0, 4.0])
    assert cost.draft(1) == pytest.approx(0.5) and cost.draft(8) == pytest.approx(2.0)
    assert cost(4) == pytest.approx(1 / cost.verify(1, 4))  # SPS(B) view: B tokens in rows of max_width
    with pytest.raises(ValueError, match="strictly increasing"):
        StepCostProfile((2, 1), (1,), ((1.0,), (1.0,)), (0.0, 0.0))
    with pytest.raises(ValueError, match="must be"):
        StepCostProfile((1,), (1, 2), ((1.0,),), (0.0,))
    with pytest.raises(ValueError, match="finite"):
        StepCostProfile((1,), (1,), ((0.0,),), (0.0,))


def test_step_cost_prices_rows_beyond_the_table_by_their_tokens():
    # a 1-token step is far from compute-bound (4 rows cost 2 s, 2 tokens each 3 s): 8 rows × 1 token cost what
    # 4 rows × 2 tokens do, not twice 4 rows × 1 token; past the widest measured step, proportional to tokens
    cost = StepCostProfile((1, 4), (1, 2, 4), ((1.0, 1.5, 2.5), (2.0, 3.0, 5.0)), (0.5, 1.0))
    assert cost.verify(8, 1) == pytest.approx(3.0)  # 8 tokens: 4 rows × 2
    assert cost.verify(12, 1) == pytest.approx(4.0)  # 12 tokens: 4 rows × 3, between measured widths
    assert cost.verify(8, 4) == pytest.approx(10.0)  # 32 tokens: twice the widest (4 × 4) measured step
    assert cost.verify_widths(8).tolist() == pytest.approx([3.0, 5.0, 7.5, 10.0])
    assert cost.verify(16, 1) / cost.verify(4, 1) == pytest.approx(2.5)  # proportional to rows would say 4
    assert cost.draft(8) == pytest.approx(2.0)  # a drafter pass: still proportional to rows


def test_step_cost_from_sps_and_round_trip(tmp_path):
    sps = SPSProfile.from_user_table({1: 10.0, 8: 5.0, 64: 1.0})
    cost = StepCostProfile.from_sps(sps, max_width=8, max_rows=8)
    assert cost.rows[0] == 1 and cost.rows[-1] == 8 and cost.widths == tuple(range(1, 9))
    assert cost.verify(1, 1) == pytest.approx(0.1) and cost.verify(8, 8) == pytest.approx(1.0)
    assert cost.verify(2, 4) == pytest.approx(1 / sps(8)) and cost.draft(8) == 0.0
    cost.save(tmp_path / "cost.json")
    assert StepCostProfile.load(tmp_path / "cost.json") == cost
    fitted = make_nondecreasing(np.array([[1.0, 0.5], [0.8, 2.0]]))
    np.testing.assert_allclose(fitted, [[0.7, 0.7], [0.9, 2.0]])
    assert (np.diff(fitted, axis=0) >= 0).all() and (np.diff(fitted, axis=1) >= 0).all()
    assert default_row_grid(64) == [1, 2, 4, 8, 16, 32, 64] and default_row_grid(10) == [1, 2, 4, 8, 10]


def test_profile_step_cost_tiny_target_and_drafter(tmp_path, monkeypatch, one_thread):
    target = make_tiny_llama()
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=3, markov_rank=8).eval()
    clock = ForwardClock().install(monkeypatch, target, draft)
    cost = profile_step_cost(target, draft, max_rows=4, max_width=4, context_len=8, repeats=1, cache_dir=tmp_path)
    assert cost.rows == (1, 2, 4) and cost.widths == (1, 2, 3, 4)
    verify = np.array(cost.verify_seconds)
    assert (verify > 0).all() and (np.diff(verify, axis=0) >= 0).all() and (np.diff(verify, axis=1) >= 0).all()
    assert all(d > 0 for d in cost.draft_seconds) and list(cost.draft_seconds) == sorted(cost.draft_seconds)
    # what the (fake) machine costs: a forward fixed + per token, a drafter pass per row
    np.testing.assert_allclose(verify, clock.fixed + clock.per_token * np.outer(cost.rows, cost.widths), rtol=1e-3)
    np.testing.assert_allclose(cost.draft_seconds, clock.draft_per_row * np.array(cost.rows), rtol=1e-3)
    assert cost.metadata["source"] == "measured" and not draft.training

    def no_timing(*args, **kwargs):
        raise AssertionError("profiled again despite a cached table")

    monkeypatch.setattr(step_cost, "time_padded_verify", no_timing)
    kwargs = {"max_rows": 4, "max_width": 4, "context_len": 8, "repeats": 1, "cache_dir": tmp_path, "recheck": False}
    again = profile_step_cost(target, draft, **kwargs)
    assert again == cost and again.metadata["source"] == "cache"
    # the verify table is the target's: an engine without the drafter prices verify steps with the same numbers
    alone = profile_step_cost(target, None, **kwargs)
    assert alone.verify_seconds == cost.verify_seconds and set(alone.draft_seconds) == {0.0}
    # another drafter times only its own passes, on the same verify table
    drafts = []
    real_draft_pass = forward_timing._draft_pass
    monkeypatch.setattr(forward_timing, "_draft_pass",
                        lambda *a, **k: drafts.append(a[1]) or real_draft_pass(*a, **k))
    other = DSparkDraftModel.from_target(target, num_layers=1, block_size=4, markov_rank=8).eval()
    with_other = profile_step_cost(target, other, **kwargs)
    assert drafts == [1, 2, 4] and with_other.verify_seconds == cost.verify_seconds
    assert with_other.metadata["source"] == "measured"
    assert profile_step_cost(target, other, **kwargs) == with_other and drafts == [1, 2, 4]  # cached too
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "sps").glob("*.json")) == ["draft", "draft", "step"]


def rescale_cached_table(path, factor: float) -> dict:
    """Multiply every verify timing of a cached step-cost table on disk by ``factor``; returns the new table."""
    table = json.loads(path.read_text())
    table["verify_seconds"] = [[factor * v for v in line] for line in table["verify_seconds"]]
    raw = table["metadata"]["raw_verify_seconds"]
    table["metadata"]["raw_verify_seconds"] = [[factor * v for v in line] for line in raw]
    path.write_text(json.dumps(table))
    return table


def test_a_cached_profile_measured_on_a_busy_machine_is_measured_again(tmp_path, monkeypatch, one_thread):
    target = make_tiny_llama()
    ForwardClock().install(monkeypatch, target)  # the machine runs at one speed throughout, whatever this one does
    kwargs = {"max_rows": 2, "max_width": 2, "context_len": 8, "repeats": 1, "cache_dir": tmp_path}
    cost = profile_step_cost(target, None, **kwargs)
    (path,) = (tmp_path / "sps").glob("step-*.json")
    rescale_cached_table(path, 50)  # as if every timing had been taken while other work held the CPU
    fresh = profile_step_cost(target, None, **kwargs)
    assert fresh.metadata["source"] == "measured" and fresh.verify(1, 1) < 10 * cost.verify(1, 1)
    np.testing.assert_allclose(fresh.verify_seconds, cost.verify_seconds, rtol=1e-6)  # measured as it was at first
    assert json.loads(path.read_text())["verify_seconds"][0][0] < 10 * cost.verify(1, 1)  # the cache is replaced
    # a table that is faster than the machine now is kept (a busy machine now must not overwrite it)
    quiet = rescale_cached_table(path, 1 / 100)
    calls = []
    real = step_cost.time_padded_verify
    monkeypatch.setattr(step_cost, "time_padded_verify", lambda *a, **k: calls.append(a[1:3]) or real(*a, **k))
    kept = profile_step_cost(target, None, **kwargs)
    assert kept.metadata["source"] == "cache" and kept.verify(1, 1) == quiet["verify_seconds"][0][0]
    assert calls == [(1, 1)]  # one spot check, no re-profiling


def test_isotonic_fit_averages_a_slow_outlier_instead_of_raising_everything_after_it():
    np.testing.assert_allclose(isotonic_fit([1.0, 3.0, 2.0, 4.0]), [1.0, 2.5, 2.5, 4.0])
    # one slow timing at W=2: a running max would make W=2..5 cost 5; the least-squares monotone fit pools it
    np.testing.assert_allclose(isotonic_fit([1.0, 5.0, 1.0, 1.0, 1.0, 6.0]), [1.0, 2.0, 2.0, 2.0, 2.0, 6.0])
    assert isotonic_fit([]).size == 0 and isotonic_fit([2.0]).tolist() == [2.0]
    rng = np.random.default_rng(0)
    table = np.cumsum(rng.uniform(0, 1, (5, 8)), axis=1) + np.arange(5)[:, None] + rng.normal(0, 0.3, (5, 8))
    fitted = make_nondecreasing(table)
    assert (np.diff(fitted, axis=0) >= -1e-12).all() and (np.diff(fitted, axis=1) >= -1e-12).all()
    assert np.abs(fitted - table).mean() < np.abs(np.maximum.accumulate(np.maximum.accumulate(table, 0), 1)
                                                  - table).mean()


def test_a_cached_table_is_spot_checked_once_per_process(tmp_path, monkeypatch, one_thread):
    """Every engine loads the table; only the first load in a process pays the spot check (an edited file is a new
    table and is checked again)."""
    target = make_tiny_llama()
    ForwardClock().install(monkeypatch, target)
    kwargs = {"max_rows": 2, "max_width": 2, "context_len": 8, "repeats": 1, "cache_dir": tmp_path}
    profile_step_cost(target, None, **kwargs)
    (path,) = (tmp_path / "sps").glob("step-*.json")
    quiet = rescale_cached_table(path, 1 / 100)  # faster than the machine: every spot check keeps it
    calls = []
    real = step_cost.time_padded_verify
    monkeypatch.setattr(step_cost, "time_padded_verify", lambda *a, **k: calls.append(a[1:3]) or real(*a, **k))
    for _ in range(3):
        assert profile_step_cost(target, None, **kwargs).metadata["source"] == "cache"
    assert calls == [(1, 1)]
    quiet["metadata"]["note"] = "edited"
    path.write_text(json.dumps(quiet))
    assert profile_step_cost(target, None, **kwargs).metadata["source"] == "cache"
    assert calls == [(1, 1), (1, 1)]


def test_an_unreadable_drafter_cost_file_is_measured_again(tmp_path, caplog, one_thread):
    target = make_tiny_llama()
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=3, markov_rank=8).eval()
    kwargs = {"max_rows": 2, "max_width": 2, "context_len": 8, "repeats": 1, "cache_dir": tmp_path, "recheck": False}
    first = profile_step_cost(target, draft, **kwargs)
    (path,) = (tmp_path / "sps").glob("draft-*.json")
    path.write_text("{not json")
    with caplog.at_level("WARNING", logger="hf_dspark.scheduling"):
        again = profile_step_cost(target, draft, **kwargs)
    assert "unreadable drafter cost file" in caplog.text
    assert again.metadata["source"] == "measured" and again.verify_seconds == first.verify_seconds
    assert all(d > 0 for d in again.draft_seconds) and json.loads(path.read_text())["rows"] == [1, 2]


def test_the_drafter_is_timed_between_target_forwards(tmp_path, monkeypatch, one_thread):
    """As the loop runs it: every drafter pass the profile times follows a verify forward of as many rows (on a
    machine where every row count's passes fit its time budget: all of them are timed)."""
    target = make_tiny_llama()
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=3, markov_rank=8).eval()
    ForwardClock().install(monkeypatch, target, draft)
    kwargs = {"max_rows": 2, "max_width": 2, "context_len": 8, "repeats": 1, "cache_dir": tmp_path, "recheck": False}
    profile_step_cost(target, None, **kwargs)  # the verify table, cached: only the drafter is timed below
    calls = []
    target.register_forward_pre_hook(lambda module, args, kw: calls.append(("verify", kw["input_ids"].shape[0])),
                                     with_kwargs=True)
    real_block = draft.draft_block
    draft.draft_block = lambda cache, anchors, *a, **k: calls.append(("draft", anchors.shape[0])) or real_block(
        cache, anchors, *a, **k)
    cost = profile_step_cost(target, draft, **kwargs)
    assert calls[0] == ("verify", 1)  # the context prefill (one row, repeated per row count)
    passes = calls[1:]
    # a warm-up and the timed passes, for 2 row counts
    assert len(passes) == 2 * 2 * (forward_timing.DRAFT_PASS_REPEATS + 1)
    assert all(v == ("verify", r) and d == ("draft", r) for v, d, r in
               zip(passes[::2], passes[1::2], [1, 2] * (forward_timing.DRAFT_PASS_REPEATS + 1)))
    assert all(d > 0 for d in cost.draft_seconds)


# ---------------------------------------------------------------------------------------------------------
# The cache folder is an optimisation: an unwritable folder or a malformed file never fails the call
# ---------------------------------------------------------------------------------------------------------
def _refuse_writes(monkeypatch) -> None:
    """A read-only folder as a non-root user sees it (chmod does not stop root, who runs CI here)."""
    def read_only(path, data):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(profile_cache, "save_json_atomic", read_only)


@pytest.mark.parametrize("unwritable", ["under a regular file", "read-only"])
def test_an_unwritable_cache_folder_warns_once_and_keeps_the_tables_in_memory(tmp_path, monkeypatch, caplog,
                                                                               one_thread, unwritable):
    target = make_tiny_llama()
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=3, markov_rank=8).eval()
    if unwritable == "read-only":
        cache_dir = tmp_path / "read-only"
        _refuse_writes(monkeypatch)
    else:
        (tmp_path / "a-file").write_text("")
        cache_dir = tmp_path / "a-file" / "sub"
    kwargs = {"max_rows": 2, "max_width": 2, "context_len": 8, "repeats": 1, "cache_dir": cache_dir,
              "recheck": False}
    with caplog.at_level("WARNING", logger="hf_dspark.scheduling"):
        cost = profile_step_cost(target, draft, **kwargs)  # a verify table and a drafter file: one folder
        sps = profile_verify_sps(target, [1, 2], context_len=8, row_len=2, repeats=1, cache_dir=cache_dir)

        def no_timing(*args, **kwargs):
            raise AssertionError("measured again despite the table kept in memory")

        monkeypatch.setattr(step_cost, "time_padded_verify", no_timing)
        monkeypatch.setattr(forward_timing, "_draft_pass", no_timing)
        monkeypatch.setattr(step_cost, "time_verify_forward", no_timing)
        again = profile_step_cost(target, draft, **kwargs)
        sps_again = profile_verify_sps(target, [1, 2], context_len=8, row_len=2, repeats=1, cache_dir=cache_dir)
    assert cost.metadata["source"] == "measured" and all(d > 0 for d in cost.draft_seconds)
    assert again == cost and again.draft_seconds == cost.draft_seconds and again.metadata["source"] == "cache"
    assert sps_again == sps and sps_again.metadata["source"] == "cache"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and f"cannot write the cache folder {cache_dir / 'sps'}" in warnings[0]
    assert "HF_DSPARK_CACHE" in warnings[0]
    assert not (tmp_path / "read-only").exists()


def _valid_step_table(tmp_path, target, **kwargs) -> tuple[dict, object]:
    profile_step_cost(target, None, cache_dir=tmp_path, **kwargs)
    (path,) = (tmp_path / "sps").glob("step-*.json")
    return json.loads(path.read_text()), path


MALFORMED_STEP_TABLES = {
    "empty": lambda table: "",
    "truncated": lambda table: json.dumps(table)[:40],
    "garbage": lambda table: "{not json",
    "a list": lambda table: "[1, 2, 3]",
    "null": lambda table: "null",
    "a string": lambda table: '"step-cost"',
    "no fields": lambda table: "{}",
    "rows as a string": lambda table: json.dumps({**table, "rows": "12"}),
    "boolean widths": lambda table: json.dumps({**table, "widths": [True, 2]}),
    "NaN verify": lambda table: json.dumps({**table, "verify_seconds": [[float("nan"), 1.0], [1.0, 1.0]]}),
    "negative verify": lambda table: json.dumps({**table, "verify_seconds": [[-1.0, 1.0], [1.0, 1.0]]}),
    "verify of numbers": lambda table: json.dumps({**table, "verify_seconds": [1.0, 2.0]}),
    "verify of strings": lambda table: json.dumps({**table, "verify_seconds": [["1", "2"], ["3", "4"]]}),
    "null draft seconds": lambda table: json.dumps({**table, "draft_seconds": None}),
    "metadata a list": lambda table: json.dumps({**table, "metadata": [1]}),
    "NaN raw verify": lambda table: json.dumps({**table, "metadata": {**table["metadata"],
                                                                      "raw_verify_seconds": [[float("nan")] * 2] * 2}}),
    "raw verify a string": lambda table: json.dumps({**table, "metadata": {**table["metadata"],
                                                                           "raw_verify_seconds": "fast"}}),
}


@pytest.mark.parametrize("case", list(MALFORMED_STEP_TABLES))
def test_a_malformed_step_cost_file_is_measured_again(tmp_path, caplog, one_thread, case):
    target = make_tiny_llama(num_layers=2)
    kwargs = {"max_rows": 2, "max_width": 2, "context_len": 8, "repeats": 1, "recheck": False}
    table, path = _valid_step_table(tmp_path, target, **kwargs)
    path.write_text(MALFORMED_STEP_TABLES[case](table))
    with caplog.at_level("WARNING", logger="hf_dspark.scheduling"):
        again = profile_step_cost(target, None, cache_dir=tmp_path, **kwargs)
    assert "ignoring unreadable cache file" in caplog.text
    assert again.metadata["source"] == "measured" and again.rows == (1, 2) and again.widths == (1, 2)
    assert StepCostProfile.from_dict(json.loads(path.read_text())) == again  # the file is replaced


MALFORMED_DRAFTER_FILES = {
    "NaN seconds": '{"rows": [1, 2], "raw_draft_seconds": [NaN, 0.001]}',
    "infinite seconds": '{"rows": [1, 2], "raw_draft_seconds": [Infinity, 0.001]}',
    "zero seconds": '{"rows": [1, 2], "raw_draft_seconds": [0.0, 0.001]}',
    "one time for two row counts": '{"rows": [1, 2], "raw_draft_seconds": [0.001]}',
    "string seconds": '{"rows": [1, 2], "raw_draft_seconds": ["fast", "slow"]}',
    "null seconds": '{"rows": [1, 2], "raw_draft_seconds": null}',
    "rows null": '{"rows": null, "raw_draft_seconds": [0.001, 0.002]}',
    "a list": "[1, 2, 3]",
    "null": "null",
    "empty": "",
}


@pytest.mark.parametrize("case", list(MALFORMED_DRAFTER_FILES))
def test_a_malformed_drafter_cost_file_is_measured_again(tmp_path, caplog, one_thread, case):
    target = make_tiny_llama()
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=3, markov_rank=8).eval()
    kwargs = {"max_rows": 2, "max_width": 2, "context_len": 8, "repeats": 1, "cache_dir": tmp_path, "recheck": False}
    first = profile_step_cost(target, draft, **kwargs)
    (path,) = (tmp_path / "sps").glob("draft-*.json")
    path.write_text(MALFORMED_DRAFTER_FILES[case])
    with caplog.at_level("WARNING", logger="hf_dspark.scheduling"):
        again = profile_step_cost(target, draft, **kwargs)
    assert "unreadable drafter cost file" in caplog.text
    assert again.metadata["source"] == "measured" and again.verify_seconds == first.verify_seconds
    assert all(d > 0 for d in again.draft_seconds)
    assert json.loads(path.read_text())["raw_draft_seconds"] == list(again.metadata["raw_draft_seconds"])


@pytest.mark.parametrize("content", ["[1, 2, 3]", "null", '{"batch_tokens": [1, 2], "steps_per_second": [NaN, 1]}',
                                     '{"batch_tokens": "12", "steps_per_second": [2, 1]}'])
def test_a_malformed_sps_file_is_measured_again(tmp_path, caplog, one_thread, content):
    target = make_tiny_llama(num_layers=2)
    kwargs = {"context_len": 8, "row_len": 2, "repeats": 1, "cache_dir": tmp_path}
    profile_verify_sps(target, [1, 2], **kwargs)
    (path,) = (tmp_path / "sps").glob("*.json")
    path.write_text(content)
    with caplog.at_level("WARNING", logger="hf_dspark.scheduling"):
        again = profile_verify_sps(target, [1, 2], **kwargs)
    assert "ignoring unreadable cache file" in caplog.text and again.metadata["source"] == "measured"
    assert SPSProfile.from_dict(json.loads(path.read_text())) == again


def test_from_dict_names_the_malformed_field():
    with pytest.raises(ValueError, match=r"a saved StepCostProfile is a JSON object, got \[1, 2, 3\]"):
        StepCostProfile.from_dict([1, 2, 3])
    with pytest.raises(ValueError, match=r"a saved SPSProfile is a JSON object, got None"):
        SPSProfile.from_dict(None)
    with pytest.raises(ValueError, match=r"rows must be a list of integers, got '12'"):
        StepCostProfile.from_dict({"rows": "12", "widths": [1], "verify_seconds": [[1.0]], "draft_seconds": [0.0]})
    with pytest.raises(ValueError, match=r"verify_seconds\[0\] must be a list of finite numbers, got \[nan\]"):
        StepCostProfile.from_dict({"rows": [1], "widths": [1], "verify_seconds": [[float("nan")]],
                                   "draft_seconds": [0.0]})
    with pytest.raises(ValueError, match=r"steps_per_second must be a list of finite numbers, got None"):
        SPSProfile.from_dict({"batch_tokens": [1]})


def test_step_cost_tables_written_at_once_by_two_writers_stay_whole(tmp_path):
    """Two processes (or threads) measuring the same table at once: each renames a whole file of its own, so the
    table is one writer's, never a mix, no writer fails for the other's rename, and no temporary file is left. A new
    file gets the umask's permissions, as any file the library writes."""
    import os
    import stat
    import threading

    from hf_dspark.scheduling.cost_tables import save_json_atomic

    path = tmp_path / "tables" / "step_cost.json"
    tables = [{"writer": i, "rows": list(range(2000))} for i in range(8)]
    errors = []

    def write(data):
        try:
            for _ in range(20):
                save_json_atomic(path, data)
        except OSError as err:  # the shared temporary file made the loser's rename fail
            errors.append(err)

    threads = [threading.Thread(target=write, args=(t,)) for t in tables]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert json.loads(path.read_text()) in tables
    assert [p.name for p in path.parent.iterdir()] == ["step_cost.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
