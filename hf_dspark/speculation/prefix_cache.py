"""Prefix caching across ``generate`` calls: the next turn of a conversation prefills only what is new.

Why: an agent loop calls ``generate`` again and again on a conversation that only grows (the last prompt, the
reply, a tool result, the next instruction). Plain ``generate`` prefills the whole history every call, and for
short replies on a long history that is most of a turn (SmolLM2-135M on a 2-core CPU: prefilling a 1,000-token
history takes 2.7 s, as long as ~33 decoding steps). The call's own caches already hold every position it
committed, so keeping them costs nothing until the next call, which crops them to the longest common prefix of
its prompt and prefills the rest.

What is kept, under a key (cache salt, drafter): the target's ``DynamicCache`` and the drafter's ``DraftCache`` of
finished batch-1 calls, and the token ids whose positions they hold (slot i = position i: a batch-1 cache has no
holes). A key holds several entries (several conversations of one salt), and a call takes the one that shares the
longest prefix with its prompt. Nothing is shared across salts (acceptance and prefill timing would tell one user
whether another's text began the same way), nothing computed by other weights is reused (``weights_signature``),
an entry is taken by the call that reuses it (one owner at a time: that call extends it in place), and the store
is bounded in entries and bytes. Reused K/V were computed by other forward shapes than a fresh prefill would use (float rounding differs
in the last bits, as in every speculative verify forward).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import DynamicCache

from ..modeling.draft_cache import DraftCache

logger = logging.getLogger(__name__)

#: Prefix-cache limits per target: entries (conversations, over all salts and drafters) and the memory their caches hold (a 135M target keeps
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
    """Bounded LRU of :class:`CachedPrefix` entries, several per key (salt, drafter); thread-safe. ``max_entries`` /
    ``max_bytes`` may be changed at any time (``shared_state_for(target).prefixes.max_bytes = ...``; 0 keeps nothing)."""

    def __init__(self, max_entries: int = PREFIX_CACHE_ENTRIES, max_bytes: int = PREFIX_CACHE_BYTES):
        self.max_entries, self.max_bytes = int(max_entries), int(max_bytes)
        self._entries: OrderedDict[int, tuple[object, CachedPrefix]] = OrderedDict()  # least recently used first
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return sum(entry.num_bytes for _, entry in self._entries.values())

    def take(self, key, prompt_ids: Sequence[int], weights: tuple = ()) -> tuple[CachedPrefix, int] | None:
        """Remove the entry of ``key`` that shares the longest prefix with ``prompt_ids`` and return it cropped to
        that prefix, with its length; None when nothing useful is cached (entries computed by other ``weights``
        are dropped on the way). At least the prompt's last token is left to prefill (its logits pick the first new
        token)."""
        with self._lock:
            best, best_reuse = None, 0
            for entry_id, (entry_key, entry) in list(self._entries.items()):
                if entry_key != key:
                    continue
                if entry.weights != weights:
                    logger.info("prefix cache: the weights changed since an entry of %s was cached; dropped", key)
                    del self._entries[entry_id]
                    continue
                reuse = min(common_prefix_length(entry.token_ids, prompt_ids), entry.num_tokens, len(prompt_ids) - 1)
                if reuse > best_reuse:
                    best, best_reuse = entry_id, reuse
            if best is None or best_reuse < MIN_REUSED_TOKENS:
                return None
            _, entry = self._entries.pop(best)
        entry.crop(best_reuse)
        return entry, best_reuse

    def put(self, key, entry: CachedPrefix) -> None:
        """Keep ``entry`` under ``key``; evict least recently used entries over the limits."""
        if entry.num_bytes > self.max_bytes or self.max_entries < 1:
            return
        with self._lock:
            self._entries[next(self._ids)] = (key, entry)
            while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
                _, (evicted, _) = self._entries.popitem(last=False)
                logger.debug("prefix cache: evicted an entry of %s", evicted)

    def keys(self) -> list:
        """The keys that hold entries (one per entry, least recently used first)."""
        with self._lock:
            return [key for key, _ in self._entries.values()]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


__all__ = ["CachedPrefix", "MIN_REUSED_TOKENS", "PREFIX_CACHE_BYTES", "PREFIX_CACHE_ENTRIES", "PrefixCacheStore",
           "common_prefix_length", "weights_signature"]
