"""A fake ``time.perf_counter`` for tests that profile a model: the machine they describe, not the one they run on.

On it a target forward over R rows × W tokens takes ``fixed + per_token · R · W`` seconds and a drafter pass
``draft_per_row`` seconds per row; every reading of the clock adds ``tick`` (so nothing takes no time at all).
Profiling then measures the same table on every run, however busy the real machine is.
"""

from __future__ import annotations

import functools
import time


class ForwardClock:
    def __init__(self, fixed: float = 1e-3, per_token: float = 1e-4, draft_per_row: float = 5e-4,
                 tick: float = 1e-7):
        self.fixed, self.per_token, self.draft_per_row, self.tick = fixed, per_token, draft_per_row, tick
        self.now = 0.0

    def __call__(self) -> float:
        self.now += self.tick
        return self.now

    def install(self, monkeypatch, target, draft=None) -> "ForwardClock":
        """Make ``time.perf_counter`` this clock for the test, and ``target`` (and ``draft``) advance it."""
        monkeypatch.setattr(time, "perf_counter", self)

        real_forward = target.forward

        @functools.wraps(real_forward)  # keeps its signature: the cache argument's name is read from it
        def forward(*args, **kwargs):
            ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            self.now += self.fixed + self.per_token * ids.numel()
            return real_forward(*args, **kwargs)

        monkeypatch.setattr(target, "forward", forward)
        if draft is not None:
            draft_block = draft.draft_block

            def timed_draft_block(cache, anchors, *args, **kwargs):
                self.now += self.draft_per_row * anchors.shape[0]
                return draft_block(cache, anchors, *args, **kwargs)

            monkeypatch.setattr(draft, "draft_block", timed_draft_block)
        return self
