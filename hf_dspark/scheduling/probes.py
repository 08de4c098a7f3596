"""When to draft anyway on a step where drafting does not look like it pays: the probe schedule
(:class:`ProbeSchedule`).

A policy that stops drafting stops learning what drafting would accept, so it could never notice when the traffic
turns back to text the drafter drafts well. After a run of skipped steps it therefore drafts once to re-measure —
a probe. A probe costs a drafter pass and a wide verify, so it is spaced out: each probe that finds drafting still
not paying makes the next one come later, and none is spent at a load where even a much better drafter could not
pay.
"""

from __future__ import annotations

from typing import Callable


class ProbeSchedule:
    """Counts skipped steps and says when the next probe is due.

    Args:
        interval (`int`, defaults to 32): skipped steps before the first probe, ≥ 1.
        backoff (`float`, defaults to 2.0): factor on the interval after each probe, ≥ 1. Why not 1: at a load where
            drafting never pays every probe only costs, and a fixed interval keeps paying that for as long as the
            load lasts; with back-off the cost fades (32, 64, 128, ... skipped steps).
        max_interval (`int`, defaults to 1024): the interval's cap, ≥ ``interval``.
        headroom (`float`, defaults to 1.5): a probe is spent only where drafting would pay if the drafter's
            conditional acceptance were up to this many times the best it has shown, ≥ 1 (1: only where its recent
            acceptance already pays).
    """

    #: drafted rows behind the drafter's estimate before probes are gated by ``headroom`` (one round's confidences on
    #: one row are no basis for never drafting again)
    min_evidence: int = 16

    def __init__(self, interval: int = 32, backoff: float = 2.0, max_interval: int = 1024, headroom: float = 1.5):
        self.interval, self.backoff, self.max_interval = interval, backoff, max_interval
        self.headroom = float(headroom)
        self._every = interval  # the current interval (backed off by each probe, reset by a paying step)
        self._skipped_in_a_row = 0

    def due(self, plausible: Callable[[], bool] | None = None, *, evidence_rows: int = 0) -> bool:
        """Whether to probe now: after the current interval of skipped steps — if ``plausible()`` says a probe could
        find drafting paying at this load, once ``evidence_rows`` drafted rows back the drafter's estimate (before
        that, always). A probe restarts the count and backs the interval off."""
        if self._skipped_in_a_row < self._every:
            return False
        if plausible is not None and evidence_rows >= self.min_evidence and not plausible():
            return False
        self._skipped_in_a_row = 0
        self._every = min(self.max_interval, round(self._every * self.backoff))
        return True

    def note_decision(self, pays: bool) -> None:
        """A priced step that was not a probe: a skipped one counts towards the next probe, a paying one resets the
        interval."""
        self._skipped_in_a_row = 0 if pays else self._skipped_in_a_row + 1
        if pays:
            self._every = self.interval


__all__ = ["ProbeSchedule"]
