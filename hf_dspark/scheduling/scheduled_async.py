"""The ``scheduled-async`` verify policy (paper §5.2): a verify budget sized from stale confidences by a global search,
then spent on the current candidates in Algorithm 1's order."""

from __future__ import annotations

import numpy as np
import torch

from .algorithm1 import (
    DEFAULT_MISSING_CONFIDENCE,
    ArrayLike,
    admission_order,
    fill_confidences,
    lengths_from_admissions,
    prefix_survival,
    throughput_path,
)
from .cost_tables import SPSProfile, StepCostProfile
from .policies import PolicyInputs, VerifyPolicy, register_policy
from .scheduled import ScheduledPolicy


@register_policy("scheduled-async")
class AsyncScheduledPolicy(VerifyPolicy):
    """Paper §5.2: the verify budget K (number of draft tokens) is sized from confidences ``delay`` (=2) steps
    old by a *global* search over Θ (no break, so jagged SPS cliffs do not trap it); the step then verifies
    the top-K current candidates ranked by up-to-date a_{r,j} (contiguous prefixes, same order as Algorithm 1).

    Why it stays lossless: K is a function of step t−2 information and of the current request count R only,
    neither of which sees the current drafts. Given K, "x_{r,j} verified" ⇔ rank of (r, j) < K, and the rank
    is set by candidates with a ≥ a_{r,j}, which (as in Algorithm 1) involve request r only through x_{r,<j}.
    The global search without a break is safe here precisely because it runs on stale confidences.

    K is re-evaluated with the current R as the base batch: Θ(K) = (R_now + Σ_{i≤K} a_old,i)·SPS(R_now + K).
    The first ``delay`` steps have no history and fall back to synchronous Algorithm 1 (also lossless).
    The history is keyed by ``inputs.step`` (the engine's step index; an internal counter when None).
    """

    needs_step_cost = True

    def __init__(self, missing_confidence: float | ArrayLike = DEFAULT_MISSING_CONFIDENCE, delay: int = 2):
        if delay < 1:
            raise ValueError(f"scheduled-async: delay must be >= 1 step, got {delay}")
        self.missing_confidence = missing_confidence
        self.delay = delay
        self.last_budget: int | None = None
        self._history: dict[int, np.ndarray] = {}  # step -> sorted candidate survivals of that step
        self._next_step = 0
        self._fallback = ScheduledPolicy(missing_confidence)

    def reset(self) -> None:
        self._history.clear()
        self._next_step = 0

    def budget(self, old_values: ArrayLike, num_requests: int, cost: SPSProfile | StepCostProfile) -> int:
        """Global argmax of Θ over the stale candidate pool (smallest K on ties)."""
        return int(np.argmax(throughput_path(old_values, num_requests, cost)))  # argmax: first maximum

    def choose(self, inputs: PolicyInputs) -> torch.Tensor:
        lengths = inputs.lengths()
        step = self._next_step if inputs.step is None else int(inputs.step)
        self._next_step = step + 1
        old_values = self._history.get(step - self.delay)
        survival = prefix_survival(fill_confidences(inputs.confidences, lengths, missing=self.missing_confidence))
        rows, _, values = admission_order(survival)
        self._history[step] = values
        for key in [k for k in self._history if k <= step - self.delay]:
            del self._history[key]
        if old_values is None:
            # the synchronous walk on this step's confidences alone (the break keeps it lossless for sampled rows)
            chosen = self._fallback.choose(PolicyInputs(inputs.confidences, lengths, inputs.cost)).numpy()
            self.last_budget = int(chosen.sum())
        else:
            self.last_budget = self.budget(old_values, lengths.size, inputs.cost)
            chosen = lengths_from_admissions(rows, min(self.last_budget, rows.size), lengths.size)
        return inputs.result(chosen)


__all__ = ["AsyncScheduledPolicy"]
