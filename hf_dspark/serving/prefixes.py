"""The engine's prefix cache: a completed request leaves its target and drafter caches for the next request of its
salt, which then prefills only the part of its prompt that is new (an agent's conversation is not prefilled again
every turn).

Differences from ``generate``'s (``speculation/shared_state.py``): the engine keeps a store of its own (bounded by
its ``prefix_cache_bytes``) instead of the target's shared one, and a request's caches are cut out of its row of the
running batch when it retires. The key and the weights check are the same: entries belong to a salt and to the
drafter whose context they hold, and are never served to weights that changed since.
"""

from __future__ import annotations

import torch

from ..speculation.prefix_cache import CachedPrefix, PrefixCacheStore, weights_signature
from ..speculation.ragged_batch import RaggedBatch
from ..speculation.shared_state import shared_state_for
from .requests import FinishReason, Request


class RequestPrefixes:
    """Kept caches per salt for the engine's requests; never for ``isolate`` requests, never across salts."""

    def __init__(self, target, drafter, max_bytes: int):
        self.target, self.drafter = target, drafter  # the drafter whose context the caches hold (None: none)
        self.store = PrefixCacheStore(max_bytes=max_bytes)

    def __len__(self) -> int:
        return len(self.store)

    def keep(self, batch: RaggedBatch, row: int, request: Request) -> None:
        """A completed request's caches (its ``row`` of ``batch``) serve its salt's next request; a cancelled or
        failed request's are never kept."""
        key = self._key(request)
        if key is None or request.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
            return
        with torch.no_grad():  # retiring runs outside the step's no_grad block; the drafter projects here
            cache, draft_cache = batch.row_caches(row, self.drafter)
        self.store.put(key, CachedPrefix(request.prompt_ids + request.tokens, cache, draft_cache, self._weights()))

    def reuse(self, request: Request) -> tuple[CachedPrefix, int] | None:
        """The salt's kept caches cropped to what this request's prompt shares with them, and that length (None:
        prefill it all)."""
        key = self._key(request)
        if key is None or request.tokens:  # a request resuming after a failed step prefills afresh
            return None
        return self.store.take(key, request.prompt_ids, self._weights())

    def _key(self, request: Request):
        if request.params.isolate:
            return None
        return shared_state_for(self.target).prefix_key(request.params.cache_salt, self.drafter)

    def _weights(self) -> tuple:
        return weights_signature(self.target, *([self.drafter] if self.drafter is not None else []))


__all__ = ["RequestPrefixes"]
