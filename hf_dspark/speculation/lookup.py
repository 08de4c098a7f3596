"""Training-free lookup proposer: drafts copied from text the row (or an earlier request) has already seen.

Agent loops re-emit pieces of their own context (tool names, JSON keys, arguments, earlier sentences); a matcher
over that context proposes them for free. Per round and per row the proposer

    1. finds the longest n ≤ ``max_match`` such that the row's last n tokens occurred earlier *and* were
       followed by a token ("longest match wins"),
    2. walks forward with that order-n context: the next draft is the token that most often followed the
       current n-gram (ties -> the most recent occurrence), the context slides over the draft, and the walk
       goes on until the n-gram was never continued or the length cap is reached.

Why n-gram tables and not a rescan (transformers' ``PromptLookupCandidateGenerator``, vLLM's ``ngram``): a rescan
costs O(sequence) per round, which at 8k tokens of agent history is more than a verify step on a small target.
Here each committed token updates ``max_match`` hash tables once (O(max_match)), and a proposal costs at most
``max_match`` probes plus one probe per drafted token, independent of the sequence length. Each table maps an
n-gram to its continuations; the common case (seen once) stores the continuation token itself, so memory is
at most ``max_match`` dict entries per token, fewer where text repeats (``max_match=8``, agent-loop text: ~1.5 KB
per token at 256 tokens, ~0.5-0.6 KB at 2k, ~0.25-0.4 KB at 8k; ``scripts/bench_lookup.py`` measures it).

Why a walk over counts rather than copying the text after one occurrence: when an n-gram was followed by different
tokens (a JSON key with several values), the majority continuation is the better guess, and SuffixDecoding's
frequency-ranked suffix tree shows the same. Why the length cap grows with the match (``tokens_per_match``): a
1-token match is weak evidence, an 8-token match inside a copied sentence is strong; the scheduler trims the rest
with the calibrated survival (``lookup_calibration.py``).

**Shared history.** :class:`LookupHistory` keeps the generated text of finished rows (earlier requests of an
engine, earlier ``generate`` calls on one target) under a :class:`LookupHistoryKey`, bounded by a token budget
with FIFO eviction of whole generations. A key always names the target and the tokenizer, and a caller scope
(user, tenant): **never share one history between users who must not read each other's text.** Lookup drafts
are accepted exactly when the target would have produced them, so a request that reuses another user's text
finishes measurably faster when its output matches that text: acceptance timing leaks the history's content.

Losslessness: a proposal is a deterministic function of committed tokens (no sampling, no peeking at the target),
so whatever the scheduler admits from it is non-anticipating; verification treats drafts as one-hot q = δ.
"""

from __future__ import annotations

import logging
import math
import uuid
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

ROW_SOURCE = "row"
HISTORY_SOURCE = "history"
HISTORY_POLICIES = ("fallback", "longest")


@dataclass(frozen=True)
class LookupProposal:
    """One row's lookup draft.

    ``tokens`` the drafted token ids (empty: no match); ``match_length`` the n of the matched n-gram (0: none);
    ``counts[j]`` / ``totals[j]`` how often the context in front of draft j was followed by draft j / by anything
    (the evidence for that draft); ``source`` ``"row"`` (the row's own text) or ``"history"``."""

    tokens: tuple[int, ...] = ()
    match_length: int = 0
    counts: tuple[int, ...] = ()
    totals: tuple[int, ...] = ()
    source: str = ROW_SOURCE

    @property
    def count(self) -> int:
        """Occurrences of the matched n-gram followed by the first draft (0 when there is no draft)."""
        return self.counts[0] if self.counts else 0

    def __len__(self) -> int:
        return len(self.tokens)


#: What ``propose`` returns for a row with no match.
NO_PROPOSAL = LookupProposal()


class _Continuations:
    """Continuation counts of one n-gram seen at least twice, with the argmax kept up to date.

    Invariant: ``best`` has the largest count and, among tokens tied at that count, the latest occurrence (a
    token tied at the maximum reached it at its latest occurrence, so the one that reached it last wins)."""

    __slots__ = ("counts", "best", "best_count", "total")

    def __init__(self, first: int, second: int):
        self.counts = {first: 1}
        self.best, self.best_count, self.total = first, 1, 1
        self.add(second)

    def add(self, token: int) -> None:
        count = self.counts.get(token, 0) + 1
        self.counts[token] = count
        self.total += 1
        if count >= self.best_count:
            self.best, self.best_count = token, count


