"""Instruments for one speculative round's host cost (``round_overhead``): clocks, a host-sync and op counter, the
probe that splits a ``generate`` call into its prefill and its decode window, and oracles that fix acceptance.

The counter (:class:`SyncCounter`) counts device→host reads: on CUDA every synchronising call
(``torch.cuda.set_sync_debug_mode``); on CPU the calls that would sync on CUDA — ``Tensor.item / tolist / __bool__ /
__int__ / __float__ / __index__ / numpy / cpu / nonzero / equal``, ``torch.nonzero``, ``torch.equal`` and
``.to("cpu")`` — and host→device builds (``torch.tensor`` / ``as_tensor`` from Python data onto a named device), and
every aten op dispatched (views included): on a tiny model each op costs microseconds of host time whatever its size,
so the op count is the noise-free measure behind the host-time columns. The oracles replace the drafter's proposal
by the greedy continuation with the tail from slot k on corrupted, so exactly k drafts are accepted each round; the
drafter still runs first (its cost is part of the round).
"""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NUM_DRAFTS = 7  # γ: drafts proposed per round by every implementation
PROMPT_LEN = 16  # > γ + 1, so a prefill forward is told apart from a round by its width


# ---------------------------------------------------------------------------------------------------------
# Forward clocks and host-sync counters (installed only around the measured call)
# ---------------------------------------------------------------------------------------------------------
class Clock:
    """Accumulated seconds of a region: on CUDA device time (events); on CPU this process's CPU time, which on a
    shared machine stays close to what an idle one would take (wall time there counts other jobs' slices)."""

    def __init__(self, device: torch.device, counter: "SyncCounter | None" = None):
        self.cuda = device.type == "cuda"
        self.seconds, self.pairs, self._start = 0.0, [], None
        self.counter, self.ops, self._ops_start = counter, 0, 0  # aten ops inside the region (counting runs)

    def start(self) -> None:
        if self.counter is not None:
            self._ops_start = self.counter.ops
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.process_time()

    def stop(self) -> None:
        if self.counter is not None:
            self.ops += self.counter.ops - self._ops_start
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pairs.append((self._start, end))
        else:
            self.seconds += time.process_time() - self._start

    def total(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            self.seconds += sum(a.elapsed_time(b) for a, b in self.pairs) / 1e3
            self.pairs = []
        return self.seconds


class SyncCounter:
    """Counts host syncs while active (the module docstring says what counts on CPU and on CUDA)."""

    D2H_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "nonzero",
                   "equal")

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.d2h = self.h2d = self.ops = 0
        self._depth = 0
        self._host: dict[int, weakref.ref] = {}  # id -> tensor known to be host memory (see __enter__)
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "SyncCounter":
        self._stack.enter_context(_OpCountingMode(self))
        if self.cuda:
            self._stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("always")
            warnings.showwarning = self._on_warning
            torch.cuda.set_sync_debug_mode("warn")
            self._stack.callback(torch.cuda.set_sync_debug_mode, "default")
            return self
        # On CPU every tensor is host memory, so "a sync" is a read of a tensor that would live on the device:
        # tensors built from Python / numpy data and the results of a D2H copy (.cpu(), .to("cpu"), .numpy()) are
        # host tensors already, and reading them again costs nothing on CUDA either (they are not counted).
        for name in self.D2H_METHODS:
            self._patch(torch.Tensor, name, self._counting(getattr(torch.Tensor, name), "d2h",
                                                           marks_result=name in ("cpu", "numpy")))
        for name in ("nonzero", "equal"):
            self._patch(torch, name, self._counting(getattr(torch, name), "d2h"))
        original_to = torch.Tensor.to

        def to(tensor, *args, **kwargs):
            if "cpu" in args or kwargs.get("device") == "cpu":
                if not self._is_host(tensor):
                    self._count("d2h")
                return self._mark(original_to(tensor, *args, **kwargs))
            return original_to(tensor, *args, **kwargs)

        self._patch(torch.Tensor, "to", to)
        for name in ("tensor", "as_tensor", "from_numpy"):
            original = getattr(torch, name)

            def build(data, *args, _original=original, _name=name, **kwargs):
                # a copy to the device only where one is named (the inputs' device: CUDA on a GPU run); without
                # one the result is host memory on every machine, and from_numpy shares host memory
                if not isinstance(data, torch.Tensor) and kwargs.get("device") is not None:
                    self._count("h2d")
                result = _original(data, *args, **kwargs)
                on_host = kwargs.get("device") in (None, "cpu") and not (args and args[0] not in (None, "cpu"))
                return self._mark(result) if on_host and not isinstance(data, torch.Tensor) else result

            self._patch(torch, name, build)
        return self

    def _mark(self, tensor):
        if isinstance(tensor, torch.Tensor):
            self._host[id(tensor)] = weakref.ref(tensor)
        return tensor

    def _is_host(self, tensor) -> bool:
        ref = self._host.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
        return ref is not None and ref() is tensor

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _patch(self, owner, name: str, replacement) -> None:
        had_own = name in vars(owner)
        previous = vars(owner).get(name)
        setattr(owner, name, replacement)
        self._stack.callback(lambda: setattr(owner, name, previous) if had_own else delattr(owner, name))

    def _count(self, kind: str) -> None:
        if self._depth == 0:
            setattr(self, kind, getattr(self, kind) + 1)

    def _counting(self, original: Callable, kind: str, marks_result: bool = False) -> Callable:
        def counted(*args, **kwargs):
            if not (args and self._is_host(args[0])):
                self._count(kind)
            self._depth += 1  # a counted call that calls another (e.g. __contains__ -> item) counts once
            try:
                result = original(*args, **kwargs)
            finally:
                self._depth -= 1
            return self._mark(result) if marks_result else result
        return counted

    def _on_warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" in str(message).lower():
            self.d2h += 1


