"""Verify-length policies: how many of each request's drafts the target verifies in one engine step.

Every policy answers one question per step: given R active requests, each with γ drafted tokens and (for DSpark
drafters) the calibrated conditional confidences c_{r,j} = P(draft j accepted | drafts < j accepted), how many
leading drafts ℓ_r ∈ {0..max_r} go into the single batched verify forward? The verify batch then holds
B = Σ_r (1 + ℓ_r) tokens (the 1 is the bonus/recovery slot every request gets).

Policies live in one registry (``register_policy``); the engine looks them up by name with ``make_policy``:

* ``none``             ℓ = 0: plain continuous batching, the baseline.
* ``fixed``            ℓ = min(γ_fixed, max_r).
* ``threshold``        stop at the first draft whose own c_j is below a static threshold (DeepSpec's eval knob).
* ``scheduled``        paper Algorithm 1: load-aware greedy on Θ = τ · SPS(B) with the lossless early-stop break.
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
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from .profiler import SPSProfile

logger = logging.getLogger(__name__)

#: Neutral prior for requests whose drafter gives no confidence (e.g. DFlash): a typical per-position
#: conditional acceptance. The engine should pass measured per-position acceptance rates instead.
DEFAULT_MISSING_CONFIDENCE = 0.75


@runtime_checkable
class VerifyPolicy(Protocol):
    """What the engine calls each step. ``step`` is the engine step index (only history-keeping policies use it)."""

    name: str

    def choose(self, confidences: torch.Tensor | None, max_lengths: torch.Tensor, sps: "SPSProfile", *,
               step: int | None = None) -> torch.Tensor:
        """confidences [R, γ] (NaN = unknown) or None; max_lengths [R] drafts available -> ℓ [R] long."""
        ...


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
# Pure building blocks (shared by the policies and by tests / benchmarks)
# ---------------------------------------------------------------------------------------------------------
def fill_confidences(confidences: torch.Tensor | None, max_lengths: torch.Tensor, gamma: int | None = None,
                     missing: float | torch.Tensor = DEFAULT_MISSING_CONFIDENCE) -> torch.Tensor:
    """Conditional confidences as float64 [R, γ] in [0, 1]; NaN -> ``missing`` (scalar or per-position [γ]);
    positions j > max_r -> 0 so they are never candidates."""
    max_lengths = torch.as_tensor(max_lengths, dtype=torch.long).reshape(-1)
    num_requests = max_lengths.numel()
    if confidences is None:
        width = gamma if gamma is not None else int(max_lengths.max().item()) if num_requests else 0
        conf = torch.full((num_requests, width), float("nan"), dtype=torch.float64)
    else:
        conf = torch.as_tensor(confidences).to(dtype=torch.float64, device="cpu")
        if conf.dim() != 2 or conf.shape[0] != num_requests:
            raise ValueError(f"confidences must be [R, γ] with R = len(max_lengths) = {num_requests}, "
                             f"got shape {tuple(conf.shape)}")
    fill = torch.as_tensor(missing, dtype=torch.float64)
    if fill.dim():  # per-position prior [≥ γ]
        fill = fill[: conf.shape[1]].expand_as(conf)
    conf = torch.where(torch.isnan(conf), fill, conf)
    positions = torch.arange(1, conf.shape[1] + 1)
    conf = conf.clamp(0.0, 1.0)
    return torch.where(positions[None, :] <= max_lengths.cpu()[:, None], conf, torch.zeros_like(conf))


def prefix_survival(confidences: torch.Tensor) -> torch.Tensor:
    """a_{r,j} = Π_{i≤j} c_{r,i}: probability that drafts 1..j of request r are all accepted. [R, γ] -> [R, γ].

    NOTE: with c ∈ [0, 1] the float cumprod is exactly non-increasing in j (x·c rounds to a value ≤ x),
    which the admission order relies on to keep prefixes contiguous."""
    return torch.cumprod(confidences, dim=-1)


def admission_order(survival: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Candidates (r, j) with a_{r,j} > 0 sorted by a descending; ties: smaller j first, then smaller r.

    The tie rule keeps each request's admitted set a contiguous prefix even when c = 1 makes a flat.
    Returns (rows [K], positions [K] 1-based, values [K])."""
    # Flatten position-major so a stable sort breaks ties by (j, r).
    flat = survival.t().reshape(-1)
    order = torch.sort(flat, descending=True, stable=True).indices
    values = flat[order]
    keep = values > 0
    order, values = order[keep], values[keep]
    num_requests = survival.shape[0]
    return order % num_requests, order // num_requests + 1, values


