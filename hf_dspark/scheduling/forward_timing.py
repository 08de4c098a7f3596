"""Timing the target's verify forwards and the drafter's passes on this machine, the way the loop runs them: padded
rows on top of a prefilled KV cache, the drafter between target forwards. The measured tables are assembled in
``step_cost.py``; here is only how one cell is timed.

Interference from other processes only ever adds time, so every timing keeps the fastest of its repeats, and
repeats go in passes over the cells: on a shared machine interference comes in bursts, and a burst that lands on
all of one cell's repeats would make that cell look dear for as long as the table is cached.
"""

from __future__ import annotations

import copy
import functools
import math
import time
from collections.abc import Callable, Sequence

import torch

from ..kv_cache import growing_cache
from ..modeling.target_support import cache_kwarg
from .cost_tables import verify_batch_shape

# Timed drafter passes per row count (at least; a pass costs milliseconds): a pass is short enough that a few
# samples can all land on interference, even between target forwards.
DRAFT_PASS_REPEATS = 10


def time_verify_forward(target, num_tokens: int, *, context_len: int, row_len: int, repeats: int,
                        device: torch.device, generator: torch.Generator) -> float:
    """Wall time (s) of one verify forward over B tokens (laid out in rows of ≤ ``row_len``) on top of a prefilled KV
    cache of ``context_len``: the fastest of ``repeats`` after a warm-up."""
    rows, length = verify_batch_shape(num_tokens, row_len)
    return time_padded_verify(target, rows, length, context_len=context_len, repeats=repeats, device=device,
                              generator=generator)


def time_padded_verify(target, rows: int, length: int, *, context_len: int, repeats: int, device: torch.device,
                       generator: torch.Generator) -> float:
    """Wall time (s) of one verify forward of ``rows`` rows × ``length`` tokens, each row on top of its own
    prefilled KV cache of ``context_len`` tokens (the engine's padded layout)."""
    return time_padded_verify_widths(target, rows, [length], context_len=context_len, repeats=repeats, device=device,
                                     generator=generator)[0]


@torch.inference_mode()
def prefill_context(target, context_len: int, *, device: torch.device, generator: torch.Generator):
    """A one-row cache holding ``context_len`` random tokens, the context every verify timing sits on: the growing
    cache the loop runs on (appends in place), so the timings price the loop's own appends."""
    vocab = target.config.get_text_config().vocab_size
    context = torch.randint(0, vocab, (1, context_len), generator=generator).to(device)
    cache = growing_cache(target.config)
    target(input_ids=context, use_cache=True, **{cache_kwarg(target): cache})
    return cache


@torch.inference_mode()
def time_padded_verify_widths(target, rows: int, widths: Sequence[int], *, context_len: int, repeats: int,
                              device: torch.device, generator: torch.Generator, budget_s: float = math.inf,
                              context=None, on_width=None) -> list[float]:
    """:func:`time_padded_verify` for several widths on one prefilled context (``context``, a one-row
    :func:`prefill_context` cache that is copied, not changed; prefilled here when None): one untimed warm-up
    forward, then up to ``repeats`` passes over the widths, one timed forward of each per pass; a width drops out
    of later passes once its timed forwards took ``budget_s`` (a long forward's minimum needs fewer samples).
    ``on_width()`` runs as each width finishes.

    Passes, not one width's repeats back to back: on a shared machine interference comes in bursts of seconds,
    and a burst that lands on all of one width's repeats makes that width look dear for as long as the table is
    cached; across passes a burst costs every width one sample, and the minimum discards it."""
    vocab = target.config.get_text_config().vocab_size
    cache = copy.deepcopy(context) if context is not None else prefill_context(target, context_len, device=device,
                                                                                generator=generator)
    cache_name = cache_kwarg(target)
    cache.batch_repeat_interleave(rows)
    inputs = [(torch.randint(0, vocab, (rows, length), generator=generator).to(device),
               (context_len + torch.arange(length, device=device)).expand(rows, -1)) for length in widths]

    def forward(j: int) -> float:
        ids, positions = inputs[j]
        synchronize(device)
        start = time.perf_counter()
        target(input_ids=ids, position_ids=positions, use_cache=True, **{cache_name: cache})
        synchronize(device)
        seconds = time.perf_counter() - start
        cache.crop(-ids.shape[1])  # transformers >= 5.24: negative = number of tokens to drop
        return seconds

    if widths:
        forward(0)  # the very first forward is a warm-up and is not timed
    times: list[list[float]] = [[] for _ in widths]
    active = list(range(len(widths)))
    for repeat in range(max(repeats, 1)):
        for j in active:
            times[j].append(forward(j))
        last_pass = repeat == max(repeats, 1) - 1
        finished = [j for j in active if last_pass or sum(times[j]) >= budget_s]
        active = [j for j in active if j not in finished]
        for _ in finished if on_width is not None else ():
            on_width()
        if not active:
            break
    return [_robust_seconds(t) for t in times]


