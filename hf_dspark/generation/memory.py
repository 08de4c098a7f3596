"""What ``generate`` remembers across calls on one target: the verify policy's learned acceptance and step-time
corrections, the measured step cost, the lookup calibrator, the lookup history and the prefix cache.

Why: an agent loop is many short ``generate`` calls; a policy that forgot everything at every call would spend its
first rounds of each one relearning what the drafter accepts, and the step cost would be read from disk (and
spot-checked with a forward) every time. Everything here is per target object (a weak reference: it goes with the
target), bounded, and cleared by ``hf_dspark.disable(target)`` / :func:`forget`. The lookup history is used
only by calls that name a ``dspark_lookup_scope`` and shared only by calls with the same key (target, tokenizer,
that scope); calls without one read and leave nothing there. The same holds for the prefix cache (per scope and
drafter: ``prefix_cache.py``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from dataclasses import dataclass, field

from ..scheduling.policies import ScheduledPolicy
from .lookup import LookupHistory
from .lookup_calibration import LookupCalibrator
from .prefix_cache import PrefixCacheStore

logger = logging.getLogger(__name__)

#: Lookup proposals per round: the block for short matches, up to this many for a copy in progress.
LONG_MATCH_TOKENS = 16
#: Tokens of earlier generations a target's lookup history keeps (all scopes together).
HISTORY_TOKENS = 65_536


@dataclass
class SpeculationMemory:
    """One target's state across ``generate`` calls (policies per drafter; lookup state per target)."""

    history: LookupHistory = field(default_factory=lambda: LookupHistory(max_tokens=HISTORY_TOKENS))
    calibrator: LookupCalibrator = field(default_factory=LookupCalibrator)
    policies: dict = field(default_factory=dict)  # (drafter token, lookup mode) -> ScheduledPolicy
    costs: dict = field(default_factory=dict)  # (drafter token, rows, width, kernel) -> StepCostProfile
    prefixes: PrefixCacheStore = field(default_factory=PrefixCacheStore)  # (scope, drafter token) -> caches
    lock: threading.Lock = field(default_factory=threading.Lock)
    # held by a generate call while it plans, runs and books a round (the policy, calibrator and lookup history
    # above are shared by every call on the target; concurrent calls take turns, each as if alone)
    round_lock: threading.RLock = field(default_factory=threading.RLock)

    def policy_for(self, drafter, lookup: bool | str = True) -> ScheduledPolicy:
        """The scheduler of calls with this drafter and lookup mode (``dspark_lookup``): one per mode, because its
        history is a record of decisions between the sources that mode offers — calls with lookup proposals that
        found the drafter not worth probing must not stop calls without them from drafting (a benchmark's
        drafter-only arm, sharing the fused arm's scheduler, drafted 3 of 187 rounds where alone it drafted most)."""
        with self.lock:
            # generate calls come and go: a drafter that keeps not paying is probed less and less often (the
            # policy's default back-off)
            return self.policies.setdefault((_token(drafter), lookup), ScheduledPolicy())

    def prefix_key(self, scope: str, drafter) -> tuple[str, int]:
        """Prefix-cache entries belong to a caller scope and to the drafter whose context they hold."""
        return scope, _token(drafter)

    def cost_for(self, target, drafter, rows: int, width: int, cache_dir=None):
        """The measured step cost for up to ``rows`` rows × ``width`` tokens (profiled once per process and
        size; on disk across processes, see ``scheduling.step_cost.profile_step_cost``)."""
        from ..cpu_kernels import linear_kernel
        from ..scheduling.step_cost import profile_step_cost

        rows = 1 << max(rows - 1, 0).bit_length()  # powers of two: batches of 3 and 4 share a profile
        key = (_token(drafter), rows, width, linear_kernel(target))  # the kernel the loop runs changes the cost
        with self.lock:
            cost = self.costs.get(key)
        if cost is None:
            cost = profile_step_cost(target, drafter, max_rows=rows, max_width=width, cache_dir=cache_dir)
            with self.lock:
                self.costs[key] = cost
        return cost


_MEMORIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TOKENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_COUNTER = itertools.count(1)


def memory_for(target) -> SpeculationMemory:
    with _LOCK:
        memory = _MEMORIES.get(target)
        if memory is None:
            memory = _MEMORIES[target] = SpeculationMemory()
        return memory


def forget(target) -> None:
    """Drop everything remembered for ``target`` (its lookup history included)."""
    with _LOCK:
        _MEMORIES.pop(target, None)


def _token(obj) -> int:
    """A per-process number for an object (not ``id()``: a later object at the same address gets a new one);
    0 for None (no drafter: lookup only)."""
    if obj is None:
        return 0
    with _LOCK:
        token = _TOKENS.get(obj)
        if token is None:
            token = _TOKENS[obj] = next(_COUNTER)
        return token


__all__ = ["HISTORY_TOKENS", "LONG_MATCH_TOKENS", "SpeculationMemory", "forget", "memory_for"]
