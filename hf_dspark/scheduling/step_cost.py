"""SPS(B): verify steps per second as a function of the verify batch size B (tokens), measured on this machine.

The scheduler trades expected accepted tokens against step time, so it needs the real cost curve of the
target's verify forward: flat while the hardware is latency-bound (verifying more is almost free), falling
once it is compute-bound. The paper profiles it once at engine start and looks it up in O(1); so do we, and
cache the table on disk because profiling a real target takes seconds to minutes.

``SPSProfile`` is the table; ``profile_verify_sps`` measures it (or returns a cached / user-supplied one).

The engine verifies a *padded* batch (R rows × width W = 1 + max ℓ_r) and runs the drafter every step it
drafts, so the cost it actually pays is t_draft(R) + t_verify(R, W), not 1/SPS(Σ(1 + ℓ_r)). On a CPU the two
differ a lot: one long row widens every row, and the drafter pass is a fixed price per step.
``StepCostProfile`` measures exactly that grid (``profile_step_cost``); it still answers SPS(B) lookups (B
tokens laid out in rows of 1 + γ) so every SPS-based policy can use it unchanged. The engine's start-up profile
is coarse and time-limited by default (SmolLM2 on a loaded 2-core CPU: ~25 s, was minutes), says so in one
WARNING line when it is slow, and ``profile_step_cost(..., refine=True)`` measures the fine grid on demand. The
verify table is the target's, cached without the drafter (every engine and ``generate`` call on a target prices a
verify step alike); each drafter's pass costs are cached beside it, timed between target forwards as the loop
runs them. The cache only saves time: a malformed file is measured again (a warning), and a folder that cannot be
written costs one warning per process, the tables then kept in memory for the process.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from ..modeling.target_support import cache_kwarg
from .cost_tables import (  # noqa: F401 (the tables are imported from here too)
    _CACHE_VERSION,
    _save_json_atomic,
    SPSProfile,
    StepCostProfile,
    default_batch_grid,
    isotonic_fit,
    make_monotone,
    make_nondecreasing,
    number_list,
    verify_batch_shape,
)

logger = logging.getLogger(__name__)

_CACHE_SUBDIR = "sps"


# ---------------------------------------------------------------------------------------------------------
# Measuring the target
# ---------------------------------------------------------------------------------------------------------
def profile_cache_key(target, batch_tokens: Sequence[int], *, context_len: int, row_len: int, dtype: torch.dtype,
                      device: torch.device | str, repeats: int) -> str:
    """Hash of everything that changes the curve: model identity + config, dtype, device, CPU threads, grid,
    the kernel the linears run with (``cpu_kernels.linear_kernel``)."""
    from ..cpu_kernels import linear_kernel

    config = target.config.to_json_string(use_diff=False) if hasattr(target.config, "to_json_string") else ""
    ident = {"name": getattr(target.config, "_name_or_path", "") or type(target).__name__,
             "config": hashlib.sha256(config.encode()).hexdigest(), "dtype": str(dtype), "device": str(device),
             "threads": torch.get_num_threads(), "grid": list(batch_tokens), "context_len": context_len,
             "row_len": row_len, "repeats": repeats, "torch": torch.__version__, "version": _CACHE_VERSION,
             "linears": linear_kernel(target)}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


def time_verify_forward(target, num_tokens: int, *, context_len: int, row_len: int, repeats: int,
                        device: torch.device, generator: torch.Generator) -> float:
    """Median wall time (s) of one verify forward over B tokens on top of a prefilled KV cache of context_len."""
    rows, length = verify_batch_shape(num_tokens, row_len)
    return time_padded_verify(target, rows, length, context_len=context_len, repeats=repeats, device=device,
                              generator=generator)


def time_padded_verify(target, rows: int, length: int, *, context_len: int, repeats: int, device: torch.device,
                       generator: torch.Generator) -> float:
    """Median wall time (s) of one verify forward of ``rows`` rows × ``length`` tokens, each row on top of its own
    prefilled KV cache of ``context_len`` tokens (the engine's padded layout)."""
    return time_padded_verify_widths(target, rows, [length], context_len=context_len, repeats=repeats, device=device,
                                     generator=generator)[0]


@torch.inference_mode()
def prefill_context(target, context_len: int, *, device: torch.device, generator: torch.Generator):
    """A one-row DynamicCache (appending in place, as the loop's) holding ``context_len`` random tokens: the context every verify timing sits on."""
    from ..speculation.kv_cache import growing_cache  # the cache the loop runs on (appends in place)

    vocab = target.config.get_text_config().vocab_size
    context = torch.randint(0, vocab, (1, context_len), generator=generator).to(device)
    cache = growing_cache(target.config)
    target(input_ids=context, use_cache=True, **{cache_kwarg(target): cache})
    return cache


@torch.inference_mode()
def time_padded_verify_widths(target, rows: int, widths: Sequence[int], *, context_len: int, repeats: int,
                              device: torch.device, generator: torch.Generator, budget_s: float = math.inf,
                              context=None, on_width=None) -> list[float]:
    """:func:`time_padded_verify` for several widths on one prefilled context (``context``, a one-row
    :func:`prefill_context` cache that is copied, not changed; prefilled here when None): one untimed warm-up
    forward, then up to ``repeats`` passes over the widths, one timed forward of each per pass; a width drops out
    of later passes once its timed forwards took ``budget_s`` (a long forward's minimum needs fewer samples).
    ``on_width()`` runs as each width finishes.

    Passes, not one width's repeats back to back: on a shared machine interference comes in bursts of seconds,
    and a burst that lands on all of one width's repeats makes that width look dear for as long as the table is
    cached (one such table priced verifying 3 drafts at 1.5× 2 drafts where the kernel costs the same for both);
    across passes a burst costs every width one sample, and the minimum discards it."""
    vocab = target.config.get_text_config().vocab_size
    cache = copy.deepcopy(context) if context is not None else prefill_context(target, context_len, device=device,
                                                                                generator=generator)
    cache_name = cache_kwarg(target)
    cache.batch_repeat_interleave(rows)
    inputs = [(torch.randint(0, vocab, (rows, length), generator=generator).to(device),
               (context_len + torch.arange(length, device=device)).expand(rows, -1)) for length in widths]

    def forward(j: int) -> float:
        ids, positions = inputs[j]
        _synchronize(device)
        start = time.perf_counter()
        target(input_ids=ids, position_ids=positions, use_cache=True, **{cache_name: cache})
        _synchronize(device)
        seconds = time.perf_counter() - start
        cache.crop(-ids.shape[1])  # transformers >= 5.24: negative = number of tokens to drop
        return seconds

    if widths:
        forward(0)  # the very first forward is a warm-up and is not timed
    times: list[list[float]] = [[] for _ in widths]
    active = list(range(len(widths)))
    for repeat in range(max(repeats, 1)):
        for j in active:
            times[j].append(forward(j))
        last_pass = repeat == max(repeats, 1) - 1
        finished = [j for j in active if last_pass or sum(times[j]) >= budget_s]
        active = [j for j in active if j not in finished]
        for _ in finished if on_width is not None else ():
            on_width()
        if not active:
            break
    return [_robust_seconds(t) for t in times]


def _robust_seconds(times: Sequence[float]) -> float:
    """The fastest of the timed repeats: interference from other processes only ever adds time, so on a shared
    machine the minimum is the best estimate of what the forward costs (a median still absorbs one stall in
    three repeats, and a profile measured under load would steer every later decision)."""
    return min(times)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_verify_sps(target, batch_token_sizes: Sequence[int] | None = None, *, max_batch_tokens: int = 256,
                       context_len: int = 256, row_len: int = 8, repeats: int = 5,
                       user_table: Mapping[int, float] | Sequence[tuple[int, float]] | SPSProfile | None = None,
                       cache_dir: str | os.PathLike | None = None, use_cache: bool = True,
                       seed: int = 0) -> SPSProfile:
    """SPS(B) of ``target``'s verify forward on this machine, made monotone non-increasing (running min).

    ``user_table`` wins when given (no measuring). Otherwise a cached table for the same model/config, dtype,
    device, thread count and grid is reused from ``<cache_dir or hf_dspark cache>/sps/``; else each B in the
    grid is timed (median of ``repeats`` after a warm-up) and the result cached. Dtype and device are the
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
    try:
        data = _read_cached(path) if use_cache else _NO_CACHE_FILE
        if data is not _NO_CACHE_FILE:
            profile = SPSProfile.from_dict(data)
            logger.info("SPS profile: cache hit %s (%d sizes, B=%d..%d)", path, len(grid), grid[0], grid[-1])
            return SPSProfile(profile.batch_tokens, profile.steps_per_second, {**profile.metadata, "source": "cache"})
    except (ValueError, OSError) as err:
        logger.warning("SPS profile: ignoring unreadable cache file %s (%s); re-profiling", path, err)
    profile = _measure(target, grid, context_len=context_len, row_len=row_len, repeats=repeats, device=device,
                       seed=seed)
    profile.metadata.update(key=key, dtype=str(dtype), device=str(device), threads=torch.get_num_threads())
    if use_cache and _save_cached(path, profile.to_dict()):
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


def default_row_grid(max_rows: int) -> list[int]:
    """1, 2, 4, ... up to ``max_rows`` (always included)."""
    grid = [1]
    while grid[-1] * 2 < max_rows:
        grid.append(grid[-1] * 2)
    return sorted(set(grid + [max_rows]))


def coarse_row_grid(max_rows: int, *, skinny: bool = False) -> list[int]:
    """1, 2, 4, then ×4 (16, 64, ...) up to ``max_rows`` (always included): the default step-cost grid. Linear
    interpolation between is what the cost does once it is compute-bound, where the big (slow) row counts lie.

    With ``skinny`` also 8, 9 and 17 (below ``max_rows``): the kernel pads 9-16 rows to 16 and hands more than 16 to
    stock ``F.linear``, so a 1-token step of 9 rows costs what 16 rows do, and interpolating from 4 to 16 priced it
    at ~40 % less (the engine's drain, rows finishing one by one, ran its plain steps at 1.3-1.7× their price)."""
    grid = [r for r in (1, 2, 4) if r < max_rows]
    while (grid[-1] if grid else 1) * 4 < max_rows:
        grid.append(max(grid[-1] * 4, 16))
    if skinny:
        from ..cpu_kernels import SKINNY_MAX_ROWS

        grid += [r for r in (8, 9, SKINNY_MAX_ROWS + 1) if r < max_rows]
    return sorted(set(grid + [max_rows]))


def coarse_width_grid(max_width: int, rows: Sequence[int] = (), *, skinny: bool = False) -> list[int]:
    """1..4 densely (most verify widths are short), then ×2 (8, 16, ...) up to ``max_width`` (always included).

    With ``skinny`` (the step runs ``cpu_kernels.skinny_linears``) also, for each row count R in ``rows``, the
    first width whose R·W rows the kernel pads to 16 (past 8) and the first it hands to stock ``F.linear`` (past
    16): the cost jumps there, and interpolating across a jump from the measured widths either side
    underestimates every width just past it (R = 4: W = 5 costs what W = 8 does, not a quarter of the way)."""
    grid = [w for w in (1, 2, 3, 4) if w < max_width]
    while grid and grid[-1] * 2 < max_width:
        grid.append(grid[-1] * 2)
    if skinny:
        from ..cpu_kernels import SKINNY_MAX_ROWS

        for r in rows:
            for limit in (8, SKINNY_MAX_ROWS):  # 8 → padded to 16, 16 → stock kernel
                grid += [w for w in (limit // r + 1,) if w <= max_width]
    return sorted(set(grid + [max_width]))


# Coarse profiling stops repeating a cell (verify R × W, or one drafter pass) once its timed runs took this long.
CELL_BUDGET_S = 0.5
# Timed drafter passes per row count (at least; a pass costs milliseconds): the minimum over three, even between
# target forwards, was still 1.5× the loop's cost in one of three processes on a 2-core CPU.
DRAFT_PASS_REPEATS = 10
# A start-up profile estimated to take longer than this is announced with a WARNING (INFO otherwise).
ANNOUNCE_AFTER_S = 10.0


@torch.inference_mode()
def time_draft_pass(draft, rows: int, *, context_len: int, repeats: int, device: torch.device,
                    generator: torch.Generator, budget_s: float = math.inf) -> float:
    """Wall time (s) of one batched ``draft_block`` for ``rows`` requests with ``context_len`` context
    (``repeats`` timed passes after a warm-up, fewer once they took ``budget_s``), timed back to back.
    ``profile_step_cost`` times the drafter between target forwards instead, as the loop runs it."""
    run = _draft_pass(draft, rows, context_len=context_len, device=device, generator=generator)
    times = []
    for i in range(repeats + 1):  # the first pass is a warm-up
        seconds = _timed(run, device)
        if i:
            times.append(seconds)
            if sum(times) >= budget_s:
                break
    return _robust_seconds(times)


def _draft_pass(draft, rows: int, *, context_len: int, device: torch.device,
                generator: torch.Generator) -> Callable[[], object]:
    """One batched drafter pass for ``rows`` requests on ``context_len`` tokens of random context, ready to run."""
    from ..modeling.modeling import DraftCache

    features = torch.randn(rows, context_len, draft.fc.in_features, generator=generator).to(
        device=device, dtype=draft.fc.weight.dtype)
    positions = torch.arange(context_len, device=device).expand(rows, -1)
    # next_ids: what an autoregressive drafter pairs each position with (block drafters ignore them)
    next_ids = torch.randint(0, draft.config.vocab_size, positions.shape, generator=generator).to(device)
    cache = draft.extend_context(DraftCache(), features, positions, next_ids=next_ids, packed=True)  # as the round
    vocab = draft.config.vocab_size
    anchors = torch.randint(0, vocab, (rows,), generator=generator).to(device)
    anchor_positions = torch.full((rows,), context_len, device=device)
    return functools.partial(draft.draft_block, cache, anchors, anchor_positions, confidence_threshold=0.0,
                             context_precedes_anchors=True)


def _timed(run: Callable[[], object], device: torch.device) -> float:
    _synchronize(device)
    start = time.perf_counter()
    run()
    _synchronize(device)
    return time.perf_counter() - start


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
    same verify step with the same numbers: a lookup-only engine and a fused one each measured their own table
    once, the two disagreed by ~20 % at 4 rows, and the fused engine's lookup steps ran wider than the lookup-only
    engine's on the same traffic for no reason but the noise of a separate measurement.

    The cache is keyed by model, dtype, device and threads, not by how busy the machine was: a table measured
    while other work ran would steer every later engine. With ``recheck`` a cache hit is spot-checked (one
    1-token verify), once per table and process; if that is much faster now than the cached value, the table is
    measured again."""
    from ..cpu_kernels import SKINNY_KERNEL, linear_kernel

    skinny = linear_kernel(target).startswith(SKINNY_KERNEL)

    def grids(fine: bool) -> tuple[list[int], list[int]]:
        default = default_row_grid(max_rows) if fine else coarse_row_grid(max_rows, skinny=skinny)
        row_grid = sorted(set(int(r) for r in (rows or default)))
        return row_grid, (list(range(1, max_width + 1)) if fine
                          else coarse_width_grid(max_width, row_grid, skinny=skinny))

    row_grid, widths = grids(refine)
    if not row_grid or row_grid[0] < 1 or max_width < 1:
        raise ValueError(f"profile_step_cost: rows must be positive and max_width >= 1, got {row_grid}, {max_width}")
    param = next(target.parameters())
    dtype, device = param.dtype, param.device
    generator = torch.Generator().manual_seed(seed)
    ident = dict(context_len=context_len, dtype=dtype, device=device, repeats=repeats)
    fine_path = _step_cost_path(target, *grids(True), fine=True, cache_dir=cache_dir, **ident)
    path = fine_path if refine else _step_cost_path(target, row_grid, widths, fine=False, cache_dir=cache_dir,
                                                    limit=None if rows else max_seconds, **ident)
    profile = None
    for candidate in dict.fromkeys([fine_path, path]) if use_cache else ():
        profile = _load_step_cost(candidate, target, context_len, device, generator, recheck)
        if profile is not None:
            path = candidate
            break
    modules = [m for m in (target, draft) if m is not None]
    was_training = [m.training for m in modules]
    for module in modules:
        module.eval()
    try:
        if profile is None:
            profile = _measure_verify_table(target, row_grid, widths, context_len=context_len, repeats=repeats,
                                            dtype=dtype, device=device, generator=generator, refine=refine,
                                            max_seconds=None if rows else max_seconds, path=path, progress=progress)
            if use_cache:
                _save_cached(path, profile.to_dict())
        if draft is not None:
            profile = _with_drafter(profile, target, draft, path, context_len=context_len, repeats=repeats,
                                    device=device, generator=generator, use_cache=use_cache)
    finally:
        for module, mode in zip(modules, was_training):
            module.train(mode)
    return profile


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
    draft_config = draft.config.to_json_string(use_diff=False)
    key = hashlib.sha256((verify_path.stem + "|draft-between-forwards|" + draft_config).encode()).hexdigest()[:24]
    path = verify_path.with_name(f"draft-{key}.json")
    drafting, source = _cached_draft_seconds(path, profile.rows) if use_cache else None, "cache"
    if drafting is None:
        source = "measured"
        drafting = _time_draft_passes(target, draft, list(profile.rows), context_len=context_len, repeats=repeats,
                                      device=device, generator=generator,
                                      budget_s=math.inf if profile.metadata.get("grid") == "fine" else CELL_BUDGET_S)
        logger.info("step-cost profile: drafter pass at R=%s: %s ms", list(profile.rows),
                    ", ".join(f"{1e3 * t:.1f}" for t in drafting))
        if use_cache:
            _save_cached(path, {"rows": list(profile.rows), "raw_draft_seconds": drafting})
    sources = {profile.metadata.get("source"), source}
    return StepCostProfile(profile.rows, profile.widths, profile.verify_seconds,
                           tuple(make_nondecreasing(np.array(drafting)).tolist()),
                           {**profile.metadata, "raw_draft_seconds": drafting, "draft_key": key,
                            "source": "measured" if "measured" in sources else "cache"})


def _cached_draft_seconds(path: Path, rows: tuple[int, ...]) -> list[float] | None:
    """A drafter's pass costs cached at ``path`` for these row counts; None when there are none, they were measured
    at other row counts, or the file is malformed (then with a warning: it is measured again and overwritten)."""
    try:
        cached = _read_cached(path)
        if cached is _NO_CACHE_FILE:
            return None
        if not isinstance(cached, Mapping):
            raise ValueError(f"expected a JSON object, got {type(cached).__name__}")
        if tuple(number_list(cached.get("rows"), "rows", integers=True)) != rows:
            return None
        seconds = number_list(cached.get("raw_draft_seconds"), "raw_draft_seconds")
        if len(seconds) != len(rows) or not all(s > 0 for s in seconds):
            raise ValueError(f"raw_draft_seconds must hold one time > 0 per row count {list(rows)}, got {seconds}")
        return [float(s) for s in seconds]
    except (ValueError, OSError) as err:
        logger.warning("step-cost profile: ignoring unreadable drafter cost file %s (%s)", path, err)
        return None


@torch.inference_mode()
def _time_draft_passes(target, draft, rows: list[int], *, context_len: int, repeats: int, device: torch.device,
                       generator: torch.Generator, budget_s: float) -> list[float]:
    """The drafter's pass for each row count as the loop runs it: between target forwards. Timed back to back,
    SmolLM2's drafter on 2 CPU cores cost 6.4-11.8 ms a pass in some processes against 4.2 ms between forwards,
    and priced at that ``generate`` stopped drafting on prompts where drafting pays. Each timed pass follows a
    1-token verify forward of as many rows; passes go over every row count in turn (a burst of interference costs
    each one sample, as in :func:`time_padded_verify_widths`), at least ``DRAFT_PASS_REPEATS`` of them, a row
    count dropping out once its timed passes took ``budget_s``; the minimum is kept."""
    context = prefill_context(target, context_len, device=device, generator=generator)
    vocab = target.config.get_text_config().vocab_size
    cache_name = cache_kwarg(target)
    steps = []
    for r in rows:
        cache = copy.deepcopy(context)
        cache.batch_repeat_interleave(r)
        ids = torch.randint(0, vocab, (r, 1), generator=generator).to(device)
        positions = torch.full((r, 1), context_len, device=device)
        forward = functools.partial(target, input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1,
                                    **{cache_name: cache})

        def verify(forward=forward, cache=cache) -> None:
            forward()
            cache.crop(-1)  # the context stays context_len long, however many passes are timed

        steps.append((verify, _draft_pass(draft, r, context_len=context_len, device=device, generator=generator)))
    times: list[list[float]] = [[] for _ in rows]
    active = list(range(len(rows)))
    for i in range(max(repeats, DRAFT_PASS_REPEATS) + 1):  # the first pass is a warm-up
        for j in active:
            verify, run = steps[j]
            verify()
            seconds = _timed(run, device)
            if i:
                times[j].append(seconds)
        active = [j for j in active if sum(times[j]) < budget_s]
        if not active:
            break
    return [_robust_seconds(t) for t in times]


def _step_cost_path(target, row_grid: list[int], widths: list[int], *, fine: bool, cache_dir, context_len: int,
                    dtype: torch.dtype, device: torch.device, repeats: int, limit: float | None = None) -> Path:
    """Cache file of a target's verify table (the key it always had without a drafter, so those tables stay
    valid; tables measured with a drafter's passes in one file are no longer read)."""
    key = profile_cache_key(target, row_grid, context_len=context_len, row_len=widths[-1], dtype=dtype,
                            device=device, repeats=repeats)
    grid = "" if fine else f"|coarse|{widths}|{CELL_BUDGET_S}|{limit}"
    key = hashlib.sha256((key + "|step-cost-isotonic|" + grid).encode()).hexdigest()[:24]
    return _cache_root(cache_dir) / f"step-{key}.json"


_SPOT_CHECKED: set[tuple[str, str]] = set()  # (cache file, its content hash) spot-checked in this process


def _load_step_cost(path: Path, target, context_len: int, device: torch.device, generator: torch.Generator,
                    recheck: bool) -> StepCostProfile | None:
    """The cached table at ``path``, or None (absent, malformed, or measured on a busy machine)."""
    try:
        data = _read_cached(path)
        if data is _NO_CACHE_FILE:
            return None
        profile = StepCostProfile.from_dict(data)
        _raise_if_malformed_raw_verify(profile)
    except (ValueError, OSError) as err:
        logger.warning("step-cost profile: ignoring unreadable cache file %s (%s); re-profiling", path, err)
        return None
    # one spot check per table and process: every engine (and generate's first call on a target) would otherwise
    # spend ~7 forwards re-confirming what this process already confirmed
    checked = (str(path.resolve()), hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest())
    if recheck and checked not in _SPOT_CHECKED:
        if _measured_on_a_busy_machine(profile, target, context_len, device, generator):
            return None
        _SPOT_CHECKED.add(checked)
    logger.info("step-cost profile: cache hit %s", path)
    return StepCostProfile(profile.rows, profile.widths, profile.verify_seconds, profile.draft_seconds,
                           {**profile.metadata, "source": "cache", "cache_file": str(path)})


def discard_stale_profile(profile: StepCostProfile, observed_ratio: float) -> bool:
    """Whether ``profile`` (read from the cache without a spot check) is stale: the fastest step a caller timed with
    it took ``observed_ratio`` × its prediction, and below 1 / :data:`STALE_PROFILE_FACTOR` the table was measured
    on a busy machine. A stale table's file is deleted, so the next measurement replaces it.

    Why: the spot check costs a prefill of the profiling context and a few forwards (~0.8 s for SmolLM2 on a 2-core
    CPU), which a process's first short ``generate`` call would pay before its first token; the call's own steps
    tell the same thing for free, one call later."""
    if profile.metadata.get("source") != "cache" or observed_ratio * STALE_PROFILE_FACTOR >= 1:
        return False
    logger.warning("step-cost profile: steps ran %.2f× the cached table's prediction: it was measured on a busy "
                   "machine; measuring again on next use", observed_ratio)
    path = profile.metadata.get("cache_file")
    if path:
        _UNSAVED.pop(path, None)
        try:
            Path(path).unlink(missing_ok=True)
        except OSError as err:
            logger.warning("step-cost profile: cannot delete the stale table %s (%s)", path, err)
    return True


def _raise_if_malformed_raw_verify(profile: StepCostProfile) -> None:
    """The raw timings a cached table keeps (read by the spot check) must be [rows][widths] times > 0."""
    raw = profile.metadata.get("raw_verify_seconds")
    if raw is None:
        return
    if not isinstance(raw, list) or len(raw) != len(profile.rows):
        raise ValueError(f"metadata.raw_verify_seconds must have one line per row count {list(profile.rows)}")
    for i, line in enumerate(raw):
        if len(number_list(line, f"metadata.raw_verify_seconds[{i}]")) != len(profile.widths) or not all(
                t > 0 for t in line):
            raise ValueError(f"metadata.raw_verify_seconds[{i}] must hold one time > 0 per width "
                             f"{list(profile.widths)}, got {line}")


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
    # A global warm-up first (see _measure): the fine grid at its largest shape, as it always did; the coarse one
    # on a short context (the one-off costs are per process, and the context below is prefilled only once).
    coarse = budget_s != math.inf
    time_padded_verify(target, 1 if coarse else row_grid[-1], widths[-1],
                       **{**timing, "repeats": 1, "context_len": min(context_len, 16) if coarse else context_len})
    bar = tqdm(total=len(row_grid) * len(widths), desc="step-cost profile", unit="cell",
               disable=not progress)
    prefill_start = time.perf_counter()
    context = prefill_context(target, context_len, device=device, generator=generator)
    _synchronize(device)
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


# A cached table whose 1-token verify is this many times slower than a fresh measurement is re-measured.
STALE_PROFILE_FACTOR = 1.4


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


# The cache folder is an optimisation: a folder that will not take a table (read-only, under a regular file, a full
# disk) costs one warning, and the table is kept here for the rest of the process instead, so a second engine or
# generate call does not measure again.
_UNSAVED: dict[str, object] = {}  # cache file -> the JSON this process could not write there
_UNWRITABLE_FOLDERS: set[str] = set()  # folders already warned about in this process
_NO_CACHE_FILE = object()  # _read_cached: nothing cached (a file holding ``null`` reads as None)


def _read_cached(path: Path):
    """The parsed JSON of a cache file (this process's copy when the folder would not take it), _NO_CACHE_FILE when
    there is none. Raises ValueError (not JSON) or OSError (not readable)."""
    if str(path) in _UNSAVED:
        return _UNSAVED[str(path)]
    if not path.is_file():
        return _NO_CACHE_FILE
    return json.loads(path.read_text())


def _save_cached(path: Path, data: dict) -> bool:
    """Write a cache file; whether it was written. A folder that refuses it is warned about once per process and
    folder, and the table is kept in memory instead: a call must never fail for want of a cache."""
    try:
        _save_json_atomic(path, data)
    except OSError as err:
        _UNSAVED[str(path)] = json.loads(json.dumps(data))  # what the file would hold, not the live metadata dict
        folder = str(path.parent)
        if folder not in _UNWRITABLE_FOLDERS:
            _UNWRITABLE_FOLDERS.add(folder)
            logger.warning("step-cost profile: cannot write the cache folder %s (%s); measured tables are kept in "
                           "memory for this process only and measured again by the next one. Point HF_DSPARK_CACHE "
                           "(or cache_dir= / DSparkEngine(sps_cache_dir=...)) at a writable folder to keep them.",
                           folder, err)
        return False
    _UNSAVED.pop(str(path), None)
    return True


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is None:
        from ..embedded import default_cache_dir

        cache_dir = default_cache_dir()
    return Path(cache_dir) / _CACHE_SUBDIR


__all__ = ["SPSProfile", "StepCostProfile", "default_batch_grid", "discard_stale_profile", "default_row_grid", "make_monotone",
           "isotonic_fit", "make_nondecreasing", "profile_cache_key", "profile_step_cost", "profile_verify_sps",
           "coarse_row_grid", "coarse_width_grid", "prefill_context", "time_draft_pass", "time_padded_verify",
           "time_padded_verify_widths",
           "time_verify_forward", "verify_batch_shape"]