class LookupIndex:
    """N-gram continuation tables over one token sequence, extended one committed token at a time.

    ``start_segment()`` makes the next tokens a new segment: no n-gram spans a segment boundary (the history
    stores many unrelated sequences in one index)."""

    __slots__ = ("max_match", "tokens", "_tables", "_segment_start")

    def __init__(self, max_match: int = 8, tokens: Iterable[int] = ()):
        _raise_if_bad_match(1, max_match)
        self.max_match = max_match
        self.tokens: list[int] = []
        # _tables[n]: n-gram tuple -> continuation token (seen once) or _Continuations; _tables[0] unused
        self._tables: list[dict] = [{} for _ in range(max_match + 1)]
        self._segment_start = 0
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def start_segment(self) -> None:
        self._segment_start = len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append committed tokens, recording each as the continuation of the 1..max_match tokens before it."""
        seq, tables, max_match, segment_start = self.tokens, self._tables, self.max_match, self._segment_start
        for token in map(int, tokens):
            i = len(seq)
            window = tuple(seq[max(segment_start, i - max_match):i])
            width = len(window)
            for n in range(1, width + 1):
                context = window[width - n:]
                table = tables[n]
                seen = table.get(context)
                if seen is None:
                    table[context] = token
                elif isinstance(seen, int):  # seen once: the continuation token itself
                    table[context] = _Continuations(seen, token)
                else:
                    seen.add(token)
            seq.append(token)

    def longest_match(self, suffix: Sequence[int], min_match: int = 1) -> int:
        """Largest n in [min_match, max_match] whose last-n-tokens of ``suffix`` were ever continued; 0 if none."""
        for n in range(min(self.max_match, len(suffix)), min_match - 1, -1):
            if tuple(suffix[len(suffix) - n:]) in self._tables[n]:
                return n
        return 0

    def walk(self, suffix: Sequence[int], order: int, max_tokens: int) -> tuple[list[int], list[int], list[int]]:
        """Greedy most-frequent continuation of ``suffix`` with an order-``order`` context: (tokens, counts, totals)."""
        table = self._tables[order]
        window = list(suffix[len(suffix) - order:])
        tokens: list[int] = []
        counts: list[int] = []
        totals: list[int] = []
        while len(tokens) < max_tokens:
            seen = table.get(tuple(window))
            if seen is None:
                break
            if isinstance(seen, int):
                token, count, total = seen, 1, 1
            else:
                token, count, total = seen.best, seen.best_count, seen.total
            tokens.append(token)
            counts.append(count)
            totals.append(total)
            window.append(token)
            del window[0]
        return tokens, counts, totals

    def propose(self, max_tokens: int, min_match: int = 1) -> LookupProposal:
        """The continuation of this sequence's own last tokens (up to ``max_tokens``); NO_PROPOSAL if none."""
        return _proposal(self, self.tokens, min_match, max_tokens, ROW_SOURCE)


def _proposal(index: LookupIndex, suffix: Sequence[int], min_match: int, max_tokens: int,
              source: str, order: int | None = None) -> LookupProposal:
    order = index.longest_match(suffix, min_match) if order is None else order
    if order == 0 or max_tokens <= 0:
        return NO_PROPOSAL
    tokens, counts, totals = index.walk(suffix, order, max_tokens)
    return LookupProposal(tuple(tokens), order, tuple(counts), tuple(totals), source)


