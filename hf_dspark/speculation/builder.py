"""How a :class:`~hf_dspark.speculation.round.SpeculativeRound` is assembled, for ``generate`` and the serving
engine alike.

A round is a target, the drafter it runs (or none), a verify policy with the cost it prices rounds with, and, for
a policy that can weigh them, lookup proposals with the calibrator of their survival estimates. Both entry points
build their round with :class:`RoundBuilder`, so these rules hold for both:

* ``lookup="only"`` runs no drafter; lookup proposals are offered only to a policy that ``supports_lookup``;
* a lookup proposal is up to the block long for a short match and up to ``LONG_MATCH_TOKENS`` for a copy in
  progress, so a row may verify ``max_proposal`` drafts in a round;
* a proposer always comes with a calibrator: the caller's (shared across calls) or a fresh one;
* a cost the process measured itself is corrected by the rounds' wall time (``observe_time``); a caller's table
  is the caller's cost model and is used as it is.

What the two hand in differs, on purpose:

* the lookup history and calibrator: ``generate`` shares the target's history (read and written under the call's
  salt) and the salt's calibrator with later calls (``shared_state.py``); the engine keeps a history of its own,
  bounded by its ``lookup_history_tokens``, under which each request reads and writes with its salt's key (given
  per row), and a calibrator of its own;
* ``keep_idle_drafter``: ``generate`` hands the round its drafter even under a policy that never drafts, so the
  drafter context stays complete in the caches it keeps for later calls (entries keyed by that drafter); the
  engine drops such a drafter and spends nothing on its context.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..modeling.architectures import architecture_of
from ..scheduling.policies import VerifyPolicy, make_policy
from .lookup import LookupHistory, LookupHistoryKey, LookupProposer
from .lookup_calibration import LookupCalibrator
from .round import SpeculativeRound
from .shared_state import LONG_MATCH_TOKENS

#: ``lookup`` settings: lookup proposals beside the drafter, none, or lookup proposals without the drafter.
LOOKUP_MODES = (True, False, "only")


def raise_if_bad_lookup(lookup) -> None:
    if lookup not in LOOKUP_MODES:
        raise ValueError(f"lookup (generate's dspark_lookup) must be True, False or 'only' (lookup proposals without "
                         f"the drafter), got {lookup!r}")


def holds_croppable_context(drafter) -> bool:
    """Whether caches holding ``drafter``'s context (None: no drafter) may be kept for a later prompt that shares
    only a prefix: a block drafter's context can be cropped to any prefix, an autoregressive one's tail state
    describes the last position and cannot."""
    return drafter is None or not architecture_of(drafter.config).autoregressive


@dataclass
class RoundBuilder:
    """The parts of one round (see the module docstring); :meth:`build` assembles it.

    Args:
        target: the causal LM.
        drafter: the drafter for ``target`` (None: lookup proposals only, or plain decoding).
        policy (`VerifyPolicy | str`): a verify policy, or a registered name built with ``policy_kwargs``.
        lookup (`bool | "only"`, defaults to True): lookup proposals beside the drafter, none, or without it.
        history (`LookupHistory`, defaults to None): where lookup proposals copy earlier text from (None: each
            row's own text only).
        history_key (`LookupHistoryKey`, defaults to None): the key rows read and write the history under unless
            they give their own (None: rows without a key of their own do neither).
        calibrator (`LookupCalibrator`, defaults to None): lookup survival estimates to share (None: a fresh one).
        keep_idle_drafter (`bool`, defaults to False): hand the round the drafter under a policy that never drafts.
        sequential_top_k, max_deferred_rounds, verify_fn: passed to the round as they are.
    """

    target: object
    drafter: object
    policy: VerifyPolicy | str
    policy_kwargs: Mapping | None = None
    lookup: bool | str = True
    history: LookupHistory | None = None
    history_key: LookupHistoryKey | None = None
    calibrator: LookupCalibrator | None = None
    keep_idle_drafter: bool = False
    sequential_top_k: int | None = None
    max_deferred_rounds: int = 64
    verify_fn: Callable | None = None

    def __post_init__(self) -> None:
        raise_if_bad_lookup(self.lookup)
        if isinstance(self.policy, str):
            self.policy = make_policy(self.policy, **dict(self.policy_kwargs or {}))

    @property
    def block_size(self) -> int:
        return self.drafter.config.block_size if self.drafter is not None else 0

    @property
    def round_drafter(self):
        """The drafter the round runs: None for lookup only, and (unless ``keep_idle_drafter``) under a policy
        that never drafts."""
        if self.drafter is None or self.lookup == "only":
            return None
        if not self.keep_idle_drafter and not self.policy.max_drafts(self.block_size):
            return None
        return self.drafter

    @property
    def uses_lookup(self) -> bool:
        return bool(self.lookup) and self.policy.supports_lookup

    @property
    def max_drafts(self) -> int:
        """Drafter drafts one row may verify in a round (0: the round runs no drafter)."""
        return self.policy.max_drafts(self.block_size) if self.round_drafter is not None else 0

    @property
    def max_lookup(self) -> int:
        """Lookup drafts one row may verify in a round (0: no lookup proposals)."""
        return LONG_MATCH_TOKENS if self.uses_lookup else 0

    @property
    def max_proposal(self) -> int:
        """Drafts one row may verify in a round, from either source."""
        return max(self.max_drafts, self.max_lookup)

    def build(self, cost=None, *, observe_time: bool = False) -> tuple[SpeculativeRound, LookupProposer | None]:
        """The round and its lookup proposer (None without lookup proposals; the caller starts, feeds and ends its
        rows). ``cost``: a step-cost profile, an SPS table, a callable resolved on first use, or None."""
        proposer = None
        if self.uses_lookup:
            proposer = LookupProposer(self.history, self.history_key, max_tokens=max(self.block_size, 8),
                                      long_match_tokens=LONG_MATCH_TOKENS)
        calibrator = self.calibrator
        if proposer is not None and calibrator is None:
            calibrator = LookupCalibrator()
        round_ = SpeculativeRound(self.target, self.round_drafter, self.policy, cost=cost, verify_fn=self.verify_fn,
                                  observe_time=observe_time, sequential_top_k=self.sequential_top_k,
                                  max_deferred_rounds=self.max_deferred_rounds, lookup=proposer,
                                  calibrator=calibrator)
        return round_, proposer


__all__ = ["LOOKUP_MODES", "RoundBuilder", "holds_croppable_context", "raise_if_bad_lookup"]