class _OpCountingMode(TorchDispatchMode):
    """Counts every aten op that is dispatched (views included): a noise-free measure of how much work a loop
    asks the framework for, which on a tiny model is most of its host time (each op costs microseconds to
    dispatch whatever its size)."""

    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counter.ops += 1
        return func(*args, **(kwargs or {}))


@dataclass
class RunMeasurement:
    """What one generate call measured inside its decode window (after the last prefill forward)."""

    rounds: int = 0
    window_s: float = 0.0
    window_cpu_s: float = 0.0  # this process's CPU time in the window
    forward_s: float = 0.0
    draft_s: float = 0.0
    syncs_loop: int | None = None
    syncs_forward: int | None = None
    h2d: int | None = None
    ops_loop: int | None = None  # aten ops outside the target forward and the drafter
    ops_forward: int | None = None
    ops_draft: int | None = None
    identical: bool = True  # the output is the greedy continuation
    on_cuda: bool = False


class Probe:
    """Forward hooks on the target plus the drafter clock: splits a call into prefill and the decode window."""

    def __init__(self, target, device: torch.device, counter: SyncCounter | None):
        self.target, self.device, self.counter = target, device, counter
        self.forward_clock, self.draft_clock = Clock(device, counter), Clock(device, counter)
        self.window_start = None
        self.rounds = 0
        self.syncs_at_window = self.h2d_at_window = 0
        self.syncs_in_forward = 0
        self._syncs_at_forward_start = 0
        self._width = 0
        self._handles = []

    def __enter__(self) -> "Probe":
        self._handles = [self.target.register_forward_pre_hook(self._pre, with_kwargs=True),
                         self.target.register_forward_hook(self._post)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def _pre(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._width = ids.shape[1] if ids is not None else kwargs["inputs_embeds"].shape[1]
        if self.counter is not None:
            self._syncs_at_forward_start = self.counter.d2h
        if self._width <= NUM_DRAFTS + 1:
            self.forward_clock.start()

    def _post(self, module, args, output) -> None:
        if self._width <= NUM_DRAFTS + 1:
            self.forward_clock.stop()
            self.rounds += 1
            if self.counter is not None:
                self.syncs_in_forward += self.counter.d2h - self._syncs_at_forward_start
            return
        if self.rounds:
            raise RuntimeError("a prefill-wide target forward after the first round: the window is ambiguous")
        # the window starts after the last prefill forward: everything a round costs, nothing the prompt costs
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.draft_clock = Clock(self.device, self.counter)
        self.forward_ops_at_window = self.forward_clock.ops
        if self.counter is not None:
            self.syncs_at_window, self.h2d_at_window = self.counter.d2h, self.counter.h2d
            self.ops_at_window = self.counter.ops
        self.window_start, self.window_cpu_start = time.perf_counter(), time.process_time()

    def measurement(self, end: float, end_cpu: float) -> RunMeasurement:
        m = RunMeasurement(rounds=self.rounds, window_s=end - self.window_start,
                           window_cpu_s=end_cpu - self.window_cpu_start, on_cuda=self.device.type == "cuda",
                           forward_s=self.forward_clock.total(), draft_s=self.draft_clock.total())
        if self.counter is not None:
            m.syncs_forward = self.syncs_in_forward
            m.syncs_loop = self.counter.d2h - self.syncs_at_window - self.syncs_in_forward
            m.h2d = self.counter.h2d - self.h2d_at_window
            m.ops_forward = self.forward_clock.ops - self.forward_ops_at_window
            m.ops_draft = self.draft_clock.ops
            m.ops_loop = self.counter.ops - self.ops_at_window - m.ops_forward - m.ops_draft
        return m


# ---------------------------------------------------------------------------------------------------------
# Oracles: the drafter runs, then its proposal is replaced by the continuation with a corrupted tail
# ---------------------------------------------------------------------------------------------------------
def corrupt_tail(tokens: torch.Tensor, num_right: int, vocab_size: int) -> torch.Tensor:
    """Slots ≥ num_right get a token that differs from the right one, so greedy verification rejects it."""
    tokens = tokens.clone()
    tokens[:, num_right:] = (tokens[:, num_right:] + 1) % vocab_size
    return tokens


@contextlib.contextmanager
def dspark_oracle(draft, continuation: torch.Tensor, num_right: int, probe: Probe) -> Iterator[None]:
    """Patch ``draft.draft_block`` (and time ``extend_context``) on the instance for one call.

    Row b of the batch is row b of ``continuation``: every row accepts the same count each round, so all rows
    stay in the batch until they all finish together. The anchor at position p is generated token
    p − PROMPT_LEN, so the drafts are continuation[p − PROMPT_LEN + 1 : … + γ] (gathered on the device)."""
    original_block, original_extend = draft.draft_block, draft.extend_context
    vocab_size = draft.config.vocab_size

    def draft_block(cache, anchor_ids, anchor_positions, **kwargs):
        probe.draft_clock.start()
        block = original_block(cache, anchor_ids, anchor_positions, **kwargs)
        probe.draft_clock.stop()
        if anchor_ids.shape[0] != continuation.shape[0]:
            raise RuntimeError("the oracle needs every row in the batch (rows finished at different rounds)")
        width = block.tokens.shape[1]
        start = (anchor_positions - PROMPT_LEN + 1)[:, None]
        index = (start + torch.arange(width, device=start.device)).clamp(max=continuation.shape[1] - 1)
        block.tokens = corrupt_tail(continuation.gather(1, index), num_right, vocab_size)
        return block

    def extend_context(*args, **kwargs):
        probe.draft_clock.start()
        try:
            return original_extend(*args, **kwargs)
        finally:
            probe.draft_clock.stop()

    draft.draft_block, draft.extend_context = draft_block, extend_context
    try:
        yield
    finally:
        del draft.draft_block, draft.extend_context  # back to the class's methods


@contextlib.contextmanager
def transformers_oracle(target, continuation: torch.Tensor, num_right: int, probe: Probe) -> Iterator[None]:
    """Patch the candidate generator transformers builds for this call (instance-scoped, one call)."""
    original_factory = target._get_candidate_generator
    vocab_size = target.config.vocab_size

    def factory(**kwargs):
        generator = original_factory(**kwargs)
        original = generator.get_candidates

        def get_candidates(input_ids, *args, **kw):
            probe.draft_clock.start()
            candidates, logits = original(input_ids, *args, **kw)
            probe.draft_clock.stop()
            num_new = candidates.shape[1] - input_ids.shape[1]
            if num_new > 0:
                done = input_ids.shape[1] - PROMPT_LEN  # shapes are host metadata: no sync
                drafts = corrupt_tail(continuation[:, done:done + num_new], num_right, vocab_size)
                candidates = torch.cat([input_ids, drafts], dim=1)
            return candidates, logits

        generator.get_candidates = get_candidates
        return generator

    target._get_candidate_generator = factory
    try:
        yield
    finally:
        del target._get_candidate_generator
