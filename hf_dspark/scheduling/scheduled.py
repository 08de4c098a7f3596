"""The ``scheduled`` verify policy: paper Algorithm 1 (algorithm1.py) priced with this machine's measured step cost,
corrected online by small estimators — the drafter's acceptance (acceptance.py), the step times (step_time.py) — and
re-measuring a skipped drafter on a probe schedule (probes.py); it also chooses between lookup and drafter proposals.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from .acceptance import AcceptanceCorrection, DrafterSurvival, survival_per_row
from .algorithm1 import (
    DEFAULT_MISSING_CONFIDENCE,
    ArrayLike,
    as_lengths,
    fill_confidences,
    padded_width_path,
    prefix_survival,
    walk_admissions,
    walk_widths,
)
from .cost_tables import StepCostProfile
from .policies import PolicyInputs, VerifyPolicy, register_policy
from .probes import ProbeSchedule
from .step_time import StepTimeCorrection

logger = logging.getLogger(__name__)


@register_policy("scheduled")
class ScheduledPolicy(VerifyPolicy):
    """Paper Algorithm 1: maximise Θ = τ · SPS(B) by admitting candidates in order of prefix survival a_{r,j},
    keeping the best Θ and stopping at the first admission that does not improve it.

    Why the greedy order: extending r from j−1 to j adds exactly a_{r,j} expected tokens and one verify token,
    so for any batch size B the best allocation takes the B − R largest a's; walking the sorted list visits
    the best allocation of every B.

    Why the break keeps it lossless (paper App. A): "ℓ_r ≥ j" is settled by the walk up to candidate (r, j),
    and every candidate before it has a ≥ a_{r,j}; of request r's own candidates only j' ≤ j qualify, and
    a_{r,j} depends on c_{r,1..j}, i.e. on x_{r,<j}. So admitting x_{r,j} never looks at x_{r,j}. A global
    argmax over the whole path would also look at a_{r,j+1} = a_{r,j} · c_{r,j+1}(x_{r,j}) and admit x_{r,j}
    more readily when x_{r,j} has a confident continuation: selection bias. The price is optimality only when
    Θ is unimodal along the path (a smoothly falling SPS); ``scheduled-async`` handles jagged curves.

    **The padded step.** Handed a :class:`StepCostProfile` (what ``generate`` and the engine pass), the walk runs
    over verify widths w = 0, 1, .., γ with Θ_w from :func:`padded_width_path` (drafter pass included) and the same
    break; ℓ_r = min(w, max_r). Lossless for the same reason: "w ≥ j" is settled by Θ_0..Θ_j, which read
    a_{·,i ≤ j}, i.e. x_{r,<j} only. ``objective="tokens"`` keeps the paper's own Θ = τ · SPS(Σ_r (1 + ℓ_r)) even
    with a step-cost profile (the cost of a packed, unpadded verify: what a varlen attention back-end pays).

    **Whether to draft at all.** Before drafting, :meth:`wants_drafts` asks whether any width would beat plain
    decoding at the current load, using the drafter's mean survival per position over earlier rounds
    (:class:`DrafterSurvival`; drafts already resolved, so lossless too); when not, the drafter is skipped and
    nothing is verified, with a probe now and then (:class:`ProbeSchedule`) so the estimate follows the traffic.
    The first drafting rounds always draft, until ``min_learning_rows`` drafted rows back the estimate. Rows that
    may commit just one more token can verify no draft, so neither they nor a round of only such rows draft.

    **Online corrections** (not in the paper), each from resolved rounds only, so a'_{r,j} still reads x_{r,<j}
    alone: the drafter's confidences are scaled by what verification realised (:class:`AcceptanceCorrection`,
    ``online_calibration``), and each kind of step's time by what such steps measured against the table
    (:class:`StepTimeCorrection`, which also prices every speculating kind ``speculation_margin`` × its estimate).
    """

    needs_step_cost = True
    supports_lookup = True
    #: drafted rows (summed over drafting rounds) behind the drafter's estimate before it may stop the drafter (the
    #: first rounds always draft): at a load where drafting cannot pay each learning round is a drafter pass and a
    #: wide verify lost, so the estimate is trusted as soon as a few texts back it
    min_learning_rows: int = 4

    def __init__(self, missing_confidence: float | ArrayLike = DEFAULT_MISSING_CONFIDENCE,
                 probe_interval: int = 32, survival_momentum: float = 0.9, online_calibration: bool = True,
                 calibration_decay: float = 0.995, calibration_prior: float = 16.0, objective: str = "padded",
                 probe_backoff: float = 2.0, max_probe_interval: int = 1024, probe_headroom: float = 1.5,
                 speculation_margin: float = 1.05):
        _raise_if_invalid_settings(objective=objective, probe_interval=probe_interval, probe_backoff=probe_backoff,
                                   max_probe_interval=max_probe_interval, probe_headroom=probe_headroom,
                                   speculation_margin=speculation_margin, survival_momentum=survival_momentum,
                                   calibration_decay=calibration_decay, calibration_prior=calibration_prior)
        self.missing_confidence = missing_confidence
        self.objective = objective
        self.acceptance = AcceptanceCorrection(calibration_decay, calibration_prior, enabled=online_calibration)
        self.survival = DrafterSurvival(survival_momentum, min_learning_rows=self.min_learning_rows)
        self.step_time = StepTimeCorrection(survival_momentum, speculation_margin)
        self.probes = ProbeSchedule(probe_interval, probe_backoff, max_probe_interval, probe_headroom)
        self.last_theta: float | None = None  # Θ of the last choice (for logging / benchmarks)
        #: the last priced choice between drafting and not: best Θ with the drafter / best Θ without it (None when
        #: the round did not price it: learning rounds, no drafter, every row on lookup)
        self.last_drafter_gain: float | None = None

    # -- the walk ---------------------------------------------------------------------------------------------
    def choose(self, inputs: PolicyInputs) -> torch.Tensor:
        """ℓ by Algorithm 1. Rows in ``inputs.drafter_rows`` carry the drafter's confidences (online-corrected and
        remembered as the drafter's survival), the others already-calibrated lookup confidences. With
        ``inputs.all_greedy`` the padded walk takes the best width outright (:func:`walk_widths`)."""
        lengths = inputs.lengths()
        num_requests = lengths.size
        conf = fill_confidences(inputs.confidences, lengths, missing=self.missing_confidence)
        rows = (np.ones(num_requests, dtype=bool) if inputs.drafter_rows is None
                else np.asarray(inputs.drafter_rows, dtype=bool))
        if rows.any():
            conf[rows] = self.acceptance.apply(conf[rows])
        survival = prefix_survival(conf)
        if rows.any() and survival.shape[1]:
            self.survival.observe(survival[rows])
        cost = inputs.cost
        if self.objective == "padded" and isinstance(cost, StepCostProfile):
            factors = self._step_factors(cost, drafted=inputs.drafted, sampled=not inputs.all_greedy,
                                         rows=num_requests)
            theta = padded_width_path(survival, cost, drafted=inputs.drafted, step_factors=factors)
            width = walk_widths(theta, all_greedy=inputs.all_greedy)
            self.last_theta = float(theta[width])
            logger.debug("scheduled (padded): R=%d, width %d of %d, Θ=%.3f", num_requests, width, theta.size - 1,
                         self.last_theta)
            return inputs.result(np.minimum(lengths, width))
        chosen, self.last_theta = walk_admissions(survival, cost)
        logger.debug("scheduled: R=%d, admitted %d drafts, Θ=%.3f", num_requests, int(chosen.sum()), self.last_theta)
        return inputs.result(chosen)

    def _step_factors(self, cost: StepCostProfile, *, drafted: bool, sampled: bool, rows: int) -> np.ndarray:
        """The step-time corrections for every width the table covers (:func:`padded_width_path` reads as many
        as the survival it is given is wide)."""
        return self.step_time.factors(cost.max_width - 1, drafted=drafted, sampled=sampled, rows=rows)

    # -- whether the drafter runs -----------------------------------------------------------------------------
    def wants_drafts(self, num_requests: int, cost, *, sampled: bool = False,
                     caps: np.ndarray | None = None) -> bool:
        """Whether drafting this step is expected to beat plain decoding at the current load (see class doc).

        Always True while the drafter's estimate is learning (too little known yet), unless no row may verify a
        draft (``caps`` all 0) or a plain step is due to re-time the step-time reference; after a run of skipped
        steps a probe, where one could find drafting paying."""
        if (caps is not None and not np.any(np.asarray(caps) > 0)) or self.step_time.wants_plain_step():
            return False
        if self.survival.is_learning or not isinstance(cost, StepCostProfile) or num_requests < 1:
            return True
        factors = self._step_factors(cost, drafted=True, sampled=sampled, rows=num_requests)
        plain = num_requests / cost.verify(num_requests, 1)  # the kind every correction is relative to

        def best(survival: np.ndarray) -> float:
            rows = survival_per_row(survival, num_requests, caps)
            return padded_width_path(rows, cost, step_factors=factors)[1:].max(initial=0.0)

        pays = bool(best(self.survival.mean) > plain)
        if not pays and self._probe_due(lambda: best(self.survival.optimistic(self.probes.headroom)) > plain):
            return True
        self.probes.note_decision(pays)
        return pays

    def _probe_due(self, plausible) -> bool:
        return self.probes.due(plausible, evidence_rows=self.survival.rows)

    # -- two proposers: lookup and drafter --------------------------------------------------------------------
    def plan_sources(self, lookup_confidences: np.ndarray, cost, *, drafter_available: bool,
                     wants: np.ndarray | None = None, sampled: bool = False,
                     caps: np.ndarray | None = None) -> tuple[np.ndarray, bool]:
        """Before drafting: which rows take their lookup proposal, and whether the drafter runs at all.

        ``lookup_confidences`` [R, L] calibrated conditional confidences of each row's lookup proposal (0 past its
        end). A row takes its lookup proposal when that is expected to accept more than the drafter has been
        accepting lately (its mean survival per position); the drafter runs when drafting the remaining rows beats
        the best step without the drafter — every row on its lookup proposal, if it has one — both priced by the
        step cost; when it does not run, every row with a lookup proposal takes it.
        Non-anticipating: everything here is known before any draft of this round is sampled.
        ``wants`` [R] bool (optional): rows that may use the drafter at all; ``caps`` [R]: drafts each row may
        still verify (None: no limit)."""
        lookup_survival = prefix_survival(np.clip(np.asarray(lookup_confidences, dtype=np.float64), 0.0, 1.0))
        num_rows = lookup_survival.shape[0]
        expected_lookup = lookup_survival.sum(axis=1) if lookup_survival.size else np.zeros(num_rows)
        drafter_rows = np.ones(num_rows, dtype=bool) if caps is None else np.asarray(caps) > 0
        if wants is not None:
            drafter_rows &= np.asarray(wants, dtype=bool)
        self.last_drafter_gain = None
        if self.step_time.wants_plain_step():
            return np.zeros(num_rows, dtype=bool), False
        if not drafter_available or not drafter_rows.any():
            return expected_lookup > 0, False
        if self.survival.mean is None:  # the drafter's acceptance is unknown: draft, and learn it
            return np.zeros(num_rows, dtype=bool), True
        drafter_survival = survival_per_row(self.survival.mean, num_rows, caps)
        use_lookup = (expected_lookup > drafter_survival.sum(axis=1)) | ~drafter_rows
        if self.survival.is_learning and not use_lookup.all():
            return use_lookup, True  # the estimate rests on too few drafted rows yet: draft, and learn
        if use_lookup.all():
            return use_lookup, False
        if not isinstance(cost, StepCostProfile):
            return use_lookup, True
        pays = self._drafter_pays(lookup_survival, drafter_survival, use_lookup, cost, sampled, caps)
        if pays is None:
            return use_lookup, True  # a probe: refresh the drafter's estimate
        self.probes.note_decision(pays)
        return (use_lookup if pays else expected_lookup > 0), pays

    def _drafter_pays(self, lookup_survival: np.ndarray, drafter_survival: np.ndarray, use_lookup: np.ndarray,
                      cost: StepCostProfile, sampled: bool, caps: np.ndarray | None) -> bool | None:
        """Whether the drafter's rows beat the best step without the drafter (None: not, but a probe is due)."""
        num_rows = use_lookup.size
        # without the drafter every row falls back to its own lookup proposal (if any), not to a plain step: the
        # drafter must beat that (its pass costs time; a row it takes loses the proposal it had)
        without = np.zeros((num_rows, max(lookup_survival.shape[1], drafter_survival.shape[1])))
        without[:, : lookup_survival.shape[1]] = lookup_survival
        path_without = padded_width_path(without, cost, drafted=False, step_factors=self._step_factors(
            cost, drafted=False, sampled=sampled, rows=num_rows))
        best_without = path_without.max(initial=0.0)
        # Against a plain step the drafted step's price already carries the margin; against a lookup step, which
        # carries it too, the drafter must still clear it: its pass and its acceptance are estimates on top of the
        # lookup step's, and taking whichever looks best favours those that look too good
        hurdle = self.step_time.speculation_margin if int(np.argmax(path_without)) > 0 else 1.0
        factors = self._step_factors(cost, drafted=True, sampled=sampled, rows=num_rows)

        def best_with(survival: np.ndarray) -> float:
            with_drafter = without.copy()
            with_drafter[~use_lookup] = 0.0
            with_drafter[~use_lookup, : survival.shape[1]] = survival[~use_lookup]
            return padded_width_path(with_drafter, cost, drafted=True, step_factors=factors).max(initial=0.0)

        gain = best_with(drafter_survival) / best_without  # > 0: at least one row, a finite step time
        self.last_drafter_gain = gain
        pays = bool(gain > hurdle)
        if not pays and self._probe_due(lambda: best_with(survival_per_row(
                self.survival.optimistic(self.probes.headroom), num_rows, caps)) > best_without):
            return None
        return pays

    def refine_sources(self, drafter_confidences: np.ndarray, lookup_confidences: np.ndarray, use_lookup: np.ndarray,
                       switchable: np.ndarray) -> np.ndarray:
        """After drafting: rows in ``switchable`` (greedy rows, where any proposal is verified exactly) take the
        proposal with the larger expected acceptance this round. Sampled rows keep the choice made before their
        drafts were drawn (choosing after would select on the drafts: not lossless)."""
        drafter = prefix_survival(self.acceptance.apply(np.clip(np.asarray(drafter_confidences, np.float64), 0, 1)))
        lookup = prefix_survival(np.clip(np.asarray(lookup_confidences, np.float64), 0, 1))
        better = lookup.sum(axis=1) > drafter.sum(axis=1)
        return np.where(np.asarray(switchable, dtype=bool), better, use_lookup)

    # -- what the round reports back ----------------------------------------------------------------------------
    def observe(self, confidences, lengths, num_accepted) -> None:
        """One step's outcome: ℓ_r verified drafts of which the first ``num_accepted_r`` were accepted; each
        verified, reached draft's raw (STS-calibrated) c_{r,j} is checked against whether it was accepted."""
        if not self.acceptance.enabled or confidences is None:
            return
        lengths, accepted = as_lengths(lengths), as_lengths(num_accepted)
        conf = fill_confidences(confidences, lengths, missing=self.missing_confidence)
        self.acceptance.observe(conf, lengths, accepted)

    def observe_step(self, drafted: bool, predicted_seconds: float, seconds: float, *, sampled: bool = False,
                     wide: bool | None = None, rows: int | None = None) -> None:
        self.step_time.observe(drafted, predicted_seconds, seconds, sampled=sampled, wide=wide, rows=rows)


