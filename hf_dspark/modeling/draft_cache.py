"""DraftCache: the drafter's context K/V (SPEC §2: the cache holds only context K/V), in preallocated storage.

Why preallocated and packed: a speculative round commits a few tokens per row, and rows of a batch commit
different numbers. Concatenating the whole cache every round costs O(context) per round (O(n²) per generation),
and appending every verified slot with a validity mask keeps rejected slots forever (a weak drafter's cache
would hold ~8 slots per real one). Instead each row writes its committed entries right after its own last entry
(a per-row write pointer), into storage that grows by doubling: an append costs O(new entries), and the cache
holds only committed context.

Layout: ``keys[i]`` / ``values[i]`` are [R, Hkv, S, hd] views of the storage, ``valid`` [R, S] says which slots
hold an entry (slots past a row's pointer are free), ``positions`` [R, S] each slot's absolute position. The
drafter attends by ``valid`` and ``positions`` only, so slot order never matters. A cache built from given
tensors (``DraftCache(keys, values, valid, positions)``) may hold holes anywhere; appends go after its last slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class ContextUpdate:
    """Committed positions not in the drafter cache yet: raw target taps ``features`` [R, n, m·d] at
    ``positions`` [R, n], committed where ``valid`` [R, n]; ``next_ids`` [R, n] the token after each position
    (autoregressive drafters), ``counts`` [R] the committed entries per row on the host (None: read them)."""

    features: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    next_ids: torch.Tensor | None = None
    counts: list[int] | None = None

    @property
    def num_slots(self) -> int:
        return self.valid.shape[1]

    @property
    def all_valid(self) -> bool:
        """Every slot of every row is committed (host fact from ``counts``; False when unknown)."""
        return self.counts is not None and all(c == self.num_slots for c in self.counts)


class DraftCache:
    """Context K/V of every drafter layer for a batch of rows (see the module docstring)."""

    def __init__(self, keys: Sequence[torch.Tensor] | None = None, values: Sequence[torch.Tensor] | None = None,
                 valid: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                 tail: torch.Tensor | None = None, tail_positions: torch.Tensor | None = None):
        self._keys = list(keys or [])  # per layer [R, Hkv, capacity, hd]
        self._values = list(values or [])
        self._valid = valid  # [R, capacity] bool
        self._positions = positions  # [R, capacity] long
        width = 0 if valid is None else valid.shape[1]
        self._num_slots = width  # the visible width S (max over rows of the write pointer)
        self._ends = [width] * (0 if valid is None else valid.shape[0])  # per-row write pointer (host ints)
        # host fact: every visible slot of every row holds an entry (no holes, rows aligned); unknown = False
        self._dense = valid is None
        # autoregressive (Eagle3) drafters: output state and position of each row's last committed entry
        self.tail = tail  # [R, d]
        self.tail_positions = tail_positions  # [R] long

    # -- views ----------------------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def is_dense(self) -> bool:
        """Every visible slot of every row holds an entry, as far as the host knows (no device read): true for a
        cache filled only by packed appends that kept its rows aligned (batch 1, or rows committing alike)."""
        return self._dense

    @property
    def storage_bytes(self) -> int:
        """Memory the cache holds (its preallocated storage, not only the visible slots)."""
        tensors = [t for t in (*self._keys, *self._values, self._valid, self._positions, self.tail,
                               self.tail_positions) if t is not None]
        return sum(t.untyped_storage().nbytes() for t in tensors)

    @property
    def num_rows(self) -> int:
        return len(self._ends)

    @property
    def keys(self) -> list[torch.Tensor]:
        return [k[:, :, : self._num_slots] for k in self._keys]

    @property
    def values(self) -> list[torch.Tensor]:
        return [v[:, :, : self._num_slots] for v in self._values]

    @property
    def valid(self) -> torch.Tensor | None:
        return None if self._valid is None else self._valid[:, : self._num_slots]

    @property
    def positions(self) -> torch.Tensor | None:
        return None if self._positions is None else self._positions[:, : self._num_slots]

    @property
    def row_ends(self) -> list[int]:
        """Per row: slots in use (entries and holes before the write pointer)."""
        return list(self._ends)

    # -- updates --------------------------------------------------------------------------------------------
    def append(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], valid: torch.Tensor,
               positions: torch.Tensor, *, packed: bool = False, counts: Sequence[int] | None = None) -> None:
        """Add entries: keys/values per layer [R, Hkv, n, hd], valid/positions [R, n].

        ``packed=False`` appends all n slots to every row after the widest row (invalid ones stay as holes that
        ``valid`` masks, so the rows stay aligned). ``packed=True`` keeps only the valid entries, each row's right
        after its own last entry: what the speculative round uses, so rejected slots never enter the cache.
        ``counts`` [R] = valid entries per row when the caller knows them on the host (saves a device→host read)."""
        rows, n = valid.shape
        if n == 0:
            return
        if self._valid is None:
            self._allocate(keys, values, rows, n)
        if not packed:
            start = self._num_slots
            self._reserve(start + n + 1)
            self._write_slice(start, keys, values, valid, positions)
            self._ends = [start + n] * rows
            self._num_slots = start + n
            self._dense = False  # its invalid slots stay as holes
            return
        if counts is None:
            counts = valid.sum(1).tolist()
        counts = [int(c) for c in counts]
        new_ends = [end + c for end, c in zip(self._ends, counts)]
        self._reserve(max(new_ends) + 1)  # + 1: the dump slot for invalid entries (see below)
        ends = self._ends
        if all(c == n for c in counts) and len(set(ends)) == 1:
            self._write_slice(ends[0], keys, values, valid, positions)  # all valid, rows aligned: one slice
        else:
            # row r's j-th valid entry goes to slot ends[r] + j; invalid entries all go to the last storage slot,
            # which lies past every row's pointer and is never visible (its contents are garbage by design)
            dump = self._valid.shape[1] - 1
            offsets = torch.tensor(ends, dtype=torch.long, device=valid.device)
            index = torch.where(valid, offsets[:, None] + valid.long().cumsum(1) - 1, dump)  # [R, n]
            for store, new in zip(self._keys + self._values, list(keys) + list(values)):
                store.scatter_(2, index[:, None, :, None].expand(-1, new.shape[1], -1, new.shape[3]), new)
            self._valid.scatter_(1, index, valid)
            self._positions.scatter_(1, index, positions)
            self._valid[:, dump] = False
        # packed entries are contiguous per row: still dense iff the rows stay aligned
        self._dense = self._dense and len(set(new_ends)) == 1
        self._ends = new_ends
        self._num_slots = max(new_ends)

    def _write_slice(self, start: int, keys, values, valid: torch.Tensor, positions: torch.Tensor) -> None:
        n = valid.shape[1]
        for store, new in zip(self._keys + self._values, list(keys) + list(values)):
            store[:, :, start:start + n] = new
        self._valid[:, start:start + n] = valid
        self._positions[:, start:start + n] = positions

    def _allocate(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], rows: int, n: int) -> None:
        # zeros, not empty: attention multiplies masked slots' values by probability 0, and 0 · NaN garbage = NaN
        capacity = max(16, 2 * (n + 1))
        self._keys = [k.new_zeros(k.shape[0], k.shape[1], capacity, k.shape[3]) for k in keys]
        self._values = [v.new_zeros(v.shape[0], v.shape[1], capacity, v.shape[3]) for v in values]
        device = keys[0].device
        self._valid = torch.zeros(rows, capacity, dtype=torch.bool, device=device)
        self._positions = torch.zeros(rows, capacity, dtype=torch.long, device=device)
        self._ends = [0] * rows
        self._num_slots = 0
        self._dense = True

    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` slots per row up front (a caller that knows its final length)."""
        if self._valid is not None:
            self._reserve(capacity + 1)

    def _reserve(self, needed: int) -> None:
        capacity = self._valid.shape[1]
        if needed <= capacity:
            return
        new_capacity = max(needed, 2 * capacity)
        grow = new_capacity - capacity

        def widen(x: torch.Tensor, dim: int, fill=None) -> torch.Tensor:
            shape = list(x.shape)
            shape[dim] = grow
            extra = x.new_zeros(shape) if fill is None else x.new_full(shape, fill)
            return torch.cat([x, extra], dim=dim)

        self._keys = [widen(k, 2) for k in self._keys]
        self._values = [widen(v, 2) for v in self._values]
        self._valid = widen(self._valid, 1, False)
        self._positions = widen(self._positions, 1)

    def truncate(self, length: int) -> None:
        """Keep only slots [0, length) of every row (a later call reusing a prefix of this context). The tail
        state of an autoregressive drafter describes the last entry, which this may drop: such caches refuse."""
        if self.tail is not None:
            raise ValueError("DraftCache.truncate: an autoregressive drafter's tail state cannot be truncated")
        if self._valid is None or length >= self._num_slots:
            return
        length = max(int(length), 0)
        self._valid[:, length:] = False  # nothing past the new pointers stays visible to a ragged row
        self._ends = [min(end, length) for end in self._ends]
        self._num_slots = max(self._ends, default=0)

    def row(self, row: int) -> "DraftCache":
        """Row ``row``'s entries in slot order (= position order: appends follow the text) as a dense batch-1
        cache: a finished request's context, kept for a later request that continues its text."""
        if self._valid is None:
            return DraftCache()
        index = self.valid[row].nonzero()[:, 0]  # a device read: once per kept request, not per round
        out = DraftCache([k[row:row + 1].index_select(2, index) for k in self.keys],
                         [v[row:row + 1].index_select(2, index) for v in self.values],
                         torch.ones(1, index.numel(), dtype=torch.bool, device=index.device),
                         self.positions[row:row + 1].index_select(1, index))
        out._dense = True  # every slot holds an entry and the rows (one) are aligned
        return out

    def replace_row(self, row: int, source: "DraftCache", source_row: int) -> bool:
        """Put ``source``'s row ``source_row`` in place of row ``row`` (a request joining the batch in the slot a
        finished one left: no copy of the other rows). False, nothing changed, where it cannot: an empty cache on
        either side, or an autoregressive drafter's tail state."""
        if self._valid is None or source._valid is None or self.tail is not None or source.tail is not None:
            return False
        end = source._ends[source_row]
        self._reserve(end + 1)
        for store, new in zip(self._keys + self._values, source._keys + source._values):
            store[row, :, :end] = new[source_row, :, :end]
        self._valid[row] = False
        self._valid[row, :end] = source._valid[source_row, :end]
        self._positions[row, :end] = source._positions[source_row, :end]
        self._ends[row] = end
        self._num_slots = max(self._ends)
        self._dense = False  # as far as the host knows
        return True

    def select_rows(self, rows: torch.Tensor | Sequence[int]) -> "DraftCache":
        """A cache holding only ``rows`` (finished rows leave the batch)."""
        host_rows = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
        if self._valid is None:
            return DraftCache()
        index = torch.as_tensor(host_rows, dtype=torch.long, device=self._valid.device)
        out = DraftCache([k[index] for k in self._keys], [v[index] for v in self._values], self._valid[index],
                         self._positions[index], None if self.tail is None else self.tail[index],
                         None if self.tail_positions is None else self.tail_positions[index])
        out._ends = [self._ends[r] for r in host_rows]
        out._num_slots = max(out._ends, default=0)
        out._dense = self._dense  # aligned rows stay aligned
        return out


__all__ = ["ContextUpdate", "DraftCache"]
