"""Paper Algorithm 1 as pure arithmetic on host arrays, shared by the verify policies and by the tests and benchmarks
that check them.

Confidences c_{r,j} -> prefix survival a_{r,j} = Π_{i≤j} c_{r,i} -> candidates (r, j) in admission order -> the
throughput Θ of each admission prefix, on an SPS(B) table (the paper's Θ = τ · SPS(B)) or on the padded step cost
(drafter pass + R × W verify, what ``generate`` and the engine run) -> the walk that stops at the first admission
that does not improve Θ (the break that keeps sampling lossless). Plus the conversions between the caller's arrays
and the numpy the policies work in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import numpy as np
import torch

from .cost_tables import SPSProfile, StepCostProfile

ArrayLike = Union[torch.Tensor, np.ndarray, Sequence]

#: Neutral prior for requests whose drafter gives no confidence (e.g. DFlash): a typical per-position
#: conditional acceptance. The engine should pass measured per-position acceptance rates instead.
DEFAULT_MISSING_CONFIDENCE = 0.75


# NOTE: the policies work in numpy on purpose: R·γ is at most a few thousand numbers, and torch's intra-op thread
# pool makes such tiny gathers and sorts cost milliseconds on a busy CPU, far more than the work.
def as_numpy(x: ArrayLike) -> np.ndarray:
    """``x`` as a numpy array (host tensors are viewed, not copied)."""
    if isinstance(x, torch.Tensor):
        if x.device.type == "cpu" and not x.requires_grad:
            return x.numpy()  # host memory already (the round hands policies host tensors): no copy, no device read
        return x.detach().cpu().numpy()
    return np.asarray(x)


def as_lengths(max_lengths: ArrayLike) -> np.ndarray:
    """Per-row draft counts as int64 [R]; a ValueError for negative ones."""
    lengths = as_numpy(max_lengths).astype(np.int64).reshape(-1)
    if (lengths < 0).any():
        raise ValueError(f"max_lengths must be >= 0, got {lengths.tolist()}")
    return lengths


def fill_confidences(confidences: ArrayLike | None, max_lengths: ArrayLike, gamma: int | None = None,
                     missing: float | ArrayLike = DEFAULT_MISSING_CONFIDENCE) -> np.ndarray:
    """Conditional confidences as float64 [R, γ] in [0, 1]; NaN -> ``missing`` (scalar or per-position [≥ γ]);
    positions j > max_r -> 0 so they are never candidates."""
    max_lengths = as_lengths(max_lengths)
    num_requests = max_lengths.size
    if confidences is None:
        width = gamma if gamma is not None else int(max_lengths.max()) if num_requests else 0
        conf = np.full((num_requests, width), np.nan)
    else:
        conf = as_numpy(confidences).astype(np.float64)
        if conf.ndim != 2 or conf.shape[0] != num_requests:
            raise ValueError(f"confidences must be [R, γ] with R = len(max_lengths) = {num_requests}, "
                             f"got shape {tuple(conf.shape)}")
    fill = as_numpy(missing).astype(np.float64)
    if fill.ndim:  # per-position prior
        fill = np.broadcast_to(fill[: conf.shape[1]], conf.shape)
    conf = np.clip(np.where(np.isnan(conf), fill, conf), 0.0, 1.0)
    positions = np.arange(1, conf.shape[1] + 1)
    return np.where(positions[None, :] <= max_lengths[:, None], conf, 0.0)


def prefix_survival(confidences: ArrayLike) -> np.ndarray:
    """a_{r,j} = Π_{i≤j} c_{r,i}: probability that drafts 1..j of request r are all accepted. [R, γ] -> [R, γ].

    NOTE: with c ∈ [0, 1] the float cumprod is exactly non-increasing in j (x·c rounds to a value ≤ x),
    which the admission order relies on to keep prefixes contiguous."""
    return np.cumprod(as_numpy(confidences).astype(np.float64), axis=-1)


def admission_order(survival: ArrayLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Candidates (r, j) with a_{r,j} > 0 sorted by a descending; ties: smaller j first, then smaller r.

    The tie rule keeps each request's admitted set a contiguous prefix even when c = 1 makes a flat.
    Returns (rows [K], positions [K] 1-based, values [K])."""
    survival = as_numpy(survival)
    # Flatten position-major so a stable sort breaks ties by (j, r).
    flat = survival.T.reshape(-1)
    order = np.argsort(-flat, kind="stable")
    order = order[flat[order] > 0]
    num_requests = survival.shape[0]
    return order % num_requests, order // num_requests + 1, flat[order]


def throughput_path(values: ArrayLike, num_requests: int, cost: SPSProfile | StepCostProfile) -> np.ndarray:
    """Θ_k = (R + Σ_{i≤k} values_i) · SPS(R + k) for k = 0..K: expected accepted tokens per second after
    admitting the first k sorted candidates (Θ_0 = plain decoding of the R requests). [K] -> [K + 1].
    ``cost`` answers SPS(B) lookups (a step-cost profile does too: B tokens in rows of its widest verify)."""
    values = as_numpy(values).astype(np.float64)
    tau = num_requests + np.concatenate([[0.0], np.cumsum(values)])
    return tau * cost.lookup(num_requests + np.arange(values.size + 1))