def throughput_path(values: torch.Tensor, num_requests: int, sps: "SPSProfile") -> torch.Tensor:
    """Θ_k = (R + Σ_{i≤k} values_i) · SPS(R + k) for k = 0..K: expected accepted tokens per second after
    admitting the first k sorted candidates (Θ_0 = plain decoding of the R requests). [K] -> [K + 1]."""
    tau = num_requests + torch.cat([values.new_zeros(1), torch.cumsum(values, 0)])
    batch_tokens = num_requests + torch.arange(values.numel() + 1)
    return tau * sps.lookup(batch_tokens).to(tau.dtype)


def lengths_from_admissions(rows: torch.Tensor, num_admitted: int, num_requests: int) -> torch.Tensor:
    """ℓ_r = how many of the first ``num_admitted`` candidates belong to r (= its longest admitted j, since
    admitted sets are contiguous prefixes)."""
    return torch.bincount(rows[:num_admitted], minlength=num_requests).to(torch.long)


def num_leading_improvements(theta: torch.Tensor) -> int:
    """Algorithm 1's stopping point: admissions are kept while each one strictly improves Θ; the first that
    does not ends the walk (the break)."""
    improving = (theta[1:] > theta[:-1]).to(torch.long)
    return int(torch.cumprod(improving, 0).sum().item()) if improving.numel() else 0


def _check_lengths(max_lengths: torch.Tensor) -> torch.Tensor:
    max_lengths = torch.as_tensor(max_lengths, dtype=torch.long).reshape(-1).cpu()
    if (max_lengths < 0).any():
        raise ValueError(f"max_lengths must be >= 0, got {max_lengths.tolist()}")
    return max_lengths


# ---------------------------------------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------------------------------------
@register_policy("none")
class NoSpeculationPolicy:
    """ℓ = 0 for every request: the target decodes one token per request per step (continuous batching)."""

    def choose(self, confidences, max_lengths, sps, *, step=None) -> torch.Tensor:
        return torch.zeros_like(_check_lengths(max_lengths))


@register_policy("fixed")
class FixedLengthPolicy:
    """ℓ = min(num_tokens, max_r); ``num_tokens=None`` verifies every drafted token. Lossless trivially:
    the length never looks at a draft."""

    def __init__(self, num_tokens: int | None = None):
        if num_tokens is not None and num_tokens < 0:
            raise ValueError(f"fixed policy: num_tokens must be >= 0 or None (all drafts), got {num_tokens}")
        self.num_tokens = num_tokens

    def choose(self, confidences, max_lengths, sps, *, step=None) -> torch.Tensor:
        max_lengths = _check_lengths(max_lengths)
        return max_lengths if self.num_tokens is None else max_lengths.clamp(max=self.num_tokens)


@register_policy("threshold")
class ThresholdPolicy:
    """Verify drafts up to (excluding) the first j whose own conditional c_j < threshold; load-blind.

    Lossless: whether draft j is verified depends on c_1..c_j, and c_j is computed from x_<j only.
    Unknown confidences (NaN) count as ``missing_confidence`` (default 1: no score, no pruning)."""

    def __init__(self, threshold: float = 0.5, missing_confidence: float = 1.0):
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold policy: threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold
        self.missing_confidence = missing_confidence

    def choose(self, confidences, max_lengths, sps, *, step=None) -> torch.Tensor:
        max_lengths = _check_lengths(max_lengths)
        conf = fill_confidences(confidences, max_lengths, missing=self.missing_confidence)
        passing = (conf >= self.threshold).to(torch.long)
        # positions beyond max_r were zeroed by fill_confidences, so they fail unless threshold == 0
        return torch.cumprod(passing, dim=-1).sum(-1).clamp(max=max_lengths)


