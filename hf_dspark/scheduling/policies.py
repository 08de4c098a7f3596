"""Verify-length policies: how many of each request's drafts the target verifies in one round. This module holds
what every policy shares (the inputs of a choice, the protocol, the registry) and the simple policies.

Every policy answers one question per round: given R active requests, each with γ drafted tokens and (for DSpark
drafters) the calibrated conditional confidences c_{r,j} = P(draft j accepted | drafts < j accepted), how many
leading drafts ℓ_r ∈ {0..max_r} go into the single batched verify forward? The verify batch then holds
B = Σ_r (1 + ℓ_r) tokens (the 1 is the bonus/recovery slot every request gets).

Policies live in one registry (``register_policy``); the engine and ``generate`` look them up with ``make_policy``:

* ``none``             ℓ = 0: plain continuous batching, the baseline.
* ``fixed``            ℓ = min(γ_fixed, max_r).
* ``threshold``        stop at the first draft whose own c_j is below a static threshold (DeepSpec's eval knob).
* ``scheduled``        paper Algorithm 1 on measured costs (scheduled.py).
* ``scheduled-async``  paper §5.2: budget from confidences two steps old, then top-K now (scheduled_async.py).

A policy of one's own subclasses :class:`VerifyPolicy` and implements ``choose(self, inputs)``::

    @register_policy("first-two")
    class FirstTwo(VerifyPolicy):
        def choose(self, inputs: PolicyInputs) -> torch.Tensor:
            return inputs.result(np.minimum(inputs.lengths(), 2))

Losslessness. Speculative sampling recovers the target distribution only if the decision "verify draft j" is
*non-anticipating*: it may depend on everything known before x_{r,j} was sampled, never on x_{r,j} itself.
In DSpark c_{r,j+1} is computed from x_{r,j} (the Markov feature of the previous token), so any policy that
looks at c_{r,j+1} before deciding about x_{r,j} leaks x_{r,j} into its own admission (paper App. A gives a
two-token example where the output becomes (0.85, 0.15) instead of the target's (0.7, 0.3); our tests replay it).
Each policy's docstring says why it does not.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .algorithm1 import ArrayLike, as_lengths, fill_confidences
from .cost_tables import SPSProfile, StepCostProfile


@dataclass(frozen=True, eq=False)
class PolicyInputs:
    """Everything a policy may read when it chooses ℓ for one round: all of it is known before any draft of the
    round is verified.

    Args:
        confidences (`Tensor | ndarray | None`): [R, γ] calibrated conditional confidences c_{r,j} (NaN: unknown);
            None when the drafter has no confidence head.
        max_lengths (`Tensor | ndarray | Sequence`): [R] drafts each row may verify (what its source proposed,
            capped by its token budget).
        cost (`StepCostProfile | SPSProfile | None`, defaults to None): what the round is priced with (None for
            policies that do not set ``needs_step_cost``).
        step (`int | None`, defaults to None): the engine step index (only history-keeping policies read it).
        drafter_rows (`ndarray | None`, defaults to None): [R] bool, rows whose confidences come from the drafter
            (the others carry already-calibrated lookup confidences); None: every row.
        drafted (`bool`, defaults to True): the drafter ran this round (its pass is part of every width's step time).
        all_greedy (`bool`, defaults to False): no row samples, so any choice is verified exactly.
    """

    confidences: torch.Tensor | np.ndarray | None
    max_lengths: ArrayLike
    cost: StepCostProfile | SPSProfile | None = None
    step: int | None = None
    drafter_rows: np.ndarray | None = None
    drafted: bool = True
    all_greedy: bool = False

    def lengths(self) -> np.ndarray:
        """``max_lengths`` as int64 numpy [R] (a ValueError for negative ones)."""
        return as_lengths(self.max_lengths)

    def result(self, lengths: np.ndarray) -> torch.Tensor:
        """ℓ [R] as a long tensor on the device of ``max_lengths`` (host memory for host lengths)."""
        like = self.max_lengths
        device = like.device if isinstance(like, torch.Tensor) and like.device.type != "cpu" else None
        return torch.as_tensor(np.ascontiguousarray(lengths, dtype=np.int64), device=device)


class VerifyPolicy:
    """What the shared speculative round asks each round; ``generate`` and the engine call the same methods.

    Subclasses implement :meth:`choose` (and :meth:`plan_sources` when they set ``supports_lookup``); every other
    hook has a neutral default, so a policy only overrides what it uses (no caller probes for optional methods)."""

    name: str = ""
    #: True when :meth:`choose` / :meth:`wants_drafts` read the step cost (the engine then measures it).
    needs_step_cost: bool = False
    #: True when the policy can weigh lookup proposals against the drafter (:meth:`plan_sources` /
    #: :meth:`refine_sources`); the round offers lookup proposals only to such policies.
    supports_lookup: bool = False

    def choose(self, inputs: PolicyInputs) -> torch.Tensor:
        """ℓ [R] long: how many leading drafts of each row the target verifies (≤ ``inputs.max_lengths``)."""
        raise NotImplementedError

    def max_drafts(self, block_size: int) -> int:
        """Drafts per request per round this policy can ever verify (0: never draft at all)."""
        return block_size

    def draft_threshold(self) -> float:
        """A confidence below which this policy never verifies a draft *or any later one*: the drafter may stop
        drafting a row at its first slot under it (an early exit that saves drafting cost and changes nothing the
        policy would choose). 0 = no such bound."""
        return 0.0

    def wants_drafts(self, num_requests: int, cost: StepCostProfile | SPSProfile | None, *,
                     sampled: bool = False, caps: np.ndarray | None = None) -> bool:
        """Whether drafting this round can pay at all (False: a plain decoding round, the drafter is skipped);
        ``sampled``: some row of the round samples; ``caps`` [R]: drafts each row may still verify (its token
        budget less the bonus token; None: no limit)."""
        return True

    def plan_sources(self, lookup_confidences: np.ndarray, cost, *, drafter_available: bool,
                     wants: np.ndarray | None = None, sampled: bool = False,
                     caps: np.ndarray | None = None) -> tuple[np.ndarray, bool]:
        """Before drafting, for policies that set ``supports_lookup``: which rows take their lookup proposal
        ([R] bool) and whether the drafter runs at all. ``lookup_confidences`` [R, L]: each row's lookup proposal's
        calibrated conditional confidences (0 past its end)."""
        raise NotImplementedError(f"{type(self).__name__} sets supports_lookup but has no plan_sources()")

    def refine_sources(self, drafter_confidences: np.ndarray, lookup_confidences: np.ndarray,
                       use_lookup: np.ndarray, switchable: np.ndarray) -> np.ndarray:
        """After drafting, for policies that set ``supports_lookup``: the rows that take their lookup proposal
        ([R] bool); only rows in ``switchable`` (greedy ones) may change their source."""
        return use_lookup

    def observe(self, confidences, lengths, num_accepted) -> None:
        """One round's outcome: ℓ_r verified drafts of which the first ``num_accepted_r`` were accepted."""

    def observe_step(self, drafted: bool, predicted_seconds: float, seconds: float, *, sampled: bool = False,
                     wide: bool | None = None, rows: int | None = None) -> None:
        """A finished round's wall time next to the cost model's prediction (``wide``: it verified drafts;
        ``rows``: how many rows it ran)."""


_POLICIES: dict[str, Callable[..., VerifyPolicy]] = {}


def register_policy(name: str, *, overwrite: bool = False):
    """Class decorator adding a policy to the registry under ``name`` (validated: unique, a :class:`VerifyPolicy`
    whose ``choose`` takes the round's :class:`PolicyInputs`)."""

    def decorator(cls):
        if not name or not isinstance(name, str):
            raise ValueError(f"register_policy: name must be a non-empty string, got {name!r}")
        if name in _POLICIES and not overwrite:
            raise ValueError(f"verify policy {name!r} is already registered; pass overwrite=True to replace it")
        if not callable(getattr(cls, "choose", None)):
            raise TypeError(f"register_policy({name!r}): {cls.__name__} has no choose() method")
        if not (isinstance(cls, type) and issubclass(cls, VerifyPolicy)):
            raise TypeError(f"register_policy({name!r}): {cls.__name__} must subclass hf_dspark.scheduling."
                            "VerifyPolicy (its hooks have the neutral defaults the round relies on)")
        _raise_if_choose_takes_more_than_inputs(name, cls)
        cls.name = name
        _POLICIES[name] = cls
        return cls

    return decorator


def _raise_if_choose_takes_more_than_inputs(name: str, cls) -> None:
    """The round calls ``policy.choose(inputs)``: a ``choose`` that needs other arguments would fail on the first
    round, far from its definition."""
    try:
        inspect.signature(cls.choose).bind(None, None)
    except TypeError:
        raise TypeError(f"register_policy({name!r}): {cls.__name__}.choose must take one argument, the round's "
                        f"PolicyInputs: def choose(self, inputs), got choose{inspect.signature(cls.choose)}") from None


def available_policies() -> list[str]:
    return sorted(_POLICIES)


def make_policy(name: str, **kwargs) -> VerifyPolicy:
    """A fresh policy instance (policies may keep per-engine history, so never share one between engines)."""
    if name not in _POLICIES:
        raise ValueError(f"unknown verify policy {name!r}; choose one of {available_policies()} "
                         f"or add one with hf_dspark.scheduling.register_policy")
    return _POLICIES[name](**kwargs)


# ---------------------------------------------------------------------------------------------------------
# The simple policies
# ---------------------------------------------------------------------------------------------------------
@register_policy("none")
class NoSpeculationPolicy(VerifyPolicy):
    """ℓ = 0 for every request: the target decodes one token per request per step (continuous batching)."""

    def max_drafts(self, block_size: int) -> int:
        return 0

    def choose(self, inputs: PolicyInputs) -> torch.Tensor:
        return inputs.result(np.zeros_like(inputs.lengths()))


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

    def choose(self, inputs: PolicyInputs) -> torch.Tensor:
        lengths = inputs.lengths()
        return inputs.result(lengths if self.num_tokens is None else np.minimum(lengths, self.num_tokens))


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

    def choose(self, inputs: PolicyInputs) -> torch.Tensor:
        lengths = inputs.lengths()
        if self.threshold <= 0.0:  # every confidence in [0, 1] passes: ℓ = max_r, nothing to score
            chosen = lengths
        else:
            conf = fill_confidences(inputs.confidences, lengths, missing=self.missing_confidence)
            passing = (conf >= self.threshold).astype(np.int64)
            # positions beyond max_r were zeroed by fill_confidences, so they fail (the threshold is > 0)
            chosen = np.minimum(np.cumprod(passing, axis=-1).sum(-1), lengths)
        if self.num_tokens is not None:
            chosen = np.minimum(chosen, self.num_tokens)
        return inputs.result(chosen)


__all__ = ["FixedLengthPolicy", "NoSpeculationPolicy", "PolicyInputs", "ThresholdPolicy", "VerifyPolicy",
           "available_policies", "make_policy", "register_policy"]
