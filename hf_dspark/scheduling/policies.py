"""Verify-length policies: how many of each request's drafts the target verifies in one engine step.

Every policy answers one question per step: given R active requests, each with γ drafted tokens and (for DSpark
drafters) the calibrated conditional confidences c_{r,j} = P(draft j accepted | drafts < j accepted), how many
leading drafts ℓ_r ∈ {0..max_r} go into the single batched verify forward? The verify batch then holds
B = Σ_r (1 + ℓ_r) tokens (the 1 is the bonus/recovery slot every request gets).

Policies live in one registry (``register_policy``); the engine looks them up by name with ``make_policy``:

* ``none``             ℓ = 0: plain continuous batching, the baseline.
* ``fixed``            ℓ = min(γ_fixed, max_r).
* ``threshold``        stop at the first draft whose own c_j is below a static threshold (DeepSpec's eval knob).
* ``scheduled``        paper Algorithm 1: load-aware greedy on Θ = τ · SPS(B) with the lossless early-stop break;
                       handed the engine's :class:`StepCostProfile` it runs the same walk on the engine's real
                       step (drafter pass + padded verify) and skips drafting on steps where it cannot pay.
* ``scheduled-async``  paper §5.2: budget K from confidences two steps old (global search), then top-K now.

Losslessness. Speculative sampling recovers the target distribution only if the decision "verify draft j" is
*non-anticipating*: it may depend on everything known before x_{r,j} was sampled, never on x_{r,j} itself.
In DSpark c_{r,j+1} is computed from x_{r,j} (the Markov feature of the previous token), so any policy that
looks at c_{r,j+1} before deciding about x_{r,j} leaks x_{r,j} into its own admission (paper App. A gives a
two-token example where the output becomes (0.85, 0.15) instead of the target's (0.7, 0.3); our tests replay it).
Each policy's docstring says why it does not.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

if TYPE_CHECKING:
    from .step_cost import SPSProfile, StepCostProfile

from .throughput import (  # noqa: F401 (re-exported: the building blocks were public here first)
    DEFAULT_MISSING_CONFIDENCE,
    ArrayLike,
    _as_lengths,
    _as_result,
    _is_step_cost,
    admission_order,
    expected_throughput,
    fill_confidences,
    lengths_from_admissions,
    num_leading_improvements,
    padded_width_path,
    prefix_survival,
    throughput_path,
)

logger = logging.getLogger(__name__)


class VerifyPolicy:
    """What the shared speculative round asks each step; ``generate`` and the engine call the same methods.

    Subclasses implement :meth:`choose`; every other hook has a neutral default, so a policy only overrides what
    it uses (no caller probes for optional methods). ``step`` is the engine step index (only history-keeping
    policies use it)."""

    name: str = ""
    #: True when :meth:`choose` / :meth:`wants_drafts` read the step cost (the engine then measures it).
    needs_step_cost: bool = False
    #: True when the policy speaks the fused round's protocol: it can weigh lookup proposals against the drafter
    #: (``plan_sources`` / ``refine_sources``) and its ``choose`` takes ``drafter_rows``, ``drafted`` and
    #: ``all_greedy``; the round offers lookup proposals (and those hints) only to such policies.
    supports_lookup: bool = False

    def choose(self, confidences: torch.Tensor | np.ndarray | None, max_lengths: ArrayLike, sps: "SPSProfile", *,
               step: int | None = None) -> torch.Tensor:
        """confidences [R, γ] (NaN = unknown) or None; max_lengths [R] drafts available -> ℓ [R] long."""
        raise NotImplementedError

    def max_drafts(self, block_size: int) -> int:
        """Drafts per request per round this policy can ever verify (0: never draft at all)."""
        return block_size

    def draft_threshold(self) -> float:
        """A confidence below which this policy never verifies a draft *or any later one*: the drafter may stop
        drafting a row at its first slot under it (an early exit that saves drafting cost and changes nothing the
        policy would choose). 0 = no such bound."""
        return 0.0

    def wants_drafts(self, num_requests: int, cost: "StepCostProfile | SPSProfile | None", *,
                     sampled: bool = False, caps: np.ndarray | None = None) -> bool:
        """Whether drafting this round can pay at all (False: a plain decoding round, the drafter is skipped);
        ``sampled``: some row of the round samples; ``caps`` [R]: drafts each row may still verify (its token
        budget less the bonus token; None: no limit)."""
        return True

    def observe(self, confidences, lengths, num_accepted) -> None:
        """One round's outcome: ℓ_r verified drafts of which the first ``num_accepted_r`` were accepted."""

    def observe_step(self, drafted: bool, predicted_seconds: float, seconds: float, *, sampled: bool = False,
                     wide: bool | None = None, rows: int | None = None) -> None:
        """A finished round's wall time next to the cost model's prediction (``wide``: it verified drafts;
        ``rows``: how many rows it ran)."""


def _zero_padded(values: np.ndarray, width: int) -> np.ndarray:
    """``values`` [n] extended with zeros to ``width`` (unchanged when already that wide)."""
    return values if values.size >= width else np.concatenate([values, np.zeros(width - values.size)])


_POLICIES: dict[str, Callable[..., VerifyPolicy]] = {}