# ---------------------------------------------------------------------------------------------------------
# Shared history
# ---------------------------------------------------------------------------------------------------------
_MODEL_TOKENS: "weakref.WeakKeyDictionary[object, str]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class LookupHistoryKey:
    """Who may read a history: one target, one tokenizer, one caller scope (user / tenant / session).

    Token ids mean different text under another tokenizer and another target continues text differently, so
    the key always names both; ``scope`` separates users (see the module docstring for the timing leak)."""

    target: str
    tokenizer: str
    scope: str = ""

    def __post_init__(self) -> None:
        if not self.target or not self.tokenizer:
            raise ValueError(f"LookupHistoryKey needs a non-empty target and tokenizer identity, got target="
                             f"{self.target!r}, tokenizer={self.tokenizer!r}; use LookupHistoryKey.for_model")

    @classmethod
    def for_model(cls, target, tokenizer=None, scope: str = "") -> "LookupHistoryKey":
        """A key for this target *object* (and tokenizer): a per-process token, not ``id()``, so a target loaded
        later at the same address never inherits an old history; two loads of one checkpoint do not share."""
        return cls(_identity(target), _identity(tokenizer) if tokenizer is not None else
                   f"vocab:{getattr(getattr(target, 'config', None), 'vocab_size', '?')}", scope)


def _identity(obj) -> str:
    name = getattr(obj, "name_or_path", "") or getattr(getattr(obj, "config", None), "name_or_path", "")
    try:
        token = _MODEL_TOKENS.get(obj)
        if token is None:
            token = _MODEL_TOKENS[obj] = uuid.uuid4().hex
    except TypeError:  # not weak-referenceable: identity of the object for this process only
        token = f"id{id(obj)}"
    return f"{type(obj).__name__}:{name}:{token}"