def _raise_if_invalid_settings(*, objective: str, probe_interval: int, probe_backoff: float, max_probe_interval: int,
                               probe_headroom: float, speculation_margin: float, survival_momentum: float,
                               calibration_decay: float, calibration_prior: float) -> None:
    if objective not in ("padded", "tokens"):
        raise ValueError(f"scheduled: objective must be 'padded' (the engine's padded verify step) or 'tokens' "
                         f"(the paper's Θ = τ · SPS(Σ(1 + ℓ_r))), got {objective!r}")
    if probe_backoff < 1.0 or max_probe_interval < probe_interval:
        raise ValueError(f"scheduled: probe_backoff must be >= 1 and max_probe_interval >= probe_interval, got "
                         f"{probe_backoff}, {max_probe_interval}")
    if not probe_headroom >= 1.0:
        raise ValueError(f"scheduled: probe_headroom must be >= 1 (1: probe only where the drafter's recent "
                         f"acceptance already pays), got {probe_headroom}")
    if not speculation_margin >= 1.0:
        raise ValueError(f"scheduled: speculation_margin must be >= 1 (1: speculate at any expected gain), got "
                         f"{speculation_margin}")
    if probe_interval < 1 or not 0.0 <= survival_momentum < 1.0:
        raise ValueError(f"scheduled: probe_interval must be >= 1 and survival_momentum in [0, 1), got "
                         f"{probe_interval}, {survival_momentum}")
    if not 0.0 < calibration_decay <= 1.0 or calibration_prior < 0:
        raise ValueError(f"scheduled: calibration_decay must be in (0, 1] and calibration_prior >= 0, got "
                         f"{calibration_decay}, {calibration_prior}")


__all__ = ["ScheduledPolicy"]
