"""Sequential Temperature Scaling (STS) of the confidence head, plus the calibration metrics (ECE, AUC).

The confidence head predicts *conditional* survival c_k = σ(z_k) = P(draft k accepted | drafts < k accepted),
but the scheduler needs the *joint* a_k = Π_{i≤k} c_i in absolute terms, and a raw head trained with BCE on
soft targets is over-confident (paper: ECE 3–8 %). STS (paper §3.2.1) fixes the joint, left to right: for
k = 1..γ, grid-search one temperature T_k so that the 20-bin ECE of Π_{i≤k} σ(z_i/T_i) against the realised
label 1[drafts 1..k all accepted] is minimal, with T_<k already fixed. Dividing a logit by T > 0 keeps its order,
so position 1's AUC is unchanged exactly (later positions mix several rescaled logits, so theirs can move a bit).

Data is one row per held-out decoding round (real rejection sampling at the serving temperature):
``conf_logits`` [N, γ] raw z_k, ``accepted_prefix_len`` [N] leading drafts accepted, ``num_proposed`` [N] how
many drafts that round actually offered (position k only counts in rounds with num_proposed ≥ k).
Temperatures go into ``DSparkConfig.confidence_temperatures``; the drafter then reports σ(z_k / T_k).

**Offsets (an extension, not in the paper).** A temperature can only stretch the logits around 0: when the head's
logits sit on one side of 0 (a small drafter whose acceptance at serving time is well below what training saw),
no T moves the mean confidence to the realised rate and the ECE stays high. :func:`fit_sts_with_offsets` searches (T_k, b_k) jointly for c_k = σ(z_k / T_k + b_k), still left to
right on the joint survival. It is still order-preserving (T > 0), offset 0 is on the grid, and ties prefer
the smallest |b|, so it never does worse in-sample than temperatures alone. Offsets go into
``DSparkConfig.confidence_offsets``.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)

DEFAULT_BINS = 20  # what DeepSpec's recorder and the paper's reliability diagrams use
#: A position is fitted only when its rounds hold at least this many accepted *and* rejected drafts; below that
#: every (T, b) reaches ECE ≈ 0 and the argmin is noise (a late position of a weak drafter: 0.1 % accepted fitted
#: T = 0.1, b = +2.2, turning its conditional confidence into a near-step function). It keeps T = 1, b = 0.
MIN_FIT_EVENTS = 20


def default_temperature_grid(num: int = 200) -> np.ndarray:
    """T ∈ logspace(−1, 1): 0.1 (sharpen) .. 10 (soften); 1 is on the grid (odd count) so 'no change' is an option."""
    grid = np.logspace(-1.0, 1.0, num if num % 2 else num + 1)
    return grid


def default_offset_grid(num: int = 81, limit: float = 4.0) -> np.ndarray:
    """b ∈ [−limit, limit] in equal steps (odd count, so 0 = 'no offset' is on the grid)."""
    return np.linspace(-limit, limit, num if num % 2 else num + 1)


# ---------------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------------
@dataclass
class ReliabilityCurve:
    """Per equal-width bin: mean predicted probability, observed frequency and count (NaN where empty)."""

    bin_edges: list[float]
    mean_predicted: list[float]
    observed_rate: list[float]
    counts: list[int]

    @property
    def num_samples(self) -> int:
        return int(sum(self.counts))


def _as_array(x, dtype=np.float64) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype).reshape(-1)


def _bin_index(predictions: np.ndarray, bins: int) -> np.ndarray:
    # p = 1.0 belongs to the last bin (intervals [i/bins, (i+1)/bins), the last one closed).
    return np.minimum((predictions * bins).astype(np.int64), bins - 1)


def reliability_curve(predictions, labels, bins: int = DEFAULT_BINS) -> ReliabilityCurve:
    """Reliability diagram data for predicted probabilities vs binary outcomes (paper Fig. 6)."""
    predictions, labels = _checked_pair(predictions, labels)
    index = _bin_index(predictions, bins)
    counts = np.bincount(index, minlength=bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_pred = np.bincount(index, weights=predictions, minlength=bins) / counts
        observed = np.bincount(index, weights=labels, minlength=bins) / counts
    return ReliabilityCurve(np.linspace(0.0, 1.0, bins + 1).tolist(), mean_pred.tolist(), observed.tolist(),
                            counts.tolist())


def expected_calibration_error(predictions, labels, bins: int = DEFAULT_BINS) -> float:
    """ECE = Σ_b (n_b / N) · |mean prediction_b − frequency_b| over equal-width bins (Naeini et al., 2015)."""
    predictions, labels = _checked_pair(predictions, labels)
    if predictions.size == 0:
        return float("nan")
    index = _bin_index(predictions, bins)
    gap = np.bincount(index, weights=predictions, minlength=bins) - np.bincount(index, weights=labels,
                                                                                  minlength=bins)
    return float(np.abs(gap).sum() / predictions.size)


def ece_noise_floor(predictions, bins: int = DEFAULT_BINS, draws: int = 200, seed: int = 0) -> float:
    """The ECE a *perfectly calibrated* predictor would show on these rounds: the mean binned ECE over ``draws``
    label sets drawn as y ~ Bernoulli(p) from the predictions themselves.

    Why: the binned ECE is biased upwards by sampling noise (a bin with n rounds at rate p misses by about
    sqrt(p(1-p)/n) even when p is exact), so on a few thousand rounds a well-calibrated head cannot score 0 %;
    an ECE near this floor means the remaining error is noise, not miscalibration. Deterministic for a seed."""
    predictions = _as_array(predictions)
    if predictions.size == 0:
        return float("nan")
    if predictions.min() < 0 or predictions.max() > 1:
        raise ValueError("predictions must be probabilities in [0, 1]")
    rng = np.random.default_rng(seed)
    draws_ece = [expected_calibration_error(predictions, rng.random(predictions.size) < predictions, bins)
                 for _ in range(draws)]
    return float(np.mean(draws_ece))


def auc(scores, labels) -> float:
    """Exact ROC AUC via ranks (Mann–Whitney U, ties counted half). NaN when one class is absent."""
    scores, labels = _checked_pair(scores, labels, check_range=False)
    num_pos = int(labels.sum())
    num_neg = labels.size - num_pos
    if num_pos == 0 or num_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    # tied scores share the average of the 1-based ranks they span
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], sorted_scores.size]
    group_rank = (starts + ends + 1) / 2.0
    ranks = np.empty_like(scores)
    ranks[order] = np.repeat(group_rank, ends - starts)
    return float((ranks[labels == 1].sum() - num_pos * (num_pos + 1) / 2.0) / (num_pos * num_neg))


def _checked_pair(predictions, labels, check_range: bool = True) -> tuple[np.ndarray, np.ndarray]:
    predictions, labels = _as_array(predictions), _as_array(labels)
    if predictions.shape != labels.shape:
        raise ValueError(f"predictions and labels must have the same length, got {predictions.size} and "
                         f"{labels.size}")
    if check_range and predictions.size and (predictions.min() < 0 or predictions.max() > 1):
        raise ValueError("predictions must be probabilities in [0, 1]")
    if labels.size and not np.isin(labels, (0.0, 1.0)).all():
        raise ValueError("labels must be 0/1")
    return predictions, labels


# ---------------------------------------------------------------------------------------------------------
# Rounds -> per-position predictions and labels
# ---------------------------------------------------------------------------------------------------------
def _checked_rounds(conf_logits, accepted_prefix_len, num_proposed):
    logits = conf_logits.detach().cpu().double().numpy() if isinstance(conf_logits, torch.Tensor) \
        else np.asarray(conf_logits, dtype=np.float64)
    if logits.ndim != 2:
        raise ValueError(f"conf_logits must be [rounds, γ], got shape {logits.shape}")
    accepted = _as_array(accepted_prefix_len, np.int64)
    gamma = logits.shape[1]
    proposed = np.full_like(accepted, gamma) if num_proposed is None else _as_array(num_proposed, np.int64)
    if not accepted.size == proposed.size == logits.shape[0]:
        raise ValueError(f"conf_logits ({logits.shape[0]} rounds), accepted_prefix_len ({accepted.size}) and "
                         f"num_proposed ({proposed.size}) must describe the same rounds")
    if (proposed < 0).any() or (proposed > gamma).any():
        raise ValueError(f"num_proposed must lie in [0, γ={gamma}]")
    if (accepted < 0).any() or (accepted > proposed).any():
        raise ValueError("accepted_prefix_len must lie in [0, num_proposed] for every round")
    return logits, accepted, proposed


def calibrated_confidence(conf_logits, temperatures=None, offsets=None) -> np.ndarray:
    """c_k = σ(z_k / T_k + b_k) for every round: [N, γ] (T = 1 / b = 0 where None) — the numpy twin of
    ``DSparkDraftModel.confidence_from_logits`` for recorded rounds."""
    logits = np.asarray(conf_logits.detach().cpu().double() if isinstance(conf_logits, torch.Tensor)
                        else conf_logits, dtype=np.float64)
    gamma = logits.shape[1]
    temps = np.ones(gamma) if temperatures is None else _per_position(temperatures, gamma, "temperatures")
    shift = np.zeros(gamma) if offsets is None else _per_position(offsets, gamma, "offsets")
    return _sigmoid(logits / temps + shift)


def _per_position(values, gamma: int, name: str) -> np.ndarray:
    """The first γ entries of a fit; a shorter fit is refused (numpy would broadcast a single value to every
    position, scoring the rounds with a fit made for another block size)."""
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    if len(values) < gamma:
        raise ValueError(f"{len(values)} calibration {name} for rounds of {gamma} positions: give one per position")
    return values[:gamma]


def cumulative_confidence(conf_logits, temperatures=None, offsets=None) -> np.ndarray:
    """a_k = Π_{i≤k} σ(z_i / T_i + b_i) for every round: [N, γ] (T = 1 / b = 0 where None)."""
    return np.cumprod(calibrated_confidence(conf_logits, temperatures, offsets), axis=1)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free σ


def prefix_labels(accepted_prefix_len, num_proposed, gamma: int) -> tuple[np.ndarray, np.ndarray]:
    """(labels, valid), both [N, γ] bool: label_k = drafts 1..k all accepted; valid_k = position k was proposed."""
    positions = np.arange(1, gamma + 1)[None, :]
    accepted = _as_array(accepted_prefix_len, np.int64)[:, None]
    return accepted >= positions, _as_array(num_proposed, np.int64)[:, None] >= positions


# ---------------------------------------------------------------------------------------------------------
# STS
# ---------------------------------------------------------------------------------------------------------
def fit_sts(conf_logits, accepted_prefix_len, num_proposed=None, grid=None, bins: int = DEFAULT_BINS) -> list[float]:
    """Per-position temperatures T_1..T_γ, fitted left to right to minimise the ECE of the joint survival.

    conf_logits [N, γ] raw z_k; accepted_prefix_len [N]; num_proposed [N] (None = all γ every round).
    Positions with no proposed rounds, or fewer than ``MIN_FIT_EVENTS`` accepted or rejected drafts, keep T = 1.
    Ties on the grid resolve to the smallest T."""
    temperatures, _ = _fit_sequential(conf_logits, accepted_prefix_len, num_proposed, grid, np.zeros(1), bins)
    return temperatures


def fit_sts_with_offsets(conf_logits, accepted_prefix_len, num_proposed=None, grid=None, offset_grid=None,
                         bins: int = DEFAULT_BINS) -> tuple[list[float], list[float]]:
    """STS with a per-position offset: (T_k, b_k) for c_k = σ(z_k / T_k + b_k), fitted left to right on the joint
    survival like :func:`fit_sts` (see the module docstring for why). Ties prefer the smallest |b|, then T;
    positions with too few events keep (1, 0) as in :func:`fit_sts`. The default temperature grid is coarser here (101 points, 4.7 % apart) than for temperatures alone: the
    joint grid is |T| × |b| candidates per position."""
    grid = default_temperature_grid(101) if grid is None else grid
    offset_grid = default_offset_grid() if offset_grid is None else np.asarray(offset_grid, dtype=np.float64)
    if offset_grid.ndim != 1 or offset_grid.size == 0 or not np.isfinite(offset_grid).all():
        raise ValueError("offset_grid must be a non-empty 1-D sequence of finite offsets")
    return _fit_sequential(conf_logits, accepted_prefix_len, num_proposed, grid, offset_grid, bins)


def _fit_sequential(conf_logits, accepted_prefix_len, num_proposed, grid, offset_grid: np.ndarray,
                    bins: int) -> tuple[list[float], list[float]]:
    logits, accepted, proposed = _checked_rounds(conf_logits, accepted_prefix_len, num_proposed)
    grid = default_temperature_grid() if grid is None else np.asarray(grid, dtype=np.float64)
    if grid.ndim != 1 or grid.size == 0 or (grid <= 0).any():
        raise ValueError("grid must be a non-empty 1-D sequence of positive temperatures")
    # candidate (T, b) pairs, ordered so that argmin's first-minimum rule prefers small |b|, then small T
    order = np.argsort(np.abs(offset_grid), kind="stable")
    cand_t = np.tile(grid, order.size)
    cand_b = np.repeat(offset_grid[order], grid.size)
    labels, valid = prefix_labels(accepted, proposed, logits.shape[1])
    temperatures: list[float] = []
    offsets: list[float] = []
    prefix = np.ones(logits.shape[0])  # Π_{i<k} σ(z_i / T_i + b_i) with the already-fitted (T, b)_<k
    for k in range(logits.shape[1]):
        rows = valid[:, k]
        events = int(labels[rows, k].sum())
        if rows.any() and min(events, int(rows.sum()) - events) < MIN_FIT_EVENTS:
            temperatures.append(1.0)
            offsets.append(0.0)
            logger.info("STS position %d: %d accepted / %d rejected drafts are too few to fit; keeping T=1, b=0",
                        k + 1, events, int(rows.sum()) - events)
        elif rows.any():
            eces = _ece_over_grid(prefix[rows], logits[rows, k], labels[rows, k].astype(np.float64), cand_t, bins,
                                  offsets=cand_b)
            best = int(np.argmin(eces))
            temperatures.append(float(cand_t[best]))
            offsets.append(float(cand_b[best]))
            logger.info("STS position %d: T=%.3f b=%+.2f ECE %.4f -> %.4f (%d rounds)", k + 1, cand_t[best],
                        cand_b[best], _ece_at(prefix[rows], logits[rows, k], labels[rows, k], 1.0, bins), eces[best],
                        rows.sum())
        else:
            temperatures.append(1.0)
            offsets.append(0.0)
            logger.warning("STS position %d: no round proposed it; keeping T=1", k + 1)
        prefix = prefix * _sigmoid(logits[:, k] / temperatures[-1] + offsets[-1])
    return temperatures, offsets


def fit_calibration(conf_logits, accepted_prefix_len, num_proposed=None, offsets: bool = True, grid=None,
                    offset_grid=None, bins: int = DEFAULT_BINS) -> tuple[list[float], list[float] | None]:
    """(temperatures, offsets): :func:`fit_sts_with_offsets`, or with ``offsets=False`` the paper's
    :func:`fit_sts` and ``None`` offsets."""
    if offsets:
        return fit_sts_with_offsets(conf_logits, accepted_prefix_len, num_proposed, grid=grid,
                                    offset_grid=offset_grid, bins=bins)
    return fit_sts(conf_logits, accepted_prefix_len, num_proposed, grid=grid, bins=bins), None


def split_half_ece(conf_logits, accepted_prefix_len, num_proposed=None, offsets: bool = True, grid=None,
                   offset_grid=None, bins: int = DEFAULT_BINS, return_noise_floor: bool = False):
    """Out-of-sample ECE per position [γ]: fit on the first half of the rounds and score on the second, then the
    other way round, and average the two (weighted by rounds). Why: the in-sample ECE of a fit with two
    parameters per position on a few thousand rounds flatters it; this is what a new prompt set would see.
    Rounds are split in recorded order, so the halves hold (almost) disjoint prompts.

    ``return_noise_floor=True`` returns ``(ece, floor)``: ``floor`` is the same average of
    :func:`ece_noise_floor` on the scored halves, the part of the out-of-sample ECE that is sampling noise."""
    logits, accepted, proposed = _checked_rounds(conf_logits, accepted_prefix_len, num_proposed)
    half = logits.shape[0] // 2
    if half == 0:
        raise ValueError("split-half ECE needs at least two rounds")
    total, floor, weight = np.zeros(logits.shape[1]), np.zeros(logits.shape[1]), np.zeros(logits.shape[1])
    for fit, score in ((slice(0, half), slice(half, None)), (slice(half, None), slice(0, half))):
        temps, shifts = fit_calibration(logits[fit], accepted[fit], proposed[fit], offsets, grid, offset_grid, bins)
        for row in calibration_report(logits[score], accepted[score], proposed[score], temps, bins, offsets=shifts,
                                      noise_floor_draws=200 if return_noise_floor else 0):
            if row.num_rounds:
                total[row.position - 1] += row.ece_after * row.num_rounds
                floor[row.position - 1] += row.ece_noise_floor * row.num_rounds
                weight[row.position - 1] += row.num_rounds
    with np.errstate(invalid="ignore", divide="ignore"):
        ece = np.where(weight > 0, total / weight, np.nan)
        return (ece, np.where(weight > 0, floor / weight, np.nan)) if return_noise_floor else ece


def _ece_at(prefix, logits, labels, temperature, bins) -> float:
    return expected_calibration_error(prefix * _sigmoid(logits / temperature), labels.astype(np.float64), bins)


def _ece_over_grid(prefix: np.ndarray, logits: np.ndarray, labels: np.ndarray, grid: np.ndarray, bins: int,
                   max_elements: int = 1 << 22, offsets: np.ndarray | None = None) -> np.ndarray:
    """ECE for every candidate temperature (and offset, same length as ``grid``) at once, in chunks of the grid to
    bound memory (G × N floats)."""
    num = prefix.size
    offsets = np.zeros(grid.size) if offsets is None else offsets
    eces = np.empty(grid.size)
    chunk = max(1, max_elements // max(num, 1))
    for start in range(0, grid.size, chunk):
        temps, shift = grid[start:start + chunk], offsets[start:start + chunk]
        preds = prefix[None, :] * _sigmoid(logits[None, :] / temps[:, None] + shift[:, None])  # [g, N]
        index = _bin_index(preds, bins) + bins * np.arange(temps.size)[:, None]
        length = bins * temps.size
        gap = np.bincount(index.ravel(), weights=preds.ravel(), minlength=length) \
            - np.bincount(index.ravel(), weights=np.broadcast_to(labels, preds.shape).ravel(), minlength=length)
        eces[start:start + chunk] = np.abs(gap.reshape(temps.size, bins)).sum(1) / num
    return eces


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------
@dataclass
class PositionCalibration:
    """Calibration of the joint survival a_k at one draft position (1-based), before and after STS."""

    position: int
    num_rounds: int
    acceptance_rate: float  # empirical P(drafts 1..k accepted)
    mean_confidence_before: float
    mean_confidence_after: float
    ece_before: float
    ece_after: float
    auc_before: float
    auc_after: float
    temperature: float
    curve_before: ReliabilityCurve
    curve_after: ReliabilityCurve
    offset: float = 0.0
    ece_noise_floor: float = float("nan")  # ECE a perfectly calibrated head would show on these rounds (after STS)

    def to_dict(self) -> dict:
        return asdict(self)


def calibration_report(conf_logits, accepted_prefix_len, num_proposed=None, temperatures=None,
                       bins: int = DEFAULT_BINS, offsets=None, noise_floor_draws: int = 200) -> list[PositionCalibration]:
    """Per position: ECE and AUC of a_k before (T = 1, b = 0) and after ``temperatures`` / ``offsets``
    (temperatures fitted here when None; offsets default to 0), and the ECE noise floor of the calibrated
    confidences (:func:`ece_noise_floor`; ``noise_floor_draws=0`` skips it)."""
    logits, accepted, proposed = _checked_rounds(conf_logits, accepted_prefix_len, num_proposed)
    if temperatures is None:
        temperatures = fit_sts(logits, accepted, proposed, bins=bins)
    if len(temperatures) < logits.shape[1]:
        raise ValueError(f"need {logits.shape[1]} temperatures (one per position), got {len(temperatures)}")
    if offsets is not None and len(offsets) < logits.shape[1]:
        raise ValueError(f"need {logits.shape[1]} offsets (one per position), got {len(offsets)}")
    labels, valid = prefix_labels(accepted, proposed, logits.shape[1])
    before, after = cumulative_confidence(logits), cumulative_confidence(logits, temperatures, offsets)
    report = []
    for k in range(logits.shape[1]):
        rows = valid[:, k]
        y = labels[rows, k].astype(np.float64)
        p0, p1 = before[rows, k], after[rows, k]
        report.append(PositionCalibration(
            position=k + 1, num_rounds=int(rows.sum()), acceptance_rate=float(y.mean()) if y.size else float("nan"),
            mean_confidence_before=float(p0.mean()) if y.size else float("nan"),
            mean_confidence_after=float(p1.mean()) if y.size else float("nan"),
            ece_before=expected_calibration_error(p0, y, bins), ece_after=expected_calibration_error(p1, y, bins),
            auc_before=auc(p0, y), auc_after=auc(p1, y), temperature=float(temperatures[k]),
            curve_before=reliability_curve(p0, y, bins), curve_after=reliability_curve(p1, y, bins),
            offset=float(offsets[k]) if offsets is not None else 0.0,
            ece_noise_floor=(ece_noise_floor(p1, bins, noise_floor_draws, seed=k)
                             if noise_floor_draws and y.size else float("nan"))))
    return report


__all__ = [
    "DEFAULT_BINS",
    "MIN_FIT_EVENTS",
    "PositionCalibration",
    "ReliabilityCurve",
    "auc",
    "calibrated_confidence",
    "calibration_report",
    "cumulative_confidence",
    "default_offset_grid",
    "default_temperature_grid",
    "ece_noise_floor",
    "expected_calibration_error",
    "fit_calibration",
    "fit_sts",
    "fit_sts_with_offsets",
    "prefix_labels",
    "reliability_curve",
    "split_half_ece",
]
