"""Which request a failed decode step is traced to, and who may join the batch while that is found out.

Why: a decode step runs every running request through one forward, so when it raises, the failure belongs to the
step, not to a request; failing all of them would let one request take down its neighbours. The engine drops the
batch instead (a forward that raised may have half-written the cache) and the requests resume from their
committed tokens. A request that was in a failed step is a *suspect*: suspects rejoin one at a time, each only
when every other row has completed a step since it joined, so if such a step fails too, the one row that had not
is the cause and fails alone. A single request whose step fails is the cause by itself. A fault that is nobody's
(a transient one) costs each request a re-prefill, not its output.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from .requests import Request


class DecodeQuarantine:
    """Book-keeping only (the engine drops the batch, requeues and fails): weak sets, so finished requests leave."""

    def __init__(self):
        self._verified: weakref.WeakSet[Request] = weakref.WeakSet()  # completed a step since they (re)joined
        self._suspects: weakref.WeakSet[Request] = weakref.WeakSet()  # were in a failed step, not cleared yet

    def after_success(self, rows: Sequence[Request]) -> None:
        for request in rows:
            self._verified.add(request)
            self._suspects.discard(request)

    def after_failure(self, rows: Sequence[Request]) -> tuple[Request | None, list[Request]]:
        """(the request the failure is traced to or None, the requests that resume, in order)."""
        unverified = [r for r in rows if r not in self._verified]
        if len(rows) == 1:
            culprit = rows[0]
        elif len(unverified) == 1 and unverified[0] in self._suspects:
            culprit = unverified[0]
        else:
            culprit = None
        resume = [r for r in rows if r is not culprit]
        for request in resume:
            self._verified.discard(request)  # it rejoins with a fresh cache: unverified again
            self._suspects.add(request)
        if culprit is not None:
            self._suspects.discard(culprit)
        return culprit, resume

    def may_admit(self, request: Request, admitted: Sequence[Request]) -> bool:
        """Whether ``request`` may start (re)prefilling now, beside the ``admitted`` ones (prefilling + running)."""
        if any(r in self._suspects and r not in self._verified for r in admitted):
            return False  # a suspect's first step must run with every other row past a successful step
        if request in self._suspects:
            return all(r in self._verified for r in admitted)
        return True

    @property
    def num_suspects(self) -> int:
        return len(self._suspects)


__all__ = ["DecodeQuarantine"]
