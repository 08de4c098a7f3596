"""Measured step times against the cost table's predictions: the corrections the scheduled policy prices each kind
of step with (:class:`StepTimeCorrection`).

The table is measured on bare forwards, once, on a shared machine; the steps the loop runs differ from it in two
ways, kept as two factors:

* ρ[(R, sampled)]: measured / predicted seconds of *plain* 1-token steps of R rows. The table's row counts were timed
  at different moments of a shared machine and on another context, so their errors differ per row count: one factor
  over all row counts would mix them.
* κ[(wide, drafted, sampled, R)]: measured / (predicted · ρ) of every other kind of step, relative to a plain step of
  its own row count: a sampled round draws and rejection-samples its drafts, a wide verify attends over holes, none
  of which the table's greedy forwards on a clean cache show.

Every choice compares kinds of step at one row count, where ρ cancels and κ decides.
"""

from __future__ import annotations

import numpy as np


class StepTimeCorrection:
    """ρ per row count and κ per kind of step, learned from each finished step's time (:meth:`observe`), applied as
    per-width factors of the table's step time (:meth:`factors`).

    Args:
        momentum (`float`, defaults to 0.9): weight of the past in the decayed means, in [0, 1).
        speculation_margin (`float`, defaults to 1.05): every kind of step but a plain one is priced this many times
            its estimate, ≥ 1. The estimates are noisy, and choosing whichever step looks best favours the ones that
            happen to look too good; where speculating is worth a few percent at best that bias decides. A fixed
            factor per kind of step keeps the width walk lossless.
    """

    #: plain steps timed before κ is trusted (ρ of one step is that step's noise), and the first refresh interval:
    #: after that many timed speculative steps in a row a plain one re-times ρ (the interval doubles per refresh)
    min_plain_steps: int = 3
    #: pseudo-steps at the borrowed ratio that a kind's first steps measuring it cheaper are weighed against
    cheap_evidence_steps: int = 8
    plain_refresh_interval: int = 32
    max_plain_refresh_interval: int = 512

    def __init__(self, momentum: float = 0.9, speculation_margin: float = 1.05):
        self.momentum, self.speculation_margin = momentum, float(speculation_margin)
        self._plain_ratio: dict[tuple[int, bool], float] = {}  # (rows, sampled) -> ρ
        self._plain_count: dict[tuple[int, bool], int] = {}
        self._time_ratio: dict[tuple[bool, bool, bool, int], float] = {}  # (wide, drafted, sampled, rows) -> κ·ρ
        self._time_count: dict[tuple[bool, bool, bool, int], int] = {}
        self._since_plain = 0  # timed steps since the last plain one
        self._plain_refresh_every = self.plain_refresh_interval

    def observe(self, drafted: bool, predicted_seconds: float, seconds: float, *, sampled: bool = False,
                wide: bool | None = None, rows: int | None = None) -> None:
        """A finished step: its wall time against the table's prediction (drafter pass + verify). ``wide``: it
        verified drafts (width > 1), None reads a drafted step as wide and a plain one as not; ``rows``: its row
        count (None: one correction for every row count)."""
        if not (predicted_seconds > 0 and seconds > 0):
            return
        ratio = min(max(seconds / predicted_seconds, 0.25), 4.0)  # one hiccup must not swing the decision
        wide = bool(drafted) if wide is None else bool(wide)
        key_rows = (int(rows) if rows else 0, bool(sampled))
        if not wide and not drafted:
            self._observe_plain(key_rows, ratio)
            return
        self._since_plain += 1
        if not self._plain_count:
            # no plain step timed yet: what this step says about the machine goes to ρ (its kind taken at its
            # current κ), which a real plain step then replaces — and the next step is a plain one
            # (:meth:`wants_plain_step`); learning κ against an unknown ρ would price the kind by the machine's
            # speed at the moment, relative to a plain step priced as profiled
            self._plain_ratio[key_rows] = ratio / self.kind_ratio(wide=wide, drafted=drafted, sampled=sampled,
                                                             rows=key_rows[0])
            return
        self._observe_kind((wide, bool(drafted), bool(sampled), key_rows[0]), key_rows, ratio)

    def _observe_plain(self, key_rows: tuple[int, bool], ratio: float) -> None:
        """A plain step: its row count's own ρ, the mean of the first 1/(1 - momentum) steps, a decayed mean after
        (plain steps are frequent, and a slowly settling ρ would bias every κ learned against it meanwhile)."""
        if self._since_plain >= self._plain_refresh_every:  # a refresh: the next one comes later
            self._plain_refresh_every = min(self.max_plain_refresh_interval, 2 * self._plain_refresh_every)
        self._since_plain = 0
        count = self._plain_count.get(key_rows, 0) + 1
        self._plain_count[key_rows] = count
        weight = max(1.0 / count, 1.0 - self.momentum)
        previous = self._plain_ratio.get(key_rows, ratio)
        self._plain_ratio[key_rows] = (1.0 - weight) * previous + weight * ratio

    def _observe_kind(self, key: tuple[bool, bool, bool, int], key_rows: tuple[int, bool], ratio: float) -> None:
        """Any other kind of step. It keeps its own measured / predicted ratio α, and κ = α / ρ is formed when it is
        used: a κ learned as a ratio to the ρ of its moment would keep that moment's ρ, and a few slow plain steps
        early on would misprice the kind for the rest of the run.

        α is the mean of the ratio the kind borrowed so far and its steps, a decayed mean once there are
        1/(1 - momentum) of them. The borrowed ratio counts as one step against a step that says the kind is dearer
        (one slow first step must not set it outright, but a kind that settles slowly keeps losing while it does)
        and as ``cheap_evidence_steps`` against one that says it is cheaper: a cheap-looking kind is chosen at once,
        and choosing on a few noisy steps favours the kinds that happened to look too cheap."""
        wide, drafted, sampled, rows = key
        count = self._time_count.get(key, 0) + 1
        self._time_count[key] = count
        previous = self._time_ratio.get(key)
        if previous is None:  # what the kind borrowed so far, in absolute terms
            previous = (self.kind_ratio(wide=wide, drafted=drafted, sampled=sampled, rows=rows)
                        * self._nearest_plain_ratio(*key_rows))
        prior = self.cheap_evidence_steps if ratio < previous else 1
        weight = max(1.0 / (count + prior), 1.0 - self.momentum)
        self._time_ratio[key] = (1.0 - weight) * previous + weight * ratio

    def wants_plain_step(self) -> bool:
        """Steps are being timed but fewer than ``min_plain_steps`` plain ones, or none for the last
        ``_plain_refresh_every`` steps: the next step should be plain, the reference every kind is corrected by.
        Why: a policy that keeps speculating never re-times ρ, and every κ is learned relative to it — one slow first
        plain step would make every other kind look cheap for good."""
        if not self._plain_ratio:
            return False
        return (sum(self._plain_count.values()) < self.min_plain_steps
                or self._since_plain >= self._plain_refresh_every)

    def _nearest_plain_ratio(self, rows: int, sampled: bool) -> float:
        """ρ of the nearest row count timed in plain steps (same sampling mode first), else 1."""
        for mode in (sampled, not sampled):
            timed = [r for r, s in self._plain_ratio if s == mode]
            if timed:
                return self._plain_ratio[min(timed, key=lambda r: (abs(r - rows), r)), mode]
        return 1.0

    def kind_ratio(self, *, wide: bool, drafted: bool, sampled: bool = False, rows: int | None = None) -> float:
        """κ: measured seconds of one kind of step of ``rows`` rows / (the table's prediction × ρ of its row count);
        1 for a plain step, the kind every other is compared with. Kept per row count (how much dearer a wide step is
        than a plain one grows with the rows: attention over more padded slots, more logits to verify); a row count
        not seen yet borrows the kind's nearest one, a kind not seen yet the nearest kind that was (same width class
        first: a wide lookup round before any was timed is priced like a drafted one), else 1."""
        if not wide and not drafted:
            return 1.0
        rows = int(rows) if rows else 0
        for s in (sampled, not sampled):
            for w, d in ((wide, drafted), (wide, not drafted), (not wide, drafted)):
                if w or d:
                    timed = [r for (tw, td, ts, r) in self._time_ratio if (tw, td, ts) == (w, d, s)]
                    if timed:
                        nearest = min(timed, key=lambda r: (abs(r - rows), r))
                        return self._time_ratio[bool(w), bool(d), bool(s), nearest] / self._nearest_plain_ratio(
                            nearest, bool(s))
        return 1.0

    def factors(self, gamma: int, *, drafted: bool, sampled: bool = False, rows: int | None = None) -> np.ndarray:
        """[γ + 1] corrections of the table's step time per verify width w = 0..γ (w = 0: nothing verified), for a
        step of ``rows`` rows; every kind of step but a plain one carries the speculation margin."""
        factors = np.full(gamma + 1, self.kind_ratio(wide=True, drafted=drafted, sampled=sampled, rows=rows))
        factors[0] = self.kind_ratio(wide=False, drafted=drafted, sampled=sampled, rows=rows)
        factors[0 if drafted else 1:] *= self.speculation_margin
        return factors

    @property
    def plain_ratios(self) -> dict[str, float]:
        """ρ: measured / predicted seconds of plain steps, by row count (and sampling mode)."""
        return {f"{rows} rows" + (", sampled" if sampled else ""): ratio
                for (rows, sampled), ratio in sorted(self._plain_ratio.items())}

    @property
    def kind_ratios(self) -> dict[str, float]:
        """The corrections in use, by kind of step, each relative to a plain step of the same row count ("plain":
        nothing drafted or verified, 1 by definition; "lookup": lookup drafts verified without a drafter pass;
        "drafted": a drafter pass and its drafts verified)."""
        return self.kind_ratios_at(None)

    def kind_ratios_at(self, rows: int | None) -> dict[str, float]:
        """:attr:`kind_ratios` for steps of ``rows`` rows (None: the fewest rows timed)."""
        out = {}
        for sampled in (False, True):
            tail = ", sampled" if sampled else ""
            for name, wide, drafted in (("plain", False, False), ("lookup", True, False), ("drafted", True, True),
                                        ("drafted, nothing verified", False, True)):
                out[name + tail] = self.kind_ratio(wide=wide, drafted=drafted, sampled=sampled, rows=rows)
        return out


__all__ = ["StepTimeCorrection"]