def register_policy(name: str, *, overwrite: bool = False):
    """Class decorator adding a policy to the registry under ``name`` (validated: unique, has ``choose``)."""

    def decorator(cls):
        if not name or not isinstance(name, str):
            raise ValueError(f"register_policy: name must be a non-empty string, got {name!r}")
        if name in _POLICIES and not overwrite:
            raise ValueError(f"verify policy {name!r} is already registered; pass overwrite=True to replace it")
        if not callable(getattr(cls, "choose", None)):
            raise TypeError(f"register_policy({name!r}): {cls.__name__} has no choose() method")
        if not (isinstance(cls, type) and issubclass(cls, VerifyPolicy)):
            raise TypeError(f"register_policy({name!r}): {cls.__name__} must subclass hf_dspark.serving.VerifyPolicy "
                            "(its hooks have the neutral defaults the round relies on)")
        cls.name = name
        _POLICIES[name] = cls
        return cls

    return decorator


def available_policies() -> list[str]:
    return sorted(_POLICIES)


def make_policy(name: str, **kwargs) -> VerifyPolicy:
    """A fresh policy instance (policies may keep per-engine history, so never share one between engines)."""
    if name not in _POLICIES:
        raise ValueError(f"unknown verify policy {name!r}; choose one of {available_policies()} "
                         f"or add one with hf_dspark.serving.register_policy")
    return _POLICIES[name](**kwargs)


# ---------------------------------------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------------------------------------
@register_policy("none")
class NoSpeculationPolicy(VerifyPolicy):
    """ℓ = 0 for every request: the target decodes one token per request per step (continuous batching)."""

    def max_drafts(self, block_size: int) -> int:
        return 0

    def choose(self, confidences, max_lengths, sps, *, step=None) -> torch.Tensor:
        return _as_result(np.zeros_like(_as_lengths(max_lengths)), max_lengths)


@register_policy("fixed")
class FixedLengthPolicy(VerifyPolicy):
    """ℓ = min(num_tokens, max_r); ``num_tokens=None`` verifies every drafted token. Lossless trivially:
    the length never looks at a draft."""

    def __init__(self, num_tokens: int | None = None):
        if num_tokens is not None and num_tokens < 0:
            raise ValueError(f"fixed policy: num_tokens must be >= 0 or None (all drafts), got {num_tokens}")
        self.num_tokens = num_tokens

    def max_drafts(self, block_size: int) -> int:
        return block_size if self.num_tokens is None else min(block_size, self.num_tokens)

    def choose(self, confidences, max_lengths, sps, *, step=None) -> torch.Tensor:
        lengths = _as_lengths(max_lengths)
        return _as_result(lengths if self.num_tokens is None else np.minimum(lengths, self.num_tokens), max_lengths)