class LookupHistory:
    """Bounded, keyed store of earlier sequences for lookup, shared by the rows (and calls) given the same key.

    Memory: at most ``max_tokens`` tokens over all keys (0.4-1.5 KB each, see the module docstring). Each key
    fills *generations* of ``max_tokens / num_generations`` tokens; when the budget is exceeded the oldest
    generation of any key is dropped whole (FIFO). Why generations instead of per-entry LRU: dropping a table
    is O(1) and needs no removal of counts; a lookup probes the key's few generations, newest first.
    ``enabled=False`` (or ``max_tokens=0``) stores nothing and matches nothing."""

    def __init__(self, max_tokens: int = 65_536, num_generations: int = 4, max_match: int = 8,
                 enabled: bool = True):
        if max_tokens < 0 or num_generations < 1:
            raise ValueError(f"LookupHistory: max_tokens must be >= 0 and num_generations >= 1, got {max_tokens}, "
                             f"{num_generations}")
        _raise_if_bad_match(1, max_match)
        self.max_tokens = max_tokens
        self.max_match = max_match
        self.enabled = enabled and max_tokens > 0
        self._chunk = max(1, -(-max_tokens // num_generations))
        self._shards: dict[LookupHistoryKey, deque[LookupIndex]] = {}
        self._fifo: deque[tuple[LookupHistoryKey, LookupIndex]] = deque()
        self.num_tokens = 0

    def keys(self) -> list[LookupHistoryKey]:
        return list(self._shards)

    def add(self, key: LookupHistoryKey, tokens: Sequence[int]) -> None:
        """Store one finished sequence under ``key`` (only its last ``max_tokens`` tokens if longer)."""
        _raise_if_bad_key(key)
        if not self.enabled or not tokens:
            return
        tokens = list(tokens[-self.max_tokens:])
        shard = self._shards.setdefault(key, deque())
        if not shard or len(shard[-1]) + len(tokens) > self._chunk:
            shard.append(LookupIndex(self.max_match))
            self._fifo.append((key, shard[-1]))
        generation = shard[-1]
        generation.start_segment()
        generation.extend(tokens)
        self.num_tokens += len(tokens)
        while self.num_tokens > self.max_tokens:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        key, generation = self._fifo.popleft()
        shard = self._shards[key]
        shard.remove(generation)  # NOTE: the oldest of its shard, so this is shard[0]: O(1)
        if not shard:
            del self._shards[key]
        self.num_tokens -= len(generation)
        logger.debug("lookup history: evicted %d tokens of %s", len(generation), key.scope or key.target)

    def clear(self, key: LookupHistoryKey | None = None) -> None:
        """Forget one key's sequences (all keys when None)."""
        for k in [key] if key is not None else list(self._shards):
            for generation in self._shards.pop(k, ()):
                self._fifo.remove((k, generation))
                self.num_tokens -= len(generation)

    def longest_match(self, key: LookupHistoryKey | None, suffix: Sequence[int],
                      min_match: int = 1) -> tuple[LookupIndex | None, int]:
        """(generation, n): the longest match of ``suffix`` among ``key``'s generations, the newest on ties;
        (None, 0) when none matches, the key is unknown or None, or the history is disabled."""
        shard = self._shards.get(key) if self.enabled and key is not None else None
        best, best_order = None, 0
        for generation in reversed(shard or ()):
            order = generation.longest_match(suffix, max(min_match, best_order + 1))
            if order > best_order:
                best, best_order = generation, order
                if order == self.max_match:
                    break
        return best, best_order

    def propose(self, key: LookupHistoryKey | None, suffix: Sequence[int], max_tokens: int,
                min_match: int = 1) -> LookupProposal:
        """The continuation of ``suffix`` from ``key``'s history, walked in the generation of the longest match."""
        generation, order = self.longest_match(key, suffix, min_match)
        if generation is None:
            return NO_PROPOSAL
        return _proposal(generation, suffix, min_match, max_tokens, HISTORY_SOURCE, order=order)


# ---------------------------------------------------------------------------------------------------------
# Batch proposer
# ---------------------------------------------------------------------------------------------------------
@dataclass
class _Row:
    index: LookupIndex
    num_prompt_tokens: int
    history_key: LookupHistoryKey | None


class LookupProposer:
    """Lookup drafts for the rows of a batch: the round calls ``propose`` before verifying and ``commit`` after.

    Args:
        history (LookupHistory, defaults to None): shared store of finished rows; None = no sharing.
        history_key (LookupHistoryKey, defaults to None): the key rows use unless ``start_row`` gives one;
            None = rows neither read nor write the history.
        min_match (int, defaults to 1): shortest n-gram match that may propose.
        max_match (int, defaults to 8): longest n-gram indexed (the order of the tables).
        max_tokens (int, defaults to 8): drafts per proposal when ``propose`` is not given a cap (the block size).
        long_match_tokens (int, defaults to 24): cap for a match of ``max_match`` tokens (a copy in progress),
            which may go beyond ``max_tokens``; set it to ``max_tokens`` to never exceed the block.
        tokens_per_match (float, defaults to 2.0): a shorter match of n tokens proposes at most
            ``ceil(tokens_per_match * n)`` drafts (and never more than the cap).
        history_policy ("fallback" | "longest", defaults to "longest"): "fallback" asks the history only when
            the row's own text has no match; "longest" takes the longer match of the two (the row's on ties).
    """

    def __init__(self, history: LookupHistory | None = None, history_key: LookupHistoryKey | None = None, *,
                 min_match: int = 1, max_match: int = 8, max_tokens: int = 8, long_match_tokens: int = 24,
                 tokens_per_match: float = 2.0,
                 history_policy: Literal["fallback", "longest"] = "longest"):
        _raise_if_bad_match(min_match, max_match)
        if max_tokens < 0 or long_match_tokens < 0 or tokens_per_match <= 0:
            raise ValueError(f"LookupProposer: max_tokens and long_match_tokens must be >= 0 and tokens_per_match "
                             f"> 0, got {max_tokens}, {long_match_tokens}, {tokens_per_match}")
        if history_policy not in HISTORY_POLICIES:
            raise ValueError(f"LookupProposer: history_policy must be one of {HISTORY_POLICIES}, got "
                             f"{history_policy!r}")
        if history is not None and history.max_match < max_match:
            raise ValueError(f"LookupProposer: max_match={max_match} exceeds the history's max_match="
                             f"{history.max_match}; build the LookupHistory with max_match >= {max_match}")
        if history_key is not None:
            _raise_if_bad_key(history_key)
        self.history = history
        self.history_key = history_key
        self.min_match, self.max_match = min_match, max_match
        self.max_tokens = max_tokens
        self.long_match_tokens = long_match_tokens
        self.tokens_per_match = tokens_per_match
        self.history_policy = history_policy
        self._rows: dict[object, _Row] = {}

    def start_row(self, row_id, prompt_ids: Iterable[int], history_key: LookupHistoryKey | None = None) -> None:
        """Index a new row's prompt (unpadded token ids): O(len(prompt) · max_match), once per row."""
        if row_id in self._rows:
            raise ValueError(f"LookupProposer.start_row: row {row_id!r} is already active; end_row it first")
        if history_key is not None:
            _raise_if_bad_key(history_key)
        index = LookupIndex(self.max_match, prompt_ids)
        self._rows[row_id] = _Row(index, len(index), history_key if history_key is not None else self.history_key)

    def commit(self, row_id, tokens: Iterable[int]) -> None:
        """Tokens the round committed for this row (accepted drafts + recovered/bonus token), in order."""
        self._row(row_id).index.extend(tokens)

    def end_row(self, row_id, keep_in_history: bool = True) -> None:
        """Drop the row; with ``keep_in_history`` store its generated tokens under its key.

        Only the generated tokens (behind the last ``max_match`` prompt tokens, so the first ones can match)
        go into the history: a conversation's prompt is re-sent with every request and is in that request's
        own index already, and storing prompts would fill the budget with copies of one growing chat."""
        row = self._rows.pop(row_id, None)
        if row is None:
            raise KeyError(f"LookupProposer.end_row: unknown row {row_id!r}")
        if keep_in_history and self.history is not None and row.history_key is not None:
            tokens = row.index.tokens
            if len(tokens) > row.num_prompt_tokens:
                self.history.add(row.history_key, tokens[max(0, row.num_prompt_tokens - self.max_match):])

    def row_length(self, row_id) -> int:
        return len(self._row(row_id).index)

    def propose(self, row_ids: Sequence, max_tokens: int | Sequence[int] | None = None) -> list[LookupProposal]:
        """One proposal per row (NO_PROPOSAL where nothing matches).

        ``max_tokens`` (int or one per row, defaults to the proposer's ``max_tokens``) caps short matches; a match
        of ``max_match`` tokens may propose up to ``max(max_tokens, long_match_tokens)``; 0 proposes nothing."""
        caps = [self.max_tokens] * len(row_ids) if max_tokens is None else (
            [max_tokens] * len(row_ids) if isinstance(max_tokens, int) else list(max_tokens))
        if len(caps) != len(row_ids):
            raise ValueError(f"LookupProposer.propose: {len(caps)} max_tokens for {len(row_ids)} rows")
        return [self._propose_row(self._row(row_id), cap)
                for row_id, cap in zip(row_ids, caps)]

    def _propose_row(self, row: _Row, cap: int) -> LookupProposal:
        if cap <= 0:
            return NO_PROPOSAL
        suffix = row.index.tokens
        index, order, source = row.index, row.index.longest_match(suffix, self.min_match), ROW_SOURCE
        if (self.history is not None and row.history_key is not None and order < self.max_match
                and (order == 0 or self.history_policy == "longest")):
            generation, history_order = self.history.longest_match(row.history_key, suffix,
                                                                   max(self.min_match, order + 1))
            if history_order > order:  # strictly longer: the row's own text wins ties
                index, order, source = generation, history_order, HISTORY_SOURCE
        if order == 0:
            return NO_PROPOSAL
        return _proposal(index, suffix, self.min_match, self._cap(cap, order), source, order=order)

    def _cap(self, cap: int, order: int) -> int:
        if order >= self.max_match:
            return max(cap, self.long_match_tokens)
        return min(cap, math.ceil(self.tokens_per_match * order))

    def _row(self, row_id) -> _Row:
        row = self._rows.get(row_id)
        if row is None:
            raise KeyError(f"LookupProposer: unknown row {row_id!r}; call start_row first")
        return row


def _raise_if_bad_match(min_match: int, max_match: int) -> None:
    if not 1 <= min_match <= max_match:
        raise ValueError(f"lookup: need 1 <= min_match <= max_match, got min_match={min_match}, "
                         f"max_match={max_match}")


def _raise_if_bad_key(key) -> None:
    if not isinstance(key, LookupHistoryKey):
        raise TypeError(f"lookup history keys must be LookupHistoryKey (target + tokenizer + scope), got "
                        f"{type(key).__name__}; build one with LookupHistoryKey.for_model(target, tokenizer, scope)")


__all__ = ["LookupHistory", "LookupHistoryKey", "LookupIndex", "LookupProposal", "LookupProposer", "NO_PROPOSAL"]