@register_policy("scheduled")
class ScheduledPolicy:
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
    """

    def __init__(self, missing_confidence: float | torch.Tensor = DEFAULT_MISSING_CONFIDENCE):
        self.missing_confidence = missing_confidence
        self.last_theta: float | None = None  # Θ of the last choice (for logging / benchmarks)

    def choose(self, confidences, max_lengths, sps, *, step=None) -> torch.Tensor:
        max_lengths = _check_lengths(max_lengths)
        num_requests = max_lengths.numel()
        if num_requests == 0:
            return max_lengths
        survival = prefix_survival(fill_confidences(confidences, max_lengths, missing=self.missing_confidence))
        rows, _, values = admission_order(survival)
        theta = throughput_path(values, num_requests, sps)
        num_admitted = num_leading_improvements(theta)
        self.last_theta = float(theta[num_admitted])
        logger.debug("scheduled: R=%d, admitted %d of %d candidates, Θ=%.3f", num_requests, num_admitted,
                     values.numel(), self.last_theta)
        return lengths_from_admissions(rows, num_admitted, num_requests)


@register_policy("scheduled-async")
class AsyncScheduledPolicy:
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

    def __init__(self, missing_confidence: float | torch.Tensor = DEFAULT_MISSING_CONFIDENCE, delay: int = 2):
        if delay < 1:
            raise ValueError(f"scheduled-async: delay must be >= 1 step, got {delay}")
        self.missing_confidence = missing_confidence
        self.delay = delay
        self.last_budget: int | None = None
        self._history: dict[int, torch.Tensor] = {}  # step -> sorted candidate survivals of that step
        self._next_step = 0
        self._fallback = ScheduledPolicy(missing_confidence)

    def reset(self) -> None:
        self._history.clear()
        self._next_step = 0

    def budget(self, old_values: torch.Tensor, num_requests: int, sps: "SPSProfile") -> int:
        """Global argmax of Θ over the stale candidate pool (smallest K on ties)."""
        theta = throughput_path(old_values, num_requests, sps)
        return int(torch.argmax(theta).item())  # torch.argmax returns the first maximum

    def choose(self, confidences, max_lengths, sps, *, step=None) -> torch.Tensor:
        max_lengths = _check_lengths(max_lengths)
        step = self._next_step if step is None else int(step)
        self._next_step = step + 1
        old_values = self._history.get(step - self.delay)
        num_requests = max_lengths.numel()
        survival = prefix_survival(fill_confidences(confidences, max_lengths, missing=self.missing_confidence))
        rows, _, values = admission_order(survival)
        self._history[step] = values
        for key in [k for k in self._history if k <= step - self.delay]:
            del self._history[key]
        if num_requests == 0:
            return max_lengths
        if old_values is None:
            lengths = self._fallback.choose(confidences, max_lengths, sps)
            self.last_budget = int(lengths.sum())
            return lengths
        self.last_budget = self.budget(old_values, num_requests, sps)
        return lengths_from_admissions(rows, min(self.last_budget, rows.numel()), num_requests)


def expected_throughput(confidences: torch.Tensor | None, lengths: torch.Tensor, sps: "SPSProfile",
                        missing: float | torch.Tensor = DEFAULT_MISSING_CONFIDENCE) -> float:
    """Θ = τ · SPS(B) of a given choice ℓ (for comparing policies on one confidence table)."""
    lengths = _check_lengths(lengths)
    # Passing ℓ as max_lengths zeroes a_{r,j} for j > ℓ_r, so the sum is exactly Σ_r Σ_{j≤ℓ_r} a_{r,j}.
    conf = fill_confidences(confidences, lengths, missing=missing)
    tau = lengths.numel() + float(prefix_survival(conf).sum())
    batch = int(lengths.sum()) + lengths.numel()
    return tau * sps(batch) if batch else 0.0


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
    "prefix_survival",
    "register_policy",
    "throughput_path",
]
