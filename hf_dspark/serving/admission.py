"""Admission and prefill: the engine's requests from submission until they join the running batch.

Requests wait in line and are admitted first come, first served while the padded reservation fits; admitted ones
are prefilled with caches of their own until they join the batch: prompts of similar length together in one
left-padded forward, long ones in chunks across steps. A request resuming after a failed decode step prefills its
prompt and committed tokens with its last token as the anchor again. A prefill that fails fails only its own
request: nothing of the running requests is touched.

The engine owns one :class:`Admission` and calls it through a few methods (queue, admit, prefill, take the requests
that leave before joining); it hands in at construction what admission needs and nothing else.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..modeling.draft_cache import DraftCache
from ..sampling import pick_tokens
from ..kv_cache import growing_cache
from ..speculation.round import prefill
from .batch import JoiningRows
from .fault_isolation import DecodeQuarantine
from .metrics import EngineMetrics
from .prefixes import RequestPrefixes
from .requests import FinishReason, Request

logger = logging.getLogger("hf_dspark.serving.engine")  # the engine's own log: one place to watch


@dataclass
class _Prefill:
    """A request's prompt in progress: its own target cache and drafter context until it joins the batch."""

    cache: DynamicCache
    draft_cache: DraftCache | None
    context: list[int]  # the prompt; for a request resuming after a failed step, prompt + tokens but the last
    num_done: int = 0
    first_token: int | None = None  # picked when the last chunk ran; a resuming request's last committed token
    resuming: bool = False


# Padding a group may add, beyond which its prompts are prefilled apart: a quarter of its prompt tokens, or for short
# prompts the tokens one more forward's fixed cost is worth. Why both: a padded token costs about as much as a
# prompt token, so long prompts gain nothing from sharing a forward with much padding, while for short prompts the
# fixed cost of a forward outweighs a few padded tokens.
MAX_PADDING_FRACTION = 0.25
PADDING_PER_EXTRA_ROW = 16


def padding_aware_groups(lengths: list[int], max_tokens: int, *, max_fraction: float = MAX_PADDING_FRACTION,
                         per_extra_row: int = PADDING_PER_EXTRA_ROW) -> list[list[int]]:
    """Split prompts (their ``lengths``) into groups prefilled in one left-padded forward each: prompts sorted by
    length, a group grown while its padded size (rows × longest) stays within ``max_tokens`` and its padding within
    ``max(max_fraction × its tokens, per_extra_row × (rows - 1))``. Returns indices into ``lengths``, in order within
    each group (rows join the batch first come, first served)."""
    groups: list[list[int]] = []
    total = 0
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        length = lengths[index]
        if groups:
            rows, tokens = len(groups[-1]) + 1, total + length  # the group if this prompt (its longest) joins
            padding = rows * length - tokens
            if rows * length <= max_tokens and padding <= max(max_fraction * tokens, per_extra_row * (rows - 1)):
                groups[-1].append(index)
                total = tokens
                continue
        groups.append([index])
        total = length
    return [sorted(group) for group in groups]


