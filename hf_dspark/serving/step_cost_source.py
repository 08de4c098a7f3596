"""The step cost the engine schedules with: the caller's table, or the engine's own step measured on first use.

Why lazily: only a cost-aware policy reads it, and measuring takes seconds (cached on disk afterwards), so an
engine under a cost-blind policy never pays for it. Why the engine measures its own step rather than reading the
target's shared cost (as ``generate`` does): its rows go up to ``max_running_requests`` and its verify width to
its longest proposal, and the profile is measured with the kernels its steps run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager

from ..scheduling.cost_tables import SPSProfile, StepCostProfile
from ..scheduling.step_cost import profile_step_cost

#: what ``DSparkEngine(sps=...)`` takes: a step-cost profile, an SPS(B) table (or its items), or None (measure)
CostSource = StepCostProfile | SPSProfile | Mapping[int, float] | Sequence[tuple[int, float]] | None


class EngineStepCost:
    """``profile``: seconds of one decode step (drafter pass + padded verify); ``sps``: SPS(B), the table the
    engine was given, else the profile read as SPS(B). Each is resolved on first access.

    Args:
        source: the caller's profile or table; None measures ``target`` + ``drafter`` (``profile_step_cost``:
            drafter pass for R requests and padded verify of R rows × W tokens, R up to ``max_rows``, W up to
            ``max_width``; cached on disk in ``cache_dir``). An SPS(B) table is read as verify(R, W) = 1/SPS(R·W)
            with no drafter cost.
        kernels: the context the engine's steps run their forwards in (the measurement runs in it too).
        on_measured: told the seconds a measurement took (loading it from the disk cache included), so the engine
            reports them as setup rather than serving time.
    """

    def __init__(self, source: CostSource, *, target, drafter, max_rows: int, max_width: int,
                 cache_dir: str | None, kernels: Callable[[], AbstractContextManager],
                 on_measured: Callable[[float], None] = lambda seconds: None):
        self.source, self.target, self.drafter = source, target, drafter
        self.max_rows, self.max_width, self.cache_dir = max_rows, max_width, cache_dir
        self._kernels = kernels
        self._on_measured = on_measured
        self._profile: StepCostProfile | None = None
        self._sps: SPSProfile | None = None

    @property
    def is_measured(self) -> bool:
        """Whether the engine measures the cost itself (then the rounds' wall time corrects it)."""
        return self.source is None

    @property
    def profile(self) -> StepCostProfile:
        if self._profile is None:
            if isinstance(self.source, StepCostProfile):
                self._profile = self.source
            elif self.source is not None:
                self._profile = StepCostProfile.from_sps(self.sps, self.max_width, self.max_rows)
            else:
                start = time.perf_counter()
                with self._kernels():
                    self._profile = profile_step_cost(self.target, self.drafter, max_rows=self.max_rows,
                                                      max_width=self.max_width, cache_dir=self.cache_dir)
                self._on_measured(time.perf_counter() - start)
        return self._profile

    @property
    def sps(self) -> SPSProfile:
        if self._sps is None:
            if isinstance(self.source, SPSProfile):
                self._sps = self.source
            elif self.source is not None and not isinstance(self.source, StepCostProfile):
                self._sps = SPSProfile.from_user_table(self.source)
            else:
                self._sps = self.profile.as_sps()
        return self._sps


__all__ = ["CostSource", "EngineStepCost"]
