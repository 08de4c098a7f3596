"""The grids a step-cost table is measured on: which row counts R and verify widths W get timed. Lookups interpolate
between them (``cost_tables.StepCostProfile``), so a grid must hold every point where the cost bends or jumps."""

from __future__ import annotations

from collections.abc import Sequence


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
    stock ``F.linear``, so a 1-token step of 9 rows costs what 16 rows do, and interpolating from 4 to 16 would
    price it far too cheap (the row counts an engine passes through as its rows finish one by one)."""
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


__all__ = ["coarse_row_grid", "coarse_width_grid", "default_row_grid"]