class Admission:
    """Waiting and prefilling requests (see the module docstring).

    Args:
        target: the causal LM the prompts are prefilled through.
        drafter: the drafter whose context the prefill extends (None: the engine's round runs no drafter).
        max_running_requests, max_batch_tokens, max_prefill_tokens: the engine's limits of the same names.
        max_proposal: drafts one row may verify in a round (a request reserves room for one round's overshoot).
        quarantine: who may be admitted while a failed decode step is traced (shared with the engine's decode).
        prefixes: kept caches a request's prompt may start from (None: the engine keeps none).
        metrics: the engine's counters; admission books the prefill's time, tokens and forwards, and first tokens.
        on_finished: called with a request that ended here (its first token finished it, or its prefill failed).
    """

    def __init__(self, target, drafter, *, max_running_requests: int, max_batch_tokens: int, max_prefill_tokens: int,
                 max_proposal: int, quarantine: DecodeQuarantine, prefixes: RequestPrefixes | None,
                 metrics: EngineMetrics, on_finished: Callable[[Request], None]):
        self.target, self.drafter = target, drafter
        self.device = next(target.parameters()).device
        self.max_running_requests, self.max_batch_tokens = max_running_requests, max_batch_tokens
        self.max_prefill_tokens, self.max_proposal = max_prefill_tokens, max_proposal
        self._quarantine, self._prefixes, self._metrics = quarantine, prefixes, metrics
        self._on_finished = on_finished
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []

    # -- the queues ----------------------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling)

    def add(self, requests: Sequence[Request]) -> None:
        """New requests, at the back of the line in submission order."""
        self.waiting.extend(requests)

    def resume_first(self, requests: Sequence[Request]) -> None:
        """Requests resuming after a failed decode step: first in line, in their order."""
        self.waiting.extendleft(reversed(requests))

    def take_cancelled(self) -> list[Request]:
        """Remove and return the cancelled requests (waiting ones first)."""
        taken = []
        for queue in (self.waiting, self.prefilling):
            for request in [r for r in queue if r.cancel_requested]:
                queue.remove(request)
                taken.append(request)
        return taken

    def take_prefilling(self) -> list[Request]:
        """Remove and return the requests being prefilled (a failed step ends them; the waiting stay in line)."""
        taken, self.prefilling = self.prefilling, []
        return taken

    def take_all(self) -> list[Request]:
        """Remove and return every request, waiting ones first (the engine stops)."""
        taken = [*self.waiting, *self.prefilling]
        self.waiting.clear()
        self.prefilling = []
        return taken

    # -- admission -----------------------------------------------------------------------------------------------
    def reservation(self, request: Request) -> int:
        """Cache slots a request can occupy at most: prompt, generated tokens, and one round of overshoot."""
        return request.num_prompt_tokens + request.params.max_new_tokens + self.max_proposal + 1

    def reserved_slots(self, running: Sequence[Request]) -> int:
        """Slots the admitted requests (prefilling and ``running``) may occupy in the padded batch: rows × widest
        reservation."""
        admitted = [*self.prefilling, *running]
        return len(admitted) * max((self.reservation(r) for r in admitted), default=0)

    def admit(self, running: Sequence[Request]) -> None:
        """FCFS: start prefilling waiting requests while the padded reservation (rows × widest reservation, the
        ``running`` ones included) fits ``max_batch_tokens``."""
        admitted = [*self.prefilling, *running]
        widest = max((self.reservation(r) for r in admitted), default=0)
        while self.waiting and len(admitted) < self.max_running_requests:
            request = self.waiting[0]
            if not self._quarantine.may_admit(request, admitted):
                break
            need = max(widest, self.reservation(request))
            if (len(admitted) + 1) * need > self.max_batch_tokens:
                break
            self.waiting.popleft()
            widest = need
            if request.admit_time is None:
                request.admit_time = time.perf_counter()
            request.prefill = self._new_prefill(request)
            self.prefilling.append(request)
            admitted.append(request)

    def _new_prefill(self, request: Request) -> _Prefill:
        """Prefill state for a new request (its prompt) or one resuming after a failed decode step (prompt and
        committed tokens; its last token is the anchor again, nothing is sampled or committed twice)."""
        reused = self._prefixes.reuse(request) if self._prefixes is not None else None
        if reused is not None:  # an earlier request of its salt left the caches of this prompt's first `done` tokens
            entry, done = reused
            self._metrics.reused_prompt_tokens += done
            return _Prefill(entry.cache, entry.draft_cache if self.drafter is not None else None,
                            context=list(request.prompt_ids), num_done=done)
        caches = (growing_cache(self.target.config), DraftCache() if self.drafter is not None else None)
        if not request.tokens:
            return _Prefill(*caches, context=list(request.prompt_ids))
        return _Prefill(*caches, context=request.prompt_ids + request.tokens[:-1], first_token=request.tokens[-1],
                        resuming=True)

    # -- prefill -------------------------------------------------------------------------------------------------
    def prefill(self, tap) -> list[JoiningRows]:
        """Advance prompts by up to ``max_prefill_tokens`` in total; completed ones get their first token and are
        returned ready to join the batch.

        Prompts that start and finish within this step's budget run in left-padded groups of similar length
        (:func:`padding_aware_groups`): on a small target a forward's fixed cost is a large part of a short
        prompt's prefill, but padding costs as much as a prompt token. Longer prompts are prefilled alone, in
        chunks across steps. A prefill that fails fails only its own request (a failed group is retried one
        request at a time): prompts have their own caches until they join the batch, so nothing of the running
        requests is touched."""
        start = time.perf_counter()
        budget, joining, whole = self.max_prefill_tokens, [], []
        for request in list(self.prefilling):
            if budget <= 0:
                break
            state = request.prefill
            num_tokens = min(budget, len(state.context) - state.num_done)
            budget -= num_tokens
            if state.num_done == 0 and num_tokens == len(state.context) and not state.resuming:
                whole.append(request)
            else:
                joining.extend(self._prefill_alone(request, num_tokens, tap))
        for group in padding_aware_groups([len(r.prefill.context) for r in whole], self.max_prefill_tokens):
            together = [whole[i] for i in group]
            if len(together) == 1:  # alone: no padding, no mask
                joining.extend(self._prefill_alone(together[0], len(together[0].prefill.context), tap))
                continue
            try:
                joining.append(self._prefill_together(together, tap))
            except Exception:
                logger.exception("a grouped prefill failed; prefilling its %d requests one by one", len(together))
                for request in together:
                    request.prefill = self._new_prefill(request)
                    joining.extend(self._prefill_alone(request, len(request.prefill.context), tap))
        self._metrics.prefill_seconds += time.perf_counter() - start
        return joining

    def _prefill_alone(self, request: Request, num_tokens: int, tap) -> list[JoiningRows]:
        """One chunk of one prompt; the request joins when its prompt is done. A failure fails this request only."""
        state = request.prefill
        try:
            self._prefill_chunk(request, state, num_tokens, tap)
        except Exception as err:
            logger.exception("prefill of request %s failed; only this request fails", request.request_id)
            self.prefilling.remove(request)
            request.finish(FinishReason.ERROR, error=err)
            self._on_finished(request)
            return []
        if state.num_done < len(state.context):
            return []
        return [self._finish_prefill([request], state.cache, None, state.draft_cache, [state.first_token])]

    def _prefill_chunk(self, request: Request, state: _Prefill, num_tokens: int, tap) -> None:
        """One chunk of a prompt through the target (its own cache); the last chunk picks the first token."""
        begin, end = state.num_done, state.num_done + num_tokens
        ids = torch.tensor([state.context[begin:end]], device=self.device)
        positions = torch.arange(begin, end, device=self.device)[None]
        # the token after the chunk: the prompt's next one, or for the last chunk of a resumption its anchor
        following_id = state.context[end] if end < len(state.context) else (
            state.first_token if state.resuming else None)
        following = None if following_id is None else torch.tensor([following_id], device=self.device)
        _, token, state.draft_cache = prefill(
            self.target, ids, positions, state.cache, following_ids=following,
            pick_first=lambda logits: torch.tensor([self._first_token(request, logits)], device=self.device),
            tap=tap, drafter=self.drafter, draft_cache=state.draft_cache, counts=[num_tokens])
        state.num_done = end
        if following is None:
            state.first_token = int(token[0])
        self._metrics.prefill_tokens += num_tokens
        self._metrics.prefill_forwards += 1

    def _prefill_together(self, requests: list[Request], tap) -> JoiningRows:
        """Whole prompts of several requests in one forward, left-padded (as batched ``generate`` prefills)."""
        width = max(r.num_prompt_tokens for r in requests)
        ids = torch.zeros(len(requests), width, dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        for row, request in enumerate(requests):
            ids[row, width - request.num_prompt_tokens:] = torch.tensor(request.prompt_ids, device=self.device)
            mask[row, width - request.num_prompt_tokens:] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = growing_cache(self.target.config)
        firsts: list[int] = []

        def pick_first(logits: torch.Tensor) -> torch.Tensor:
            firsts.extend(self._first_token(r, logits[row:row + 1]) for row, r in enumerate(requests))
            return torch.tensor(firsts, device=self.device)

        _, _, draft_cache = prefill(self.target, ids, positions, cache, pick_first=pick_first, attention_mask=mask,
                                    tap=tap, drafter=self.drafter,
                                    draft_cache=DraftCache() if self.drafter is not None else None,
                                    valid=mask.bool(), counts=[r.num_prompt_tokens for r in requests])
        for request in requests:
            request.prefill.num_done = request.num_prompt_tokens
        self._metrics.prefill_tokens += sum(r.num_prompt_tokens for r in requests)
        self._metrics.prefill_forwards += 1
        return self._finish_prefill(requests, cache, mask, draft_cache, firsts)

    def _finish_prefill(self, requests: list[Request], cache: DynamicCache, mask: torch.Tensor | None,
                        draft_cache: DraftCache | None, first_tokens: list[int]) -> JoiningRows:
        """Commit each prefilled request's first token; those that already finished (max_new_tokens = 1 or an EOS
        first token) never join the batch, the others are returned ready to be stacked onto it."""
        now = time.perf_counter()
        keep = []
        for row, (request, first) in enumerate(zip(requests, first_tokens)):
            self.prefilling.remove(request)
            resuming, request.prefill = request.prefill.resuming, None
            if resuming:  # its tokens were committed (and its lookup row kept) before the failed step
                keep.append((row, request, first))
                continue
            self._metrics.generated_tokens += request.commit([first], now)
            if request.is_finished:
                self._on_finished(request)
            else:
                keep.append((row, request, first))
        mask = torch.ones(1, cache.get_seq_length(), dtype=torch.long, device=self.device) if mask is None else mask
        if len(keep) < len(requests) and keep:
            rows = [row for row, _, _ in keep]
            cache.batch_select_indices(torch.tensor(rows, dtype=torch.long, device=self.device))
            mask = mask[rows]
            draft_cache = draft_cache.select_rows(rows) if draft_cache is not None else None
        return JoiningRows([r for _, r, _ in keep], cache, mask, draft_cache, [f for _, _, f in keep],
                           [r.num_prompt_tokens + max(len(r.tokens) - 1, 0) for _, r, _ in keep])

    def _first_token(self, request: Request, logits: torch.Tensor) -> int:
        """The prompt's next token, exactly as plain ``generate`` picks it (processors, request's generator)."""
        if request.params.do_sample:
            logits = request.processors(torch.tensor([request.prompt_ids], device=self.device), logits)
        return int(pick_tokens(logits, request.params.do_sample, request.generator)[0])


__all__ = ["Admission", "padding_aware_groups"]
