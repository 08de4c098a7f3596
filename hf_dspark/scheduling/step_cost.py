"""Measuring this machine's step cost: SPS(B) (``profile_verify_sps``) and the padded drafter + verify step
(``profile_step_cost``), read from the disk cache when a table is there (profile_cache.py), and checking a cached
table against the machine now (one measured on a busy machine is measured again).

The scheduler trades expected accepted tokens against step time, so it needs the real cost curve of the target's
verify forward: flat while the hardware is latency-bound (verifying more is almost free), falling once it is
compute-bound. The paper profiles it once at engine start and looks it up in O(1); so do we (the tables are in
cost_tables.py, the timing of one cell in forward_timing.py, the grids in cost_grids.py).

The engine verifies a *padded* batch (R rows × width W = 1 + max ℓ_r) and runs the drafter every step it drafts,
so the cost it actually pays is t_draft(R) + t_verify(R, W), not 1/SPS(Σ(1 + ℓ_r)). On a CPU the two differ a lot:
one long row widens every row, and the drafter pass is a fixed price per step. ``profile_step_cost`` measures that
grid. Its start-up profile is coarse and time-limited by default, says so in one WARNING line when it is slow, and
``profile_step_cost(..., refine=True)`` measures the fine grid on demand. The verify table is the target's, cached
without the drafter (every engine and ``generate`` call on a target prices a verify step alike); each drafter's pass
costs are cached beside it, timed between target forwards as the loop runs them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from .cost_grids import coarse_row_grid, coarse_width_grid, default_row_grid
from .cost_tables import SPSProfile, StepCostProfile, default_batch_grid, make_monotone, make_nondecreasing
from .forward_timing import (
    prefill_context,
    synchronize,
    time_draft_passes,
    time_padded_verify,
    time_padded_verify_widths,
    time_verify_forward,
)
from .profile_cache import (
    draft_cost_file,
    forget_cached,
    profile_cache_key,
    read_draft_seconds,
    read_sps,
    read_step_cost,
    save_cached,
    step_cost_file,
)

logger = logging.getLogger(__name__)

_CACHE_SUBDIR = "sps"
# Coarse profiling stops repeating a cell (verify R × W, or one drafter pass) once its timed runs took this long.
CELL_BUDGET_S = 0.5
# A start-up profile estimated to take longer than this is announced with a WARNING (INFO otherwise).
ANNOUNCE_AFTER_S = 10.0
# A cached table whose 1-token verify is this many times slower than a fresh measurement is re-measured.
STALE_PROFILE_FACTOR = 1.4


def profile_verify_sps(target, batch_token_sizes: Sequence[int] | None = None, *, max_batch_tokens: int = 256,
                       context_len: int = 256, row_len: int = 8, repeats: int = 5,
                       user_table: Mapping[int, float] | Sequence[tuple[int, float]] | SPSProfile | None = None,
                       cache_dir: str | os.PathLike | None = None, use_cache: bool = True,
                       seed: int = 0) -> SPSProfile:
    """SPS(B) of ``target``'s verify forward on this machine, made monotone non-increasing (running min).

    ``user_table`` wins when given (no measuring). Otherwise a cached table for the same model/config, dtype,
    device, thread count and grid is reused from ``<cache_dir or hf_dspark cache>/sps/``; else each B in the
    grid is timed (the fastest of ``repeats`` after a warm-up) and the result cached. Dtype and device are the
    target's own.
    """
    if user_table is not None:
        return user_table if isinstance(user_table, SPSProfile) else SPSProfile.from_user_table(user_table)
    grid = sorted(set(int(b) for b in (batch_token_sizes or default_batch_grid(max_batch_tokens))))
    if not grid or grid[0] < 1:
        raise ValueError(f"batch_token_sizes must be positive integers, got {batch_token_sizes}")
    param = next(target.parameters())
    dtype, device = param.dtype, param.device
    key = profile_cache_key(target, grid, context_len=context_len, row_len=row_len, dtype=dtype, device=device,
                            repeats=repeats)
    path = _cache_root(cache_dir) / f"{key}.json"
    cached = read_sps(path) if use_cache else None
    if cached is not None:
        logger.info("SPS profile: cache hit %s (%d sizes, B=%d..%d)", path, len(grid), grid[0], grid[-1])
        return SPSProfile(cached.batch_tokens, cached.steps_per_second, {**cached.metadata, "source": "cache"})
    profile = _measure(target, grid, context_len=context_len, row_len=row_len, repeats=repeats, device=device,
                       seed=seed)
    profile.metadata.update(key=key, dtype=str(dtype), device=str(device), threads=torch.get_num_threads())
    if use_cache and save_cached(path, profile.to_dict()):
        logger.info("SPS profile cached at %s", path)
    return profile


def _measure(target, grid: list[int], *, context_len: int, row_len: int, repeats: int, device: torch.device,
             seed: int) -> SPSProfile:
    was_training = target.training
    target.eval()
    generator = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    seconds = []
    try:
        # A global warm-up first: the very first forwards of a process pay one-off allocation / kernel
        # selection costs that would otherwise make small B look slow and, via the running min, drag the
        # whole curve down.
        time_verify_forward(target, grid[-1], context_len=context_len, row_len=row_len, repeats=1, device=device,
                            generator=generator)
        for num_tokens in grid:
            seconds.append(time_verify_forward(target, num_tokens, context_len=context_len, row_len=row_len,
                                               repeats=repeats, device=device, generator=generator))
            logger.debug("SPS profile: B=%d %.2f ms", num_tokens, 1e3 * seconds[-1])
    finally:
        target.train(was_training)
    raw = [1.0 / s for s in seconds]
    sps = make_monotone(raw)
    logger.info("SPS profile: %d sizes B=%d..%d in %.1fs; SPS(%d)=%.1f/s, SPS(%d)=%.1f/s", len(grid), grid[0],
                grid[-1], time.perf_counter() - start, grid[0], sps[0], grid[-1], sps[-1])
    return SPSProfile(tuple(grid), tuple(sps), {"source": "measured", "raw_steps_per_second": raw,
                                                "context_len": context_len, "row_len": row_len,
                                                "repeats": repeats})


def profile_step_cost(target, draft=None, *, max_rows: int = 64, max_width: int = 8, context_len: int = 256,
                      repeats: int = 3, rows: Sequence[int] | None = None, cache_dir: str | os.PathLike | None = None,
                      use_cache: bool = True, seed: int = 0, recheck: bool = True, refine: bool = False,
                      max_seconds: float | None = 30.0, progress: bool | None = None) -> StepCostProfile:
    """Measure the engine's step cost on this machine: verify(R, W) for R in ``rows`` and W up to ``max_width``,
    plus draft(R) when a drafter is given; cached on disk like SPS(B).

    The default grid is coarse, for a fast start-up: R = 1, 2, 4, 16, 64, ... (``coarse_row_grid``, with the row
    counts where the skinny kernel's cost jumps) and
    W = 1..4, 8, ... (``coarse_width_grid``, plus the widths where the skinny kernel's cost jumps), each cell
    repeated until ``repeats`` runs or ``CELL_BUDGET_S``, and no row count that would end after ``max_seconds``
    (larger R are then priced by their tokens: what the last measured R pays for as many, see
    ``StepCostProfile``; None = no limit);
    lookups interpolate between. ``refine=True`` measures the fine grid (R = 1, 2, 4, 8, ..., every W, all
    ``repeats``, no time limit); a cached fine table is then also what later coarse calls use. ``rows`` gives
    the row grid (measured in full). Costs are made non-decreasing in R and W (isotonic fit) so noise never
    rewards a bigger step. Measuring logs its estimated duration first (a WARNING when long) and shows a progress
    bar on a terminal (``progress``).

    The verify table belongs to the target alone and is cached without the drafter; the drafter's pass costs are
    cached beside it, one file per drafter. Every engine and ``generate`` call on a target therefore prices the
    same verify step with the same numbers: tables measured apart differ by their measurement noise, and engines
    on the same traffic would then choose different widths for no reason but that noise.

    The cache is keyed by model, dtype, device and threads, not by how busy the machine was: a table measured
    while other work ran would steer every later engine. With ``recheck`` a cache hit is spot-checked (one
    1-token verify), once per table and process; if that is much faster now than the cached value, the table is
    measured again."""
    fine_grid = _step_cost_grid(target, max_rows, max_width, rows, fine=True)
    row_grid, widths = fine_grid if refine else _step_cost_grid(target, max_rows, max_width, rows, fine=False)
    if not row_grid or row_grid[0] < 1 or max_width < 1:
        raise ValueError(f"profile_step_cost: rows must be positive and max_width >= 1, got {row_grid}, {max_width}")
    param = next(target.parameters())
    dtype, device = param.dtype, param.device
    generator = torch.Generator().manual_seed(seed)
    ident = dict(context_len=context_len, dtype=dtype, device=device, repeats=repeats)
    fine_path = _step_cost_path(target, *fine_grid, fine=True, cache_dir=cache_dir, **ident)
    path = fine_path if refine else _step_cost_path(target, row_grid, widths, fine=False, cache_dir=cache_dir,
                                                    limit=None if rows else max_seconds, **ident)
    profile = None
    for candidate in dict.fromkeys([fine_path, path]) if use_cache else ():
        profile = _load_step_cost(candidate, target, context_len, device, generator, recheck)
        if profile is not None:
            path = candidate
            break
    with _in_eval_mode(target, draft):
        if profile is None:
            profile = _measure_verify_table(target, row_grid, widths, context_len=context_len, repeats=repeats,
                                            dtype=dtype, device=device, generator=generator, refine=refine,
                                            max_seconds=None if rows else max_seconds, path=path, progress=progress)
            if use_cache:
                save_cached(path, profile.to_dict())
        if draft is not None:
            profile = _with_drafter(profile, target, draft, path, context_len=context_len, repeats=repeats,
                                    device=device, generator=generator, use_cache=use_cache)
    return profile


def _step_cost_grid(target, max_rows: int, max_width: int, rows: Sequence[int] | None, *,
                    fine: bool) -> tuple[list[int], list[int]]:
    """(row counts, widths) to measure: ``rows`` when given, else the fine or the coarse default grid (the coarse one
    with the points where the kernel the target's linears run with changes its cost)."""
    from ..cpu_kernels import SKINNY_KERNEL, linear_kernel

    skinny = linear_kernel(target).startswith(SKINNY_KERNEL)
    default = default_row_grid(max_rows) if fine else coarse_row_grid(max_rows, skinny=skinny)
    row_grid = sorted(set(int(r) for r in (rows or default)))
    return row_grid, (list(range(1, max_width + 1)) if fine else coarse_width_grid(max_width, row_grid, skinny=skinny))


@contextlib.contextmanager
def _in_eval_mode(*modules):
    """Measure the modules as inference runs them, and hand them back in the mode they came in."""
    modules = [m for m in modules if m is not None]
    was_training = [m.training for m in modules]
    for module in modules:
        module.eval()
    try:
        yield
    finally:
        for module, mode in zip(modules, was_training):
            module.train(mode)


def _measure_verify_table(target, row_grid: list[int], widths: list[int], *, context_len: int, repeats: int,
                          dtype: torch.dtype, device: torch.device, generator: torch.Generator, refine: bool,
                          max_seconds: float | None, path: Path, progress: bool | None) -> StepCostProfile:
    """The target's verify table (no drafter costs), measured now."""
    start = time.perf_counter()
    row_grid, verify = _measure_step_cost(
        target, row_grid, widths, context_len=context_len, repeats=repeats, device=device, generator=generator,
        budget_s=math.inf if refine else CELL_BUDGET_S,
        max_seconds=math.inf if refine or max_seconds is None else max_seconds, path=path,
        progress=sys.stderr.isatty() if progress is None else progress)
    profile = StepCostProfile(tuple(row_grid), tuple(widths), tuple(map(tuple, make_nondecreasing(np.array(verify)))),
                              (0.0,) * len(row_grid),
                              {"source": "measured", "raw_verify_seconds": verify, "context_len": context_len,
                               "repeats": repeats, "key": path.stem.removeprefix("step-"),
                               "grid": "fine" if refine else "coarse", "dtype": str(dtype), "device": str(device),
                               "threads": torch.get_num_threads()})
    logger.info("step-cost profile: R=%s × W=%s in %.1fs; verify(1,1)=%.1f ms, verify(%d,%d)=%.1f ms", row_grid,
                widths, time.perf_counter() - start, 1e3 * profile.verify(1, 1), row_grid[-1], widths[-1],
                1e3 * profile.verify(row_grid[-1], widths[-1]))
    return profile


def _with_drafter(profile: StepCostProfile, target, draft, verify_path: Path, *, context_len: int, repeats: int,
                  device: torch.device, generator: torch.Generator, use_cache: bool) -> StepCostProfile:
    """``profile`` (a verify table) with the drafter's pass costs at its row counts, cached beside it per drafter."""
    path, key = draft_cost_file(verify_path, draft.config.to_json_string(use_diff=False))
    drafting, source = read_draft_seconds(path, profile.rows) if use_cache else None, "cache"
    if drafting is None:
        source = "measured"
        drafting = time_draft_passes(target, draft, list(profile.rows), context_len=context_len, repeats=repeats,
                                     device=device, generator=generator,
                                     budget_s=math.inf if profile.metadata.get("grid") == "fine" else CELL_BUDGET_S)
        logger.info("step-cost profile: drafter pass at R=%s: %s ms", list(profile.rows),
                    ", ".join(f"{1e3 * t:.1f}" for t in drafting))
        if use_cache:
            save_cached(path, {"rows": list(profile.rows), "raw_draft_seconds": drafting})
    sources = {profile.metadata.get("source"), source}
    return StepCostProfile(profile.rows, profile.widths, profile.verify_seconds,
                           tuple(make_nondecreasing(np.array(drafting)).tolist()),
                           {**profile.metadata, "raw_draft_seconds": drafting, "draft_key": key,
                            "source": "measured" if "measured" in sources else "cache"})


def _step_cost_path(target, row_grid: list[int], widths: list[int], *, fine: bool, cache_dir, context_len: int,
                    dtype: torch.dtype, device: torch.device, repeats: int, limit: float | None = None) -> Path:
    """Cache file of a target's verify table (the key it always had without a drafter, so those tables stay
    valid; tables measured with a drafter's passes in one file are no longer read)."""
    key = profile_cache_key(target, row_grid, context_len=context_len, row_len=widths[-1], dtype=dtype,
                            device=device, repeats=repeats)
    return step_cost_file(_cache_root(cache_dir), key, "" if fine else f"|coarse|{widths}|{CELL_BUDGET_S}|{limit}")


_SPOT_CHECKED: set[tuple[str, str]] = set()  # (cache file, its content hash) spot-checked in this process


def _load_step_cost(path: Path, target, context_len: int, device: torch.device, generator: torch.Generator,
                    recheck: bool) -> StepCostProfile | None:
    """The cached table at ``path``, or None (absent, malformed, or measured on a busy machine)."""
    cached = read_step_cost(path)
    if cached is None:
        return None
    profile, content = cached
    # one spot check per table and process: every engine (and generate's first call on a target) would otherwise
    # spend a prefill and a few forwards re-confirming what this process already confirmed
    checked = (str(path.resolve()), content)
    if recheck and checked not in _SPOT_CHECKED:
        if _measured_on_a_busy_machine(profile, target, context_len, device, generator):
            return None
        _SPOT_CHECKED.add(checked)
    logger.info("step-cost profile: cache hit %s", path)
    return StepCostProfile(profile.rows, profile.widths, profile.verify_seconds, profile.draft_seconds,
                           {**profile.metadata, "source": "cache", "cache_file": str(path)})


def _measure_step_cost(target, row_grid: list[int], widths: list[int], *, context_len: int, repeats: int,
                       device: torch.device, generator: torch.Generator, budget_s: float, max_seconds: float,
                       path: Path, progress: bool) -> tuple[list[int], list[list[float]]]:
    """(rows measured, raw verify seconds [rows][widths]), row counts in ascending order.

    Announces its estimated duration after the first full-context forward. A row count projected to end after
    ``max_seconds`` is not measured, nor any larger: StepCostProfile prices a larger row count by its tokens (a
    padded R × W step costs what the last measured row count pays for R·W tokens)."""
    from tqdm.auto import tqdm

    timing = dict(context_len=context_len, repeats=repeats, device=device, generator=generator)
    logger.info("step-cost profile: measuring R=%s × W=%s on this machine (once; cached in %s)", row_grid, widths,
                path.parent)
    start = time.perf_counter()
    # A global warm-up first (see _measure): the fine grid at its largest shape; the coarse one on a short context
    # (the one-off costs are per process, and the context below is prefilled only once).
    coarse = budget_s != math.inf
    time_padded_verify(target, 1 if coarse else row_grid[-1], widths[-1],
                       **{**timing, "repeats": 1, "context_len": min(context_len, 16) if coarse else context_len})
    bar = tqdm(total=len(row_grid) * len(widths), desc="step-cost profile", unit="cell",
               disable=not progress)
    prefill_start = time.perf_counter()
    context = prefill_context(target, context_len, device=device, generator=generator)
    synchronize(device)
    estimate = min(max_seconds, _estimated_seconds(row_grid, widths, time.perf_counter() - prefill_start,
                                                   context_len, repeats, budget_s))
    logger.log(logging.WARNING if estimate > ANNOUNCE_AFTER_S else logging.INFO,
               "step-cost profile: about %.0f s to measure the engine's step cost on this machine (R=%s × W=%s); it "
               "runs once and is cached in %s. To skip it, give DSparkEngine(sps=...) a StepCostProfile or an "
               "{B: steps/s} table, or keep sps_cache_dir= pointing at a cached table.", estimate, row_grid, widths,
               path.parent)
    measure = functools.partial(time_padded_verify_widths, target, budget_s=budget_s, context=context,
                                on_width=bar.update, **timing)
    verify, seconds = [], []
    try:
        for k, r in enumerate(row_grid):
            if k and time.perf_counter() - start + _projected_seconds(row_grid[:k], seconds, r) > max_seconds:
                logger.info("step-cost profile: R > %d not measured (max_seconds=%s): they are priced by their "
                            "tokens at the last row count measured; profile_step_cost(..., refine=True) measures them",
                            row_grid[k - 1], max_seconds)
                break
            row_start = time.perf_counter()
            verify.append(measure(r, widths))
            seconds.append(time.perf_counter() - row_start)
    finally:
        bar.close()
    return row_grid[:len(verify)], verify


def _estimated_seconds(row_grid: list[int], widths: list[int], prefill_seconds: float, context_len: int,
                       repeats: int, budget_s: float) -> float:
    """Duration of the verify timings, scaled from the context prefill (``context_len`` tokens in one forward): a
    cell costs its share of tokens (the compute-bound regime, where the time goes; latency-bound cells are fast
    anyway). The drafter's passes are left out: they cost a fraction of a verify."""
    total = 0.0
    for r in row_grid:
        cells = [prefill_seconds * r * w / context_len for w in widths]
        runs = [repeats if budget_s == math.inf else min(repeats, max(1, math.ceil(budget_s / max(t, 1e-9))))
                for t in cells]
        total += sum(n * t for n, t in zip(runs, cells)) + cells[0]  # + the row count's warm-up forward
    return total


def _projected_seconds(rows: list[int], seconds: list[float], num_rows: int) -> float:
    """Wall time of measuring ``num_rows`` rows, from the row counts measured so far: affine through the last two
    (a fixed latency plus a per-row cost, never decreasing), proportional to rows from a single one."""
    if len(rows) == 1:
        return seconds[0] * num_rows / rows[0]
    slope = max(0.0, (seconds[-1] - seconds[-2]) / (rows[-1] - rows[-2]))
    return seconds[-1] + slope * (num_rows - rows[-1])


# ---------------------------------------------------------------------------------------------------------
# A table measured on a busy machine: the cache is keyed by what changes the curve, not by how busy the machine was
# ---------------------------------------------------------------------------------------------------------
def _measured_on_a_busy_machine(profile: StepCostProfile, target, context_len: int, device: torch.device,
                                generator: torch.Generator) -> bool:
    """Whether a cached table is much slower than the machine is now (it was measured under load).

    Only this direction re-profiles: a machine that is busy *now* would otherwise replace a good table with a
    contaminated one (the engine's online step-time scaling absorbs a transiently busy machine)."""
    raw = profile.metadata.get("raw_verify_seconds")
    cached = float(raw[0][0]) if raw else profile.verify(profile.rows[0], 1)
    now = time_padded_verify(target, profile.rows[0], 1, context_len=context_len, repeats=5, device=device,
                             generator=generator)
    if cached > STALE_PROFILE_FACTOR * now:
        logger.warning("step-cost profile: the cached table has verify(%d,1) = %.1f ms, %.1f ms now: it was measured "
                       "on a busy machine; measuring again", profile.rows[0], 1e3 * cached, 1e3 * now)
        return True
    return False


def discard_stale_profile(profile: StepCostProfile, observed_ratio: float) -> bool:
    """Whether ``profile`` (read from the cache without a spot check) is stale: the fastest step a caller timed with
    it took ``observed_ratio`` × its prediction, and below 1 / :data:`STALE_PROFILE_FACTOR` the table was measured
    on a busy machine. A stale table's file is deleted, so the next measurement replaces it.

    Why: the spot check costs a prefill of the profiling context and a few forwards, which a process's first short
    ``generate`` call would pay before its first token; the call's own steps tell the same thing for free, one call
    later."""
    if profile.metadata.get("source") != "cache" or observed_ratio * STALE_PROFILE_FACTOR >= 1:
        return False
    logger.warning("step-cost profile: steps ran %.2f× the cached table's prediction: it was measured on a busy "
                   "machine; measuring again on next use", observed_ratio)
    path = profile.metadata.get("cache_file")
    if path:
        forget_cached(path)
    return True


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    """The folder measured tables are cached in: ``cache_dir`` (the caller's), else the package's cache."""
    if cache_dir is None:
        from ..embedded import default_cache_dir

        cache_dir = default_cache_dir()
    return Path(cache_dir) / _CACHE_SUBDIR


__all__ = ["ANNOUNCE_AFTER_S", "CELL_BUDGET_S", "STALE_PROFILE_FACTOR", "discard_stale_profile", "profile_step_cost",
           "profile_verify_sps"]
