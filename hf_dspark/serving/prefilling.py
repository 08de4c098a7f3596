"""Admission and prefill of the engine's requests (a part of :class:`~hf_dspark.serving.engine.DSparkEngine`).

Requests are admitted first come, first served while the padded reservation fits, and prefilled with their own
caches until they join the running batch: prompts of similar length together in one left-padded forward, long
ones in chunks across steps. A request resuming after a failed decode step prefills its prompt and committed tokens
with its last token as the anchor again. A prefill that fails fails only its own request: nothing of the running
requests is touched.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..speculation.kv_cache import growing_cache
from ..speculation.lookup import LookupHistoryKey
from ..speculation.round import prefill
from ..modeling.draft_cache import DraftCache
from ..sampling import pick_tokens
from .batch import JoiningRows
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
# prompts the tokens one more forward's fixed cost is worth. Measured with SmolLM2-135M on 2 CPU cores (AVX-512): a
# padded token costs as much as a prompt token (8 prompts padded 1.5-1.6× ran 1.03-1.33× slower than one by one),
# while 4 prompts of 53-87 tokens together took 0.72× their separate forwards.
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


class PrefillMixin:
    """DSparkEngine's admission and prefill (its state lives on the engine: queues, batch, metrics, models)."""

    def _reserved_slots(self) -> int:
        """Slots the admitted requests may occupy in the padded batch: rows × widest reservation."""
        admitted = self._prefilling + self._batch.live_requests
        return len(admitted) * max((self._reservation(r.num_prompt_tokens, r.params) for r in admitted), default=0)

    def _admit(self) -> None:
        """FCFS: admit while the padded reservation (rows × widest reservation) fits ``max_batch_tokens``."""
        admitted = self._prefilling + self._batch.live_requests
        widest = max((self._reservation(r.num_prompt_tokens, r.params) for r in admitted), default=0)
        while self._waiting and len(admitted) < self.max_running_requests:
            request = self._waiting[0]
            if not self._quarantine.may_admit(request, admitted):
                break
            need = max(widest, self._reservation(request.num_prompt_tokens, request.params))
            if (len(admitted) + 1) * need > self.max_batch_tokens:
                break
            self._waiting.popleft()
            widest = need
            if request.admit_time is None:
                request.admit_time = time.perf_counter()
            request.prefill = self._new_prefill(request)
            self._prefilling.append(request)
            admitted = admitted + [request]

    def _new_prefill(self, request: Request) -> _Prefill:
        """Prefill state for a new request (its prompt) or one resuming after a failed decode step (prompt and
        committed tokens; its last token is the anchor again, nothing is sampled or committed twice)."""
        reused = self._reused_prefix(request)
        if reused is not None:  # an earlier request of its salt left the caches of this prompt's first `done` tokens
            entry, done = reused
            return _Prefill(entry.cache, entry.draft_cache if self.draft_width else None,
                            context=list(request.prompt_ids), num_done=done)
        caches = (growing_cache(self.target.config), DraftCache() if self.draft_width else None)
        if not request.tokens:
            return _Prefill(*caches, context=list(request.prompt_ids))
        return _Prefill(*caches, context=request.prompt_ids + request.tokens[:-1], first_token=request.tokens[-1],
                        resuming=True)

    def _prefill(self, tap) -> list[JoiningRows]:
        """Advance prompts by up to ``max_prefill_tokens`` in total; completed ones get their first token.

        Prompts that start and finish within this step's budget run in left-padded groups of similar length
        (:func:`padding_aware_groups`): on a small target a forward's fixed cost is a large part of a short
        prompt's prefill, but padding costs as much as a prompt token. Longer prompts are prefilled alone, in
        chunks across steps. A prefill that fails fails only its own request (a failed group is retried one
        request at a time): prompts have their own caches until they join the batch, so nothing of the running
        requests is touched."""
        start = time.perf_counter()
        budget, joining, whole = self.max_prefill_tokens, [], []
        for request in list(self._prefilling):
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
        self.engine_metrics.prefill_seconds += time.perf_counter() - start
        return joining

    def _prefill_alone(self, request: Request, num_tokens: int, tap) -> list[JoiningRows]:
        """One chunk of one prompt; the request joins when its prompt is done. A failure fails this request only."""
        state = request.prefill
        try:
            self._prefill_chunk(request, state, num_tokens, tap)
        except Exception as err:
            logger.exception("prefill of request %s failed; only this request fails", request.request_id)
            self._prefilling.remove(request)
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
            tap=tap, drafter=self.draft if self.draft_width else None, draft_cache=state.draft_cache,
            counts=[num_tokens])
        state.num_done = end
        if following is None:
            state.first_token = int(token[0])
        self.engine_metrics.prefill_tokens += num_tokens
        self.engine_metrics.prefill_forwards += 1

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
                                    tap=tap, drafter=self.draft if self.draft_width else None,
                                    draft_cache=DraftCache() if self.draft_width else None, valid=mask.bool(),
                                    counts=[r.num_prompt_tokens for r in requests])
        for request in requests:
            request.prefill.num_done = request.num_prompt_tokens
        self.engine_metrics.prefill_tokens += sum(r.num_prompt_tokens for r in requests)
        self.engine_metrics.prefill_forwards += 1
        return self._finish_prefill(requests, cache, mask, draft_cache, firsts)

    def _finish_prefill(self, requests: list[Request], cache: DynamicCache, mask: torch.Tensor | None,
                        draft_cache: DraftCache | None, first_tokens: list[int]) -> JoiningRows:
        """Commit each prefilled request's first token; those that already finished (max_new_tokens = 1 or an EOS
        first token) never join the batch, the others are returned ready to be stacked onto it."""
        now = time.perf_counter()
        keep = []
        for row, (request, first) in enumerate(zip(requests, first_tokens)):
            self._prefilling.remove(request)
            resuming, request.prefill = request.prefill.resuming, None
            if resuming:  # its tokens were committed (and its lookup row kept) before the failed step
                keep.append((row, request, first))
                continue
            self.engine_metrics.generated_tokens += request.commit([first], now)
            if request.is_finished:
                self._on_finished(request)
            else:
                keep.append((row, request, first))
                self._start_lookup_row(request)
        mask = torch.ones(1, cache.get_seq_length(), dtype=torch.long, device=self.device) if mask is None else mask
        if len(keep) < len(requests) and keep:
            rows = [row for row, _, _ in keep]
            cache.batch_select_indices(torch.tensor(rows, dtype=torch.long, device=self.device))
            mask = mask[rows]
            draft_cache = draft_cache.select_rows(rows) if draft_cache is not None else None
        return JoiningRows([r for _, r, _ in keep], cache, mask, draft_cache, [f for _, _, f in keep],
                           [r.num_prompt_tokens + max(len(r.tokens) - 1, 0) for _, r, _ in keep])

    def _start_lookup_row(self, request: Request) -> None:
        if self._lookup is None:
            return
        salt = request.params.cache_salt
        key = None if request.params.isolate else LookupHistoryKey.for_model(self.target, self.tokenizer, salt or "")
        self._lookup.start_row(request.request_id, request.prompt_ids + request.tokens, history_key=key)
        request.lookup_row = True

    def _first_token(self, request: Request, logits: torch.Tensor) -> int:
        """The prompt's next token, exactly as plain ``generate`` picks it (processors, request's generator)."""
        if request.params.do_sample:
            logits = request.processors(torch.tensor([request.prompt_ids], device=self.device), logits)
        return int(pick_tokens(logits, request.params.do_sample, request.generator)[0])


__all__ = ["PrefillMixin", "padding_aware_groups"]