def padded_width_path(survival: ArrayLike, cost: StepCostProfile, *, drafted: bool = True,
                      step_factors: ArrayLike | None = None) -> np.ndarray:
    """Θ_w = (R + Σ_r Σ_{j≤w} a_{r,j}) / (t_draft(R) + t_verify(R, 1 + w)) for w = 0..γ: expected accepted tokens
    per second of a padded step in which every request verifies its first min(w, max_r) drafts. [R, γ'] -> [γ + 1]
    with γ = min(γ', widest verify in ``cost`` − 1): drafts past the widest measured verify are never candidates.
    ``step_factors`` [≥ γ + 1] (optional) scale each width's step time (measured / predicted, per kind of step).

    In a padded batch the widest row sets the cost of all rows, so the candidates are widths, not single
    drafts; a width w admits every candidate (r, j ≤ w), which is free for the rows that are narrower."""
    survival = as_numpy(survival).astype(np.float64)
    survival = survival[:, : cost.max_width - 1]
    num_requests, gamma = survival.shape
    tau = num_requests + np.concatenate([[0.0], np.cumsum(survival.sum(axis=0))])
    seconds = cost.verify_widths(num_requests)[: gamma + 1] + (cost.draft(num_requests) if drafted else 0.0)
    if step_factors is not None:
        seconds = seconds * np.asarray(step_factors, dtype=np.float64)[: gamma + 1]
    return tau / seconds


def lengths_from_admissions(rows: ArrayLike, num_admitted: int, num_requests: int) -> np.ndarray:
    """ℓ_r = how many of the first ``num_admitted`` candidates belong to r (= its longest admitted j, since
    admitted sets are contiguous prefixes)."""
    return np.bincount(as_numpy(rows)[:num_admitted], minlength=num_requests).astype(np.int64)


def num_leading_improvements(theta: ArrayLike) -> int:
    """Algorithm 1's stopping point: admissions are kept while each one strictly improves Θ; the first that
    does not ends the walk (the break)."""
    theta = as_numpy(theta)
    not_improving = np.flatnonzero(theta[1:] <= theta[:-1])
    return int(not_improving[0]) if not_improving.size else theta.size - 1


def walk_admissions(survival: np.ndarray, cost: SPSProfile | StepCostProfile) -> tuple[np.ndarray, float]:
    """Algorithm 1 on the paper's Θ = τ · SPS(Σ_r (1 + ℓ_r)): admit candidates in order of a_{r,j} while each
    improves Θ. ``survival`` [R, γ] -> (ℓ [R], the Θ the walk stopped at).

    Lossless (paper App. A): "ℓ_r ≥ j" is settled by the walk up to candidate (r, j), every candidate before it has
    a ≥ a_{r,j}, and of request r's own candidates only j' ≤ j qualify; a_{r,j} reads x_{r,<j} only."""
    num_requests = survival.shape[0]
    rows, _, values = admission_order(survival)
    theta = throughput_path(values, num_requests, cost)
    num_admitted = num_leading_improvements(theta)
    return lengths_from_admissions(rows, num_admitted, num_requests), float(theta[num_admitted])


def walk_widths(theta: np.ndarray, *, all_greedy: bool = False) -> int:
    """The verify width the padded walk stops at, given Θ_w per width (:func:`padded_width_path`).

    With the break, "w ≥ j" is settled by Θ_0..Θ_j, which read a_{·,i ≤ j}, i.e. x_{r,<j} only: lossless for
    sampled rows. ``all_greedy`` (no row samples, so any width is verified exactly) takes the best width outright:
    where a few verified tokens cost a dip in Θ before longer widths pay, the break would never get past it."""
    return int(np.argmax(theta)) if all_greedy else num_leading_improvements(theta)


def expected_throughput(confidences: ArrayLike | None, lengths: ArrayLike, cost: SPSProfile | StepCostProfile,
                        missing: float | ArrayLike = DEFAULT_MISSING_CONFIDENCE) -> float:
    """Θ = τ · SPS(B) of a given choice ℓ (for comparing policies on one confidence table)."""
    lengths = as_lengths(lengths)
    # Passing ℓ as max_lengths zeroes a_{r,j} for j > ℓ_r, so the sum is exactly Σ_r Σ_{j≤ℓ_r} a_{r,j}.
    conf = fill_confidences(confidences, lengths, missing=missing)
    tau = lengths.size + float(prefix_survival(conf).sum())
    batch = int(lengths.sum()) + lengths.size
    return tau * cost(batch) if batch else 0.0


__all__ = ["DEFAULT_MISSING_CONFIDENCE", "ArrayLike", "admission_order", "as_lengths", "as_numpy",
           "expected_throughput", "fill_confidences", "lengths_from_admissions", "num_leading_improvements",
           "padded_width_path", "prefix_survival", "throughput_path", "walk_admissions", "walk_widths"]