def _robust_seconds(times: Sequence[float]) -> float:
    """The fastest of the timed repeats: interference from other processes only ever adds time, so on a shared
    machine the minimum is the best estimate of what the forward costs (a median still absorbs one stall in
    three repeats, and a profile measured under load would steer every later decision)."""
    return min(times)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a timing must end when the forward has run, not when it was queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def time_draft_pass(draft, rows: int, *, context_len: int, repeats: int, device: torch.device,
                    generator: torch.Generator, budget_s: float = math.inf) -> float:
    """Wall time (s) of one batched ``draft_block`` for ``rows`` requests with ``context_len`` context
    (``repeats`` timed passes after a warm-up, fewer once they took ``budget_s``), timed back to back.
    ``profile_step_cost`` times the drafter between target forwards instead, as the loop runs it."""
    run = _draft_pass(draft, rows, context_len=context_len, device=device, generator=generator)
    times = []
    for i in range(repeats + 1):  # the first pass is a warm-up
        seconds = _timed(run, device)
        if i:
            times.append(seconds)
            if sum(times) >= budget_s:
                break
    return _robust_seconds(times)


def _draft_pass(draft, rows: int, *, context_len: int, device: torch.device,
                generator: torch.Generator) -> Callable[[], object]:
    """One batched drafter pass for ``rows`` requests on ``context_len`` tokens of random context, ready to run."""
    from ..modeling.draft_cache import DraftCache

    features = torch.randn(rows, context_len, draft.fc.in_features, generator=generator).to(
        device=device, dtype=draft.fc.weight.dtype)
    positions = torch.arange(context_len, device=device).expand(rows, -1)
    # next_ids: what an autoregressive drafter pairs each position with (block drafters ignore them)
    next_ids = torch.randint(0, draft.config.vocab_size, positions.shape, generator=generator).to(device)
    cache = draft.extend_context(DraftCache(), features, positions, next_ids=next_ids, packed=True)  # as the round
    vocab = draft.config.vocab_size
    anchors = torch.randint(0, vocab, (rows,), generator=generator).to(device)
    anchor_positions = torch.full((rows,), context_len, device=device)
    return functools.partial(draft.draft_block, cache, anchors, anchor_positions, confidence_threshold=0.0,
                             context_precedes_anchors=True)


def _timed(run: Callable[[], object], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - start


@torch.inference_mode()
def time_draft_passes(target, draft, rows: list[int], *, context_len: int, repeats: int, device: torch.device,
                      generator: torch.Generator, budget_s: float) -> list[float]:
    """Wall time (s) of the drafter's pass for each row count as the loop runs it: between target forwards. Timed
    back to back a pass can cost far more than in the loop (caches and the CPU's state are the drafter's alone), and
    priced at that drafting would be skipped where it pays. Each timed pass follows a 1-token verify forward of as
    many rows; passes go over every row count in turn (a burst of interference costs
    each one sample, as in :func:`time_padded_verify_widths`), at least ``DRAFT_PASS_REPEATS`` of them, a row
    count dropping out once its timed passes took ``budget_s``; the minimum is kept."""
    context = prefill_context(target, context_len, device=device, generator=generator)
    vocab = target.config.get_text_config().vocab_size
    cache_name = cache_kwarg(target)
    steps = []
    for r in rows:
        cache = copy.deepcopy(context)
        cache.batch_repeat_interleave(r)
        ids = torch.randint(0, vocab, (r, 1), generator=generator).to(device)
        positions = torch.full((r, 1), context_len, device=device)
        forward = functools.partial(target, input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1,
                                    **{cache_name: cache})

        def verify(forward=forward, cache=cache) -> None:
            forward()
            cache.crop(-1)  # the context stays context_len long, however many passes are timed

        steps.append((verify, _draft_pass(draft, r, context_len=context_len, device=device, generator=generator)))
    times: list[list[float]] = [[] for _ in rows]
    active = list(range(len(rows)))
    for i in range(max(repeats, DRAFT_PASS_REPEATS) + 1):  # the first pass is a warm-up
        for j in active:
            verify, run = steps[j]
            verify()
            seconds = _timed(run, device)
            if i:
                times[j].append(seconds)
        active = [j for j in active if sum(times[j]) < budget_s]
        if not active:
            break
    return [_robust_seconds(t) for t in times]


__all__ = ["DRAFT_PASS_REPEATS", "prefill_context", "synchronize", "time_draft_pass", "time_draft_passes",
           "time_padded_verify", "time_padded_verify_widths", "time_verify_forward"]
