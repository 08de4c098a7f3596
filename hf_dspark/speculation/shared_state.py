"""What ``generate`` remembers across calls on one target, and who may share it.

Why: an agent loop is many short ``generate`` calls on a growing conversation. A call that forgot everything would
prefill the whole conversation again, copy nothing from the agent's earlier replies, and spend its first rounds
relearning what the drafter and lookup accept; the step cost would be read from disk every time.

Sharing follows vLLM's prefix caching: calls on the same target share by default (one default scope), and a caller
that serves several users gives each a *salt* (``dspark_cache_salt=``): calls with different salts never share
anything — neither the prefix cache, nor the lookup history, nor the scheduler's learned acceptance (timing), since
acceptance timing and cache hits can reveal another user's text. ``dspark_isolate=True`` shares nothing at all: the
call reads and leaves nothing and starts from a fresh scheduler. Only the measured step cost (the machine's, not
any text's) is shared by every call.

Everything is per target object (a weak reference: it goes with the target), bounded (the history's tokens, the
prefix cache's bytes and entries, :data:`MAX_SCOPES` salts' schedulers), and cleared by
``hf_dspark.disable(target)`` / :func:`forget`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

from ..scheduling.scheduled import ScheduledPolicy
from .lookup import LookupHistory
from .lookup_calibration import LookupCalibrator
from .prefix_cache import PrefixCacheStore

logger = logging.getLogger(__name__)

#: Lookup proposals per round: the block for short matches, up to this many for a copy in progress.
LONG_MATCH_TOKENS = 16
#: Tokens of earlier generations a target's lookup history keeps (all salts together).
HISTORY_TOKENS = 65_536
#: Salts whose schedulers a target keeps (least recently used dropped first).
MAX_SCOPES = 64
#: The scope of calls that give no salt.
DEFAULT_SALT = ""


def salt_scope(salt: str | None) -> str:
    """The scope name a salt's lookup history, scheduler and prefix caches are kept under: the default scope for
    None, a name no other salt maps to otherwise. Why not the salt itself: ``""`` would then be the default scope,
    and a user given an empty salt would share everything with the calls that give none."""
    return DEFAULT_SALT if salt is None else f"salt:{salt}"


@dataclass
class ScopeState:
    """What the calls of one salt share besides their caches: the scheduler's learned acceptance and step-time
    corrections (one per drafter and lookup mode) and the lookup drafts' calibration."""

    calibrator: LookupCalibrator = field(default_factory=LookupCalibrator)
    policies: dict = field(default_factory=dict)  # (drafter token, lookup mode) -> ScheduledPolicy

    def policy_for(self, drafter, lookup: bool | str = True) -> ScheduledPolicy:
        """The scheduler of calls with this drafter and lookup mode (``dspark_lookup``): one per mode, because its
        history is a record of decisions between the sources that mode offers — calls with lookup proposals that
        found the drafter not worth probing must not stop calls without them from drafting."""
        return self.policies.setdefault((_instance_number(drafter), lookup), ScheduledPolicy())


@dataclass
class SharedState:
    """One target's state across ``generate`` calls (see the module docstring)."""

    history: LookupHistory = field(default_factory=lambda: LookupHistory(max_tokens=HISTORY_TOKENS))
    costs: dict = field(default_factory=dict)  # (drafter token, rows, width, kernel) -> StepCostProfile
    reviewed: set = field(default_factory=set)  # ids of cached tables a call's steps confirmed
    prefixes: PrefixCacheStore = field(default_factory=PrefixCacheStore)  # (salt, drafter token) -> caches
    scopes: OrderedDict = field(default_factory=OrderedDict)  # salt -> ScopeState, least recently used first
    lock: threading.Lock = field(default_factory=threading.Lock)
    # held by a generate call while it plans, runs and books a round (the schedulers, calibrators and lookup history
    # are shared objects; concurrent calls take turns, each as if alone)
    round_lock: threading.RLock = field(default_factory=threading.RLock)

    def scope(self, salt: str | None) -> ScopeState:
        """The shared state of ``salt``'s calls (None: the default scope)."""
        salt = salt_scope(salt)
        with self.lock:
            state = self.scopes.pop(salt, None) or ScopeState()
            self.scopes[salt] = state
            while len(self.scopes) > MAX_SCOPES:
                self.scopes.popitem(last=False)
            return state

    def prefix_key(self, salt: str | None, drafter) -> tuple[str, int]:
        """Prefix-cache entries belong to a salt and to the drafter whose context they hold."""
        return salt_scope(salt), _instance_number(drafter)

    def cost_for(self, target, drafter, rows: int, width: int, cache_dir=None):
        """The measured step cost for up to ``rows`` rows × ``width`` tokens (profiled once per process and
        size; on disk across processes, see ``scheduling.step_cost.profile_step_cost``)."""
        from ..cpu_kernels import linear_kernel
        from ..scheduling.step_cost import profile_step_cost

        rows = 1 << max(rows - 1, 0).bit_length()  # powers of two: batches of 3 and 4 share a profile
        # the kernel the loop runs changes the cost
        key = (_instance_number(drafter), rows, width, linear_kernel(target))
        with self.lock:
            cost = self.costs.get(key)
        if cost is None:
            # no spot check of a cached table here: the call's own steps check it (``review_cost``)
            cost = profile_step_cost(target, drafter, max_rows=rows, max_width=width, cache_dir=cache_dir,
                                     recheck=False)
            with self.lock:
                self.costs[key] = cost
        return cost

    def review_cost(self, cost, observed_ratio: float | None) -> None:
        """After a call: a cached table its steps ran much faster than is dropped (and measured on next use); one
        that held up is not reviewed again in this process."""
        from ..scheduling.step_cost import discard_stale_profile

        if observed_ratio is None or id(cost) in self.reviewed:
            return
        if discard_stale_profile(cost, observed_ratio):
            with self.lock:
                for key in [k for k, v in self.costs.items() if v is cost]:
                    del self.costs[key]
        else:
            self.reviewed.add(id(cost))


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> SharedState
_NUMBERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # object -> its instance number
_LOCK = threading.Lock()
_COUNTER = itertools.count(1)


def shared_state_for(target) -> SharedState:
    """What calls on ``target`` share (created on first use, dropped with the target)."""
    with _LOCK:
        state = _STATES.get(target)
        if state is None:
            state = _STATES[target] = SharedState()
        return state


def forget(target) -> None:
    """Drop everything remembered for ``target`` (its lookup history included)."""
    with _LOCK:
        _STATES.pop(target, None)


def _instance_number(obj) -> int:
    """A per-process number for an object (not ``id()``: a later object at the same address gets a new one);
    0 for None (no drafter: lookup only)."""
    if obj is None:
        return 0
    with _LOCK:
        number = _NUMBERS.get(obj)
        if number is None:
            number = _NUMBERS[obj] = next(_COUNTER)
        return number


__all__ = ["DEFAULT_SALT", "HISTORY_TOKENS", "LONG_MATCH_TOKENS", "MAX_SCOPES", "ScopeState", "SharedState", "forget",
           "salt_scope", "shared_state_for"]
