"""Prefix caching across ``generate`` calls of one scope: the next turn of a conversation prefills only what is new.

Why: an agent loop calls ``generate`` again and again on a conversation that only grows (the last prompt, the
reply, a tool result, the next instruction). Plain ``generate`` prefills the whole history every call, and for
short replies on a long history that is most of a turn (SmolLM2-135M on a 2-core CPU: prefilling a 1,000-token
history takes 2.7 s, as long as ~33 decoding steps). The call's own caches already hold every position it
committed, so keeping them costs nothing until the next call, which crops them to the longest common prefix of
its prompt and prefills the rest.

What is kept, per (caller scope, drafter): the target's ``DynamicCache`` and the drafter's ``DraftCache`` of a
batch-1 call, and the token ids whose positions they hold (slot i = position i: a batch-1 cache has no holes).
Nothing is shared without a scope (acceptance and prefill timing would tell one user whether another's text
began the same way), nothing computed by other weights is reused (``weights_signature``), an entry is taken by
the call that reuses it (one owner at a time: that call extends it in place), and the store is bounded in entries
and bytes. Reused K/V were computed by other forward shapes than a fresh prefill would use (float rounding differs
in the last bits, as in every speculative verify forward).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import DynamicCache

from ..modeling.draft_cache import DraftCache

logger = logging.getLogger(__name__)

#: Prefix-cache limits per target: entries (scopes × drafters) and the memory their caches hold (a 135M target keeps
#: ~46 KB per token, a 7B one ~130 KB in bf16: 512 MiB is a few long conversations).
PREFIX_CACHE_ENTRIES = 8
PREFIX_CACHE_BYTES = 512 * 2**20
#: Shorter common prefixes are prefilled afresh (cropping and bookkeeping would cost more than they save).
MIN_REUSED_TOKENS = 16


def weights_signature(*models) -> tuple:
    """Which weights computed a cache: every parameter's storage and in-place version counter (an optimizer step,
    ``load_state_dict``, a dtype or device move all change it), so K/V of other weights are never reused."""
    return tuple((p.data_ptr(), p._version) for model in models for p in model.parameters())


@dataclass
class CachedPrefix:
    """Caches of one finished call: ``token_ids[i]`` is the token whose K/V sits at slot (= position) i;
    ``weights``: the :func:`weights_signature` of the target and drafter that computed them."""

    token_ids: list[int]
    cache: DynamicCache
    draft_cache: DraftCache | None  # None: no drafter (an engine serving lookup only)
    weights: tuple = ()

    @property
    def num_tokens(self) -> int:
        """Positions both caches hold for tokens of ``token_ids`` (what a later call can reuse)."""
        drafted = self.draft_cache.num_slots if self.draft_cache is not None else len(self.token_ids)
        return min(len(self.token_ids), self.cache.get_seq_length(), drafted)

    @property
    def num_bytes(self) -> int:
        """Memory the two caches hold (their storage, which may be larger than the visible slots)."""
        target = [t for layer in self.cache.layers for t in (layer.keys, layer.values) if t is not None]
        drafter = self.draft_cache.storage_bytes if self.draft_cache is not None else 0
        return sum(t.untyped_storage().nbytes() for t in target) + drafter

    def crop(self, length: int) -> None:
        """Keep positions [0, length) in both caches (in place)."""
        drop = self.cache.get_seq_length() - length
        if drop > 0:
            self.cache.crop(-drop)  # transformers >= 5.24: a negative count is the number of slots to drop
        if self.draft_cache is not None:
            self.draft_cache.truncate(length)
        del self.token_ids[length:]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCacheStore:
    """Bounded LRU of :class:`CachedPrefix` by key (scope, drafter); thread-safe. ``max_entries`` / ``max_bytes``
    may be changed at any time (``memory_for(target).prefixes.max_bytes = ...``; 0 keeps nothing)."""

    def __init__(self, max_entries: int = PREFIX_CACHE_ENTRIES, max_bytes: int = PREFIX_CACHE_BYTES):
        self.max_entries, self.max_bytes = int(max_entries), int(max_bytes)
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return sum(entry.num_bytes for entry in self._entries.values())

    def take(self, key, prompt_ids: Sequence[int], weights: tuple = ()) -> tuple[CachedPrefix, int] | None:
        """Remove the entry of ``key`` and return it cropped to what ``prompt_ids`` can reuse, with that length;
        None when nothing useful is cached (or it was computed by other ``weights``: then it is dropped). At least
        the prompt's last token is left to prefill (its logits pick the first new token)."""
        with self._lock:
            entry = self._entries.pop(key, None)
        if entry is None:
            return None
        if entry.weights != weights:
            logger.info("prefix cache: the weights changed since %s was cached; prefilling afresh", key)
            return None
        reuse = min(common_prefix_length(entry.token_ids, prompt_ids), entry.num_tokens, len(prompt_ids) - 1)
        if reuse < MIN_REUSED_TOKENS:
            return None
        entry.crop(reuse)
        return entry, reuse

    def put(self, key, entry: CachedPrefix) -> None:
        """Keep ``entry`` for ``key`` (replacing the old one); evict least recently used entries over the limits."""
        if entry.num_bytes > self.max_bytes or self.max_entries < 1:
            return
        with self._lock:
            self._entries.pop(key, None)
            self._entries[key] = entry
            while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
                evicted, _ = self._entries.popitem(last=False)
                logger.debug("prefix cache: evicted %s", evicted)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


__all__ = ["CachedPrefix", "MIN_REUSED_TOKENS", "PREFIX_CACHE_BYTES", "PREFIX_CACHE_ENTRIES", "PrefixCacheStore",
           "common_prefix_length", "weights_signature"]