@register_policy("threshold")
class ThresholdPolicy(VerifyPolicy):
    """Verify drafts up to (excluding) the first j whose own conditional c_j < threshold; load-blind.

    Lossless: whether draft j is verified depends on c_1..c_j, and c_j is computed from x_<j only.
    Unknown confidences (NaN) count as ``missing_confidence`` (default 1: no score, no pruning).
    ``num_tokens`` caps the drafts per round (None: the block). This is the one threshold of the library:
    ``generate(dspark_confidence_threshold=...)``, the drafter config's ``confidence_threshold`` and the engine's
    ``threshold`` policy all run it, and the drafter's early exit is only its cost optimisation
    (:meth:`draft_threshold`)."""

    def __init__(self, threshold: float = 0.5, missing_confidence: float = 1.0, num_tokens: int | None = None,
                 max_threshold: float = 1.0):
        if not 0.0 <= threshold <= max_threshold or threshold != threshold:
            raise ValueError(f"threshold policy: threshold must be in [0, {max_threshold:g}], got {threshold}")
        if num_tokens is not None and num_tokens < 0:
            raise ValueError(f"threshold policy: num_tokens must be >= 0 or None (the block), got {num_tokens}")
        self.threshold = threshold
        self.missing_confidence = missing_confidence
        self.num_tokens = num_tokens

    def max_drafts(self, block_size: int) -> int:
        return block_size if self.num_tokens is None else min(block_size, self.num_tokens)

    def draft_threshold(self) -> float:
        return self.threshold

    def choose(self, confidences, max_lengths, sps, *, step=None) -> torch.Tensor:
        lengths = _as_lengths(max_lengths)
        if self.threshold <= 0.0:  # every confidence in [0, 1] passes: ℓ = max_r, nothing to score
            chosen = lengths
        else:
            conf = fill_confidences(confidences, lengths, missing=self.missing_confidence)
            passing = (conf >= self.threshold).astype(np.int64)
            # positions beyond max_r were zeroed by fill_confidences, so they fail (the threshold is > 0)
            chosen = np.minimum(np.cumprod(passing, axis=-1).sum(-1), lengths)
        if self.num_tokens is not None:
            chosen = np.minimum(chosen, self.num_tokens)
        return _as_result(chosen, max_lengths)


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

    **The engine's padded step.** Handed a :class:`StepCostProfile` (what ``DSparkEngine`` passes), the walk
    runs over verify widths w = 0, 1, .., γ with Θ_w from :func:`padded_width_path` (drafter pass included) and
    the same break; ℓ_r = min(w, max_r). Lossless for the same reason: "w ≥ j" is settled by Θ_0..Θ_j, which
    read a_{·,i ≤ j}, i.e. x_{r,<j} only. Before drafting, :meth:`wants_drafts` asks whether any width would beat
    plain decoding at the current load, using the mean survival per position of earlier steps (drafts already
    resolved, so lossless too); when not, the engine skips the drafter for that step and verifies nothing,
    probing again after ``probe_interval`` skipped steps (twice as many after each probe that found drafting still
    not paying: ``probe_backoff``) so the estimate follows the traffic — but, once the
    estimate rests on ``min_probe_evidence`` drafted rows, only at a load where drafting would pay if the
    drafter's conditional acceptance were up to ``probe_headroom`` × the best it has shown: a probe costs a drafter
    pass, and at a load where even a much better drafter could not pay (a busy CPU engine) it can only lose. The
    first drafting rounds always draft, until ``min_learning_rows`` drafted rows (summed over rounds) back the
    estimate (one round of one row is no estimate; one round of 16 rows is as much as 16 rounds of one). Rows that
    may commit just one more token (a budget of 1) can verify no draft, so neither they nor a round of only such
    rows draft. Every kind of step but a plain one is priced
    ``speculation_margin`` (1.05) × its estimated time: the estimates are noisy, and choosing whichever looks best
    favours the ones that happen to look too good (under load, where speculating is worth a few percent at best,
    steps that were expected to gain 3 % lost 4 %); a fixed factor per kind of step keeps the walk lossless.
    ``objective="tokens"`` keeps the paper's own Θ = τ · SPS(Σ_r (1 + ℓ_r)) even with a step-cost profile (the
    cost of a packed, unpadded verify: what a varlen attention back-end pays); the default "padded" prices the
    R × W forward the engine and ``generate`` actually run.

    **Online calibration** (``online_calibration=True``, not in the paper). The engine reports each step's
    outcomes (:meth:`observe`); per position j the policy keeps decayed sums of predicted c_j and realised
    conditional acceptance over the drafts that were verified and reached, and multiplies c_j by their ratio.
    Offline STS fixes the calibration on held-out data; live traffic can differ (our SmolLM2 drafter's
    confidences were fitted where position 1 is accepted 57 % of the time, and real prompts accept ~25 %),
    and an over-confident scheduler verifies more than pays. The factor depends on resolved rounds only, so
    a'_{r,j} still reads x_{r,<j} alone: lossless as above.
    """

    needs_step_cost = True
    #: drafted rows (summed over drafting rounds) behind the drafter's estimate before it may stop the drafter (the
    #: first rounds always draft). Counted in rows, not rounds: one round of 16 rows (16 different texts) is as much
    #: evidence as 16 rounds of one row, and at 16 rows each learning round was a drafter pass and a wide verify at a
    #: load where drafting cannot pay (4 rounds there cost ~1 % of a 16-agent run)
    min_learning_rows: int = 4
    #: drafted rows behind the drafter's estimate before probes are gated by ``probe_headroom``
    min_probe_evidence: int = 16
    #: plain steps timed before κ is trusted (ρ of one step is that step's noise), and the first refresh interval:
    #: after that many timed speculative steps in a row a plain one re-times ρ (the interval doubles per refresh)
    min_plain_steps: int = 3
    #: pseudo-steps at the borrowed ratio that a kind's first steps measuring it cheaper are weighed against
    cheap_evidence_steps: int = 8
    plain_refresh_interval: int = 32
    max_plain_refresh_interval: int = 512

    def __init__(self, missing_confidence: float | ArrayLike = DEFAULT_MISSING_CONFIDENCE,
                 probe_interval: int = 32, survival_momentum: float = 0.9, online_calibration: bool = True,
                 calibration_decay: float = 0.995, calibration_prior: float = 16.0, objective: str = "padded",
                 probe_backoff: float = 2.0, max_probe_interval: int = 1024, probe_headroom: float = 1.5,
                 speculation_margin: float = 1.05):
        if objective not in ("padded", "tokens"):
            raise ValueError(f"scheduled: objective must be 'padded' (the engine's padded verify step) or 'tokens' "
                             f"(the paper's Θ = τ · SPS(Σ(1 + ℓ_r))), got {objective!r}")
        self.objective = objective
        if probe_backoff < 1.0 or max_probe_interval < probe_interval:
            raise ValueError(f"scheduled: probe_backoff must be >= 1 and max_probe_interval >= probe_interval, got "
                             f"{probe_backoff}, {max_probe_interval}")
        # a probe that finds drafting still does not pay makes the next one come later (×probe_backoff, at most
        # max_probe_interval skipped rounds); a round where drafting pays resets the interval. Why 2 by default: at
        # a load where drafting never pays (a 2-core CPU engine at 16 rows) each probe is a drafter pass and a wide
        # verify that lose ~0.4 of a plain step; every 32 steps that is ~1 % of the engine's time for as long as the
        # load lasts, with back-off it fades (32, 64, 128, ... skipped steps)
        self.probe_backoff, self.max_probe_interval = probe_backoff, max_probe_interval
        self._probe_every = probe_interval
        if not probe_headroom >= 1.0:
            raise ValueError(f"scheduled: probe_headroom must be >= 1 (1: probe only where the drafter's recent "
                             f"acceptance already pays), got {probe_headroom}")
        self.probe_headroom = float(probe_headroom)
        if not speculation_margin >= 1.0:
            raise ValueError(f"scheduled: speculation_margin must be >= 1 (1: speculate at any expected gain), got "
                             f"{speculation_margin}")
        self.speculation_margin = float(speculation_margin)
        if probe_interval < 1 or not 0.0 <= survival_momentum < 1.0:
            raise ValueError(f"scheduled: probe_interval must be >= 1 and survival_momentum in [0, 1), got "
                             f"{probe_interval}, {survival_momentum}")
        if not 0.0 < calibration_decay <= 1.0 or calibration_prior < 0:
            raise ValueError(f"scheduled: calibration_decay must be in (0, 1] and calibration_prior >= 0, got "
                             f"{calibration_decay}, {calibration_prior}")
        self.missing_confidence = missing_confidence
        self.probe_interval = probe_interval
        self.survival_momentum = survival_momentum
        self.online_calibration = online_calibration
        self.calibration_decay = calibration_decay
        self.calibration_prior = calibration_prior  # pseudo-drafts at factor 1 (no correction before evidence)
        # Measured step times correct the profile in two factors. ρ[(R, sampled)]: actual / predicted seconds of
        # plain 1-token steps of R rows — the profile's rows were timed at different moments of a shared machine
        # and on another context (one table priced 16-row steps 5 % dear and 9-row ones 40 % cheap), so one
        # factor over all row counts mixed their errors. κ[(wide, drafted, sampled)]: actual / (predicted · ρ) of
        # every other kind of step, relative to a plain step of its own row count: the profile times greedy
        # forwards on a clean cache, while a sampled round draws and rejection-samples its drafts and a wide
        # verify attends over holes (in the engine ~1.2-1.35× its prediction when plain steps ran ~1.1×). Every
        # choice compares kinds of step at one row count, where ρ cancels and κ decides.
        self._plain_ratio: dict[tuple[int, bool], float] = {}
        self._plain_count: dict[tuple[int, bool], int] = {}
        self._time_ratio: dict[tuple[bool, bool, bool, int], float] = {}  # (wide, drafted, sampled, rows) -> κ·ρ
        self._time_count: dict[tuple[bool, bool, bool, int], int] = {}
        self._since_plain = 0  # timed steps since the last plain one
        self._plain_refresh_every = self.plain_refresh_interval
        self._predicted: np.ndarray | None = None  # decayed Σ c_j over verified, reached drafts, per j
        self._realised: np.ndarray | None = None  # decayed count of those that were accepted
        self._reached: np.ndarray | None = None  # decayed count of those drafts
        self.last_theta: float | None = None  # Θ of the last choice (for logging / benchmarks)
        #: the last priced choice between drafting and not: best Θ with the drafter / best Θ without it (None when
        #: the round did not price it: learning rounds, no drafter, every row on lookup)
        self.last_drafter_gain: float | None = None
        self.mean_survival: np.ndarray | None = None  # running mean over steps of Σ_r a_{r,j} / R, per j
        self._survival_rounds = 0  # drafting rounds behind mean_survival
        self._survival_rows = 0  # drafted rows behind it, summed over those rounds
        self._best_survival: np.ndarray | None = None  # the highest mean survival after the learning rounds
        self._skipped_in_a_row = 0

    supports_lookup = True

    def choose(self, confidences, max_lengths, sps, *, step=None, drafter_rows=None,
               drafted: bool = True, all_greedy: bool = False) -> torch.Tensor:
        """``drafter_rows`` [R] bool: rows whose confidences come from the drafter (online-corrected and
        remembered as the drafter's survival); other rows carry already-calibrated lookup confidences.
        ``drafted``: the drafter ran this round (its cost is part of every width's step time). ``all_greedy``:
        no row samples, so any width is verified exactly and the padded walk takes the best width outright
        instead of stopping at the first one that does not improve Θ (the break is what keeps *sampling*
        lossless; on a CPU the cost of 2-3 verified tokens is a dip the break would never get past)."""
        lengths = _as_lengths(max_lengths)
        num_requests = lengths.size
        conf = fill_confidences(confidences, lengths, missing=self.missing_confidence)
        rows = np.ones(num_requests, dtype=bool) if drafter_rows is None else np.asarray(drafter_rows, dtype=bool)
        if rows.any():
            conf[rows] = self.calibrated(conf[rows])
        survival = prefix_survival(conf)
        if rows.any() and survival.shape[1]:
            self._remember(survival[rows])
        if self.objective == "padded" and _is_step_cost(sps):
            return _as_result(self._choose_width(survival, lengths, sps, drafted, all_greedy), max_lengths)
        rows, _, values = admission_order(survival)
        theta = throughput_path(values, num_requests, sps)
        num_admitted = num_leading_improvements(theta)
        self.last_theta = float(theta[num_admitted])
        logger.debug("scheduled: R=%d, admitted %d of %d candidates, Θ=%.3f", num_requests, num_admitted,
                     values.size, self.last_theta)
        return _as_result(lengths_from_admissions(rows, num_admitted, num_requests), max_lengths)

    def _choose_width(self, survival: np.ndarray, lengths: np.ndarray, cost: "StepCostProfile",
                      drafted: bool = True, all_greedy: bool = False) -> np.ndarray:
        gamma = min(survival.shape[1], cost.max_width - 1)
        factors = self.step_time_factors(gamma, drafted=drafted, sampled=not all_greedy, rows=lengths.size)
        theta = padded_width_path(survival[:, :gamma], cost, drafted=drafted, step_factors=factors)
        width = int(np.argmax(theta)) if all_greedy else num_leading_improvements(theta)
        self.last_theta = float(theta[width])
        logger.debug("scheduled (padded): R=%d, width %d of %d, Θ=%.3f", lengths.size, width, gamma,
                     self.last_theta)
        return np.minimum(lengths, width)

    # -- two proposers: lookup and drafter -------------------------------------------------------------------
    def plan_sources(self, lookup_confidences: np.ndarray, cost, *, drafter_available: bool,
                     wants: np.ndarray | None = None, sampled: bool = False,
                     caps: np.ndarray | None = None) -> tuple[np.ndarray, bool]:
        """Before drafting: which rows take their lookup proposal, and whether the drafter runs at all.

        ``lookup_confidences`` [R, L] calibrated conditional confidences of each row's lookup proposal (0 past its
        end). A row takes its lookup proposal when that is expected to accept more than the drafter has been
        accepting lately (its mean survival per position); the drafter runs when drafting the remaining rows beats
        the best step without the drafter — every row on its lookup proposal, if it has one — both priced by the
        step cost, by ``speculation_margin`` more than that step where it is itself a lookup step (see the
        comment below); when it does not run, every row with a lookup proposal takes it.
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
        if self._wants_plain_step():
            return np.zeros(num_rows, dtype=bool), False
        if not drafter_available or not drafter_rows.any():
            return expected_lookup > 0, False
        if self.mean_survival is None:  # the drafter's acceptance is unknown: draft, and learn it
            return np.zeros(num_rows, dtype=bool), True
        drafter_survival = self._row_survival(self.mean_survival, num_rows, caps)
        use_lookup = (expected_lookup > drafter_survival.sum(axis=1)) | ~drafter_rows
        if self._survival_rows < self.min_learning_rows and not use_lookup.all():
            return use_lookup, True  # the estimate rests on too few drafted rows yet: draft, and learn
        if use_lookup.all():
            return use_lookup, False
        if not _is_step_cost(cost):
            return use_lookup, True
        # without the drafter every row falls back to its own lookup proposal (if any), not to a plain step: the
        # drafter must beat that (its pass costs time; a row it takes loses the proposal it had)
        width = max(lookup_survival.shape[1], drafter_survival.shape[1])
        without = np.zeros((num_rows, width))
        without[:, : lookup_survival.shape[1]] = lookup_survival
        gamma = min(width, cost.max_width - 1)
        path_without = padded_width_path(without[:, :gamma], cost, drafted=False, step_factors=self.step_time_factors(
            gamma, drafted=False, sampled=sampled, rows=num_rows))
        best_without = path_without.max(initial=0.0)
        # Against a plain step the drafted step's price already carries the margin; against a lookup step, which
        # carries it too, the drafter must still clear it: its pass and its acceptance are estimates on top of the
        # lookup step's, and taking whichever looks best favours those that look too good (a 4-row agent trace: 22
        # of 26 drafted steps were bets priced 1.00-1.10× the lookup step they joined; they ran 83 tok/s, lookup
        # steps 131)
        hurdle = self.speculation_margin if int(np.argmax(path_without)) > 0 else 1.0

        def best_with(survival: np.ndarray) -> float:
            with_drafter = without.copy()
            with_drafter[~use_lookup] = 0.0
            with_drafter[~use_lookup, : survival.shape[1]] = survival[~use_lookup]
            factors = self.step_time_factors(gamma, drafted=True, sampled=sampled, rows=num_rows)
            return padded_width_path(with_drafter[:, :gamma], cost, drafted=True, step_factors=factors).max(initial=0.0)

        gain = best_with(drafter_survival) / best_without  # > 0: at least one row, a finite step time
        self.last_drafter_gain = gain
        pays = bool(gain > hurdle)
        if not pays and self._probe_due(lambda: best_with(self._row_survival(
                self._optimistic_survival(), num_rows, caps)) > best_without):
            return use_lookup, True  # a probe: refresh the drafter's estimate
        self._note_decision(pays)
        return (use_lookup if pays else expected_lookup > 0), pays

    @staticmethod
    def _row_survival(survival: np.ndarray, num_rows: int, caps: np.ndarray | None) -> np.ndarray:
        """[R, γ] per-row survival: the mean survival, zero past each row's cap."""
        rows = np.tile(survival, (num_rows, 1))
        if caps is not None:
            rows[np.arange(survival.size)[None, :] >= np.asarray(caps)[:, None]] = 0.0
        return rows

    def _optimistic_survival(self) -> np.ndarray:
        """The drafter's best mean survival so far (the text may turn back to what it drafts well) with every
        conditional acceptance ``probe_headroom`` × higher (≤ 1): what a probe could plausibly find."""
        survival = self.mean_survival  # the best is kept as wide as the mean (``_remember``)
        if self._best_survival is not None:
            survival = np.maximum(survival, self._best_survival)
        previous = np.concatenate([[1.0], survival[:-1]])
        conditional = np.divide(survival, previous, out=np.zeros_like(survival), where=previous > 0)
        return np.cumprod(np.minimum(1.0, conditional * self.probe_headroom))

    def _probe_due(self, plausible: Callable[[], bool] | None = None) -> bool:
        """After ``_probe_every`` skipped rounds: draft once to re-measure (and back the next probe off) — if
        ``plausible()`` says a probe could find drafting paying at this load; else the probe waits for one. The
        drafter's estimate is trusted that far only once ``min_probe_evidence`` drafted rows made it (one
        round's confidences on one row are no basis for never drafting again)."""
        if self._skipped_in_a_row < self._probe_every:
            return False
        if plausible is not None and self._survival_rows >= self.min_probe_evidence and not plausible():
            return False
        self._skipped_in_a_row = 0
        self._probe_every = min(self.max_probe_interval, round(self._probe_every * self.probe_backoff))
        return True

    def _note_decision(self, pays: bool) -> None:
        self._skipped_in_a_row = 0 if pays else self._skipped_in_a_row + 1
        if pays:
            self._probe_every = self.probe_interval

    def refine_sources(self, drafter_confidences: np.ndarray, lookup_confidences: np.ndarray, use_lookup: np.ndarray,
                       switchable: np.ndarray) -> np.ndarray:
        """After drafting: rows in ``switchable`` (greedy rows, where any proposal is verified exactly) take the
        proposal with the larger expected acceptance this round. Sampled rows keep the choice made before their
        drafts were drawn (choosing after would select on the drafts: not lossless)."""
        drafter = prefix_survival(self.calibrated(np.clip(np.asarray(drafter_confidences, np.float64), 0, 1)))
        lookup = prefix_survival(np.clip(np.asarray(lookup_confidences, np.float64), 0, 1))
        better = lookup.sum(axis=1) > drafter.sum(axis=1)
        return np.where(np.asarray(switchable, dtype=bool), better, use_lookup)

    def calibration_factors(self, gamma: int) -> np.ndarray:
        """Per-position multiplier of the confidences: (realised + prior) / (predicted + prior), the prior being
        ``calibration_prior`` drafts at the mean predicted confidence (pseudo-drafts at factor 1); 1 without data.

        The prior is counted in drafts, not in predicted mass: as mass, 16 units of confidence outweighed ~80 drafts
        of a head predicting 0.2, so a drafter accepting 36 % at position 1 while its head said 0.2 stayed priced at
        0.2 for hundreds of verified drafts (and was rarely verified, so never corrected)."""
        factors = np.ones(gamma)
        if self.online_calibration and self._predicted is not None:
            n = min(gamma, self._predicted.size)  # positions never observed keep factor 1
            mean_prediction = np.divide(self._predicted[:n], self._reached[:n], out=np.ones(n),
                                        where=self._reached[:n] > 0)
            prior = self.calibration_prior * mean_prediction
            factors[:n] = (self._realised[:n] + prior) / (self._predicted[:n] + prior)
        return factors

    def calibrated(self, conf: np.ndarray) -> np.ndarray:
        if not self.online_calibration or self._predicted is None or conf.shape[1] == 0:
            return conf
        return np.clip(conf * self.calibration_factors(conf.shape[1])[None, :], 0.0, 1.0)

    def observe(self, confidences, lengths, num_accepted) -> None:
        """One step's outcome: ℓ_r verified drafts of which the first ``num_accepted_r`` were accepted.

        Draft j of request r counts when it was verified (ℓ_r ≥ j) and reached (drafts < j accepted); its
        prediction is the raw (STS-calibrated) c_{r,j}, its outcome whether it was accepted."""
        if not self.online_calibration or confidences is None:
            return
        lengths, accepted = _as_lengths(lengths), _as_lengths(num_accepted)
        conf = fill_confidences(confidences, lengths, missing=self.missing_confidence)
        gamma = conf.shape[1]
        positions = np.arange(1, gamma + 1)[None, :]
        reached = (positions <= lengths[:, None]) & (positions <= accepted[:, None] + 1)
        predicted = (conf * reached).sum(axis=0)
        realised = (reached & (positions <= accepted[:, None])).sum(axis=0).astype(np.float64)
        if self._predicted is None or self._predicted.size != gamma:
            self._predicted, self._realised, self._reached = np.zeros(gamma), np.zeros(gamma), np.zeros(gamma)
        decay = self.calibration_decay
        self._predicted = decay * self._predicted + predicted
        self._realised = decay * self._realised + realised
        self._reached = decay * self._reached + reached.sum(axis=0)

    def _remember(self, survival: np.ndarray) -> None:
        """The drafter's mean survival per position: a plain mean over the drafted rows of its first drafting rounds
        (one round of one row is a noisy estimate to start from), a decayed mean once a round weighs less than
        1 − momentum of it (after 1/(1 − momentum) rounds of equal size)."""
        mean, rows = survival.mean(axis=0), survival.shape[0]
        if self.mean_survival is None:
            self.mean_survival, self._survival_rounds, self._best_survival = mean, 1, None
            self._survival_rows = rows
            self._note_best(mean.size)
            return
        # a round's width is that of its widest proposal (a long lookup proposal in the batch widens the drafter's
        # rows with zeros): the drafter's survival is zero past its block, so widths align by zero padding (a
        # width change once restarted the estimate, and with lookup in the batch it never left its learning rounds)
        width = max(mean.size, self.mean_survival.size)
        mean = _zero_padded(mean, width)
        self._survival_rounds += 1
        self._survival_rows += rows
        weight = max(rows / self._survival_rows, 1.0 - self.survival_momentum)
        self.mean_survival = (1.0 - weight) * _zero_padded(self.mean_survival, width) + weight * mean
        self._note_best(width)

    def _note_best(self, width: int) -> None:
        """Past the learning rounds, the best mean survival the drafter has shown (what probes aim at)."""
        if self._survival_rows >= self.min_learning_rows:
            best = self._best_survival
            self._best_survival = (self.mean_survival.copy() if best is None
                                   else np.maximum(_zero_padded(best, width), self.mean_survival))

    def observe_step(self, drafted: bool, predicted_seconds: float, seconds: float, *, sampled: bool = False,
                     wide: bool | None = None, rows: int | None = None) -> None:
        """A finished decode step: its wall time against the profile's prediction (drafter pass + verify).
        ``wide``: it verified drafts (width > 1), None reads a drafted step as wide and a plain one as not;
        ``rows``: its row count (None: one correction for every row count)."""
        if not (predicted_seconds > 0 and seconds > 0):
            return
        ratio = min(max(seconds / predicted_seconds, 0.25), 4.0)  # one hiccup must not swing the decision
        wide = bool(drafted) if wide is None else bool(wide)
        momentum = self.survival_momentum
        key_rows = (int(rows) if rows else 0, bool(sampled))
        if not wide and not drafted:  # a plain step: the row count's own correction
            if self._since_plain >= self._plain_refresh_every:  # a refresh: the next one comes later
                self._plain_refresh_every = min(self.max_plain_refresh_interval, 2 * self._plain_refresh_every)
            self._since_plain = 0
            # the mean of the first 1/(1 - momentum) steps, a decayed mean after: plain steps are frequent, and a
            # slowly settling ρ would bias every κ learned against it meanwhile
            count = self._plain_count.get(key_rows, 0) + 1
            self._plain_count[key_rows] = count
            weight = max(1.0 / count, 1.0 - momentum)
            previous = self._plain_ratio.get(key_rows, ratio)
            self._plain_ratio[key_rows] = (1.0 - weight) * previous + weight * ratio
            return
        kind = (wide, bool(drafted), bool(sampled))
        self._since_plain += 1
        if not self._plain_count:
            # no plain step timed yet: what this step says about the machine goes to ρ (its kind taken at its
            # current κ), which a real plain step then replaces — and the next step is a plain one
            # (:meth:`_wants_plain_step`); learning κ against an unknown ρ would price the kind by the machine's
            # speed at the moment, relative to a plain step priced as profiled
            self._plain_ratio[key_rows] = ratio / self.step_time_ratio(wide=wide, drafted=drafted, sampled=sampled,
                                                                       rows=key_rows[0])
            return
        # The kind keeps its own measured / predicted ratio (α), and κ = α / ρ is formed when it is used: a κ learned
        # as a ratio to the ρ of its moment kept that moment's ρ — three slow plain steps early on (ρ 1.31 where
        # later ones ran 1.1) priced drafting at 0.86× a plain step for the rest of the run.
        # α is the mean of the ratio the kind borrowed so far and its steps, a decayed mean once there are
        # 1/(1 - momentum) of them. The borrowed ratio counts as one step against a step that says the kind is
        # dearer (one slow first step must not set it outright, but a kind that settles slowly keeps losing while
        # it does) and as ``cheap_evidence_steps`` against one that says it is cheaper: a cheap-looking kind is
        # chosen at once, and choosing on a few noisy steps favours the kinds that happened to look too cheap (four
        # drafted steps at 16 rows measured 0.8× a plain step, where they cost 1.0×, and the engine drafted at a
        # load where drafting lost 6 %).
        key = kind + (key_rows[0],)
        count = self._time_count.get(key, 0) + 1
        self._time_count[key] = count
        previous = self._time_ratio.get(key)
        if previous is None:  # what the kind borrowed so far, in absolute terms
            previous = (self.step_time_ratio(wide=wide, drafted=drafted, sampled=sampled, rows=key_rows[0])
                        * self._nearest_plain_ratio(*key_rows))
        prior = self.cheap_evidence_steps if ratio < previous else 1
        weight = max(1.0 / (count + prior), 1.0 - momentum)
        self._time_ratio[key] = (1.0 - weight) * previous + weight * ratio

    def _wants_plain_step(self) -> bool:
        """Steps are being timed but fewer than ``min_plain_steps`` plain ones, or none for the last
        ``_plain_refresh_every`` steps: take one, the reference every kind is corrected by. Why: a policy that
        keeps speculating never re-times ρ, and every κ is learned relative to it — one slow first plain step at 16
        rows (ρ 1.65 where plain steps ran ~1.3×) priced drafted steps at 0.72× a plain one, and the engine drafted
        every step at a load where drafting lost."""
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

    def step_time_ratio(self, *, wide: bool, drafted: bool, sampled: bool = False, rows: int | None = None) -> float:
        """Measured seconds of one kind of step of ``rows`` rows / (the profile's prediction × ρ of its row count):
        1 for a plain step, the kind every other is compared with. Kept per row count (how much dearer a wide step
        is than a plain one grows with the rows: attention over more padded slots, more logits to verify); a row
        count not seen yet borrows the kind's nearest one, a kind not seen yet the nearest kind that was (same
        width class first: a wide lookup round before any was timed is priced like a drafted one), else 1."""
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

    def step_time_factors(self, gamma: int, *, drafted: bool, sampled: bool = False,
                          rows: int | None = None) -> np.ndarray:
        """[γ + 1] corrections of the profile's step time per verify width w = 0..γ (w = 0: nothing verified), for
        a step of ``rows`` rows."""
        factors = np.full(gamma + 1, self.step_time_ratio(wide=True, drafted=drafted, sampled=sampled, rows=rows))
        factors[0] = self.step_time_ratio(wide=False, drafted=drafted, sampled=sampled, rows=rows)
        factors[0 if drafted else 1:] *= self.speculation_margin  # every kind of step but a plain one
        return factors

    @property
    def plain_step_ratios(self) -> dict[str, float]:
        """ρ: measured / predicted seconds of plain steps, by row count (and sampling mode)."""
        return {f"{rows} rows" + (", sampled" if sampled else ""): ratio
                for (rows, sampled), ratio in sorted(self._plain_ratio.items())}

    @property
    def step_time_ratios(self) -> dict[str, float]:
        """The corrections in use, by kind of step, each relative to a plain step of the same row count ("plain":
        nothing drafted or verified, 1 by definition; "lookup": lookup drafts verified without a drafter pass;
        "drafted": a drafter pass and its drafts verified)."""
        return self.step_time_ratios_at(None)

    def step_time_ratios_at(self, rows: int | None) -> dict[str, float]:
        """:attr:`step_time_ratios` for steps of ``rows`` rows (None: the fewest rows timed)."""
        out = {}
        for sampled in (False, True):
            tail = ", sampled" if sampled else ""
            for name, wide, drafted in (("plain", False, False), ("lookup", True, False), ("drafted", True, True),
                                        ("drafted, nothing verified", False, True)):
                out[name + tail] = self.step_time_ratio(wide=wide, drafted=drafted, sampled=sampled, rows=rows)
        return out

    def wants_drafts(self, num_requests: int, cost: "StepCostProfile", *, sampled: bool = False,
                     caps: np.ndarray | None = None) -> bool:
        """Whether drafting this step is expected to beat plain decoding at the current load (see class doc).

        Always True until ``min_learning_rows`` drafted rows back the estimate (too little known yet), unless no row may
        verify a draft (``caps`` all 0); after a run of skipped steps a probe, where one could find drafting
        paying."""
        if (caps is not None and not np.any(np.asarray(caps) > 0)) or self._wants_plain_step():
            return False
        if (self.mean_survival is None or self._survival_rows < self.min_learning_rows
                or not _is_step_cost(cost) or num_requests < 1):
            return True
        gamma = min(self.mean_survival.size, cost.max_width - 1)
        factors = self.step_time_factors(gamma, drafted=True, sampled=sampled, rows=num_requests)
        plain = num_requests / cost.verify(num_requests, 1)  # the kind every correction is relative to

        def best(survival: np.ndarray) -> float:
            rows = self._row_survival(survival, num_requests, caps)[:, :gamma]
            return padded_width_path(rows, cost, step_factors=factors)[1:].max(initial=0.0)

        pays = bool(best(self.mean_survival) > plain)
        if not pays and self._probe_due(lambda: best(self._optimistic_survival()) > plain):
            return True
        self._note_decision(pays)
        return pays


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
    The history is keyed by ``step`` (the engine's step index; an internal counter when omitted).
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

    def budget(self, old_values: ArrayLike, num_requests: int, sps: "SPSProfile") -> int:
        """Global argmax of Θ over the stale candidate pool (smallest K on ties)."""
        return int(np.argmax(throughput_path(old_values, num_requests, sps)))  # argmax: first maximum

    def choose(self, confidences, max_lengths, sps, *, step=None) -> torch.Tensor:
        lengths = _as_lengths(max_lengths)
        step = self._next_step if step is None else int(step)
        self._next_step = step + 1
        old_values = self._history.get(step - self.delay)
        survival = prefix_survival(fill_confidences(confidences, lengths, missing=self.missing_confidence))
        rows, _, values = admission_order(survival)
        self._history[step] = values
        for key in [k for k in self._history if k <= step - self.delay]:
            del self._history[key]
        if old_values is None:
            chosen = self._fallback.choose(confidences, lengths, sps).numpy()
            self.last_budget = int(chosen.sum())
        else:
            self.last_budget = self.budget(old_values, lengths.size, sps)
            chosen = lengths_from_admissions(rows, min(self.last_budget, rows.size), lengths.size)
        return _as_result(chosen, max_lengths)


__all__ = [
    "AsyncScheduledPolicy",
    "FixedLengthPolicy",
    "NoSpeculationPolicy",
    "ScheduledPolicy",
    "ThresholdPolicy",
    "VerifyPolicy",
    "admission_order",
    "available_policies",
    "expected_throughput",
    "fill_confidences",
    "lengths_from_admissions",
    "make_policy",
    "num_leading_improvements",
    "padded_width_path",
    "prefix_survival",
    "register_policy",
    "throughput_path",
]
