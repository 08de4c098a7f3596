"""The engine's running batch: every decoding request as one row of a single ragged target cache.

Rows join after their prefill (alone, or together with short prompts admitted in the same step), leave when they
finish, and after each verify round keep only the slots of committed tokens (the rest become holes, see
``speculation/ragged_batch.py``). Holes cost attention compute and memory, so the batch compacts itself when they
pile up or when the next round would not fit its slot budget.

A finished request's row is *vacated*, not dropped at once: a request joining in the next step takes its place,
written in place into the target and drafter caches (right-aligned, its left part holes), so neither the rows
that stay nor the new one are copied. Why: dropping a row (``batch_select_indices``) and stacking a new one
(``stack_rows``) each copy every row's K/V, and once speculation staggers requests they finish and join one at a
time, so a copy of the whole batch per join would be paid at nearly every step. A joining row wider than the batch
(an agent's conversation that grew past every other) widens every row to the left first, into free slots the cache
buffers keep before their first slot (``kv_cache.GrowingLayer``), and takes its vacant row all the same; where
that room runs out it is stacked. Rows left vacant are dropped before the next decode step, the last rows moving
into their places (``ragged_batch.fill_from_the_end``): only the moved rows are copied, where keeping the rows in
order copies every row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..modeling.draft_cache import DraftCache
from ..kv_cache import cache_from_tensors, extend_front, front_room
from ..speculation.ragged_batch import RaggedBatch, fill_from_the_end, stack_draft_rows, stack_rows
from .requests import Request


@dataclass
class JoiningRows:
    """Requests whose prompts are fully prefilled, ready to be stacked onto the batch: one request with its own
    cache, or several prefilled together in one left-padded forward (the padding slots are holes in ``mask``)."""

    requests: list[Request]
    cache: DynamicCache  # [k, H, S, hd] per layer
    mask: torch.Tensor  # [k, S] 1 = a prompt token's K/V, 0 = left padding
    draft_cache: DraftCache | None
    anchors: list[int]  # each request's first generated token (not yet in any cache)
    anchor_positions: list[int]  # = prompt lengths


class RunningBatch(RaggedBatch):
    """The shared :class:`~hf_dspark.speculation.ragged_batch.RaggedBatch` plus the engine's request of each row
    and :meth:`join` for rows prefilled elsewhere."""

    def __init__(self, config, device: torch.device):
        super().__init__(config, device)
        self.requests: list[Request] = []
        self.vacant: set[int] = set()  # rows whose requests left; dropped (or reused) before the next decode step

    def _reset(self) -> None:
        super()._reset()
        self.requests = []
        self.vacant = set()

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def live_requests(self) -> list[Request]:
        """The requests still decoding (every row's request but the vacant rows')."""
        return [r for row, r in enumerate(self.requests) if row not in self.vacant]

    def vacate(self, rows: list[int]) -> None:
        """Rows whose requests left: kept (caches untouched) until :meth:`join` reuses or drops them."""
        self.vacant.update(rows)

    def drop_vacant(self) -> None:
        """Drop the vacant rows: the last rows move into their places (only those are copied; the order of rows
        means nothing to the engine)."""
        if self.vacant:
            self.keep(fill_from_the_end(len(self.requests), self.vacant))

    def join(self, groups: list[JoiningRows]) -> int:
        """Put freshly prefilled requests into the batch: into vacant rows in place where they fit, the rest
        stacked onto it (one copy of the cache for all of them); vacant rows left over are dropped. Returns how
        many requests took a vacant row."""
        if self._pending and groups:
            raise RuntimeError("flush_context() before join(): deferred drafter context has no rows for new requests")
        groups = [group for group in groups if group.requests]  # every request of a group may have finished
        rows_left = bool(self.vacant)
        joining = sum(len(group.requests) for group in groups)
        if groups and self.vacant and self.cache is not None:
            groups = self._fill_vacant(groups)
        in_place = joining - sum(len(group.requests) for group in groups)
        self.drop_vacant()
        if not groups:
            if rows_left:  # they may have been the widest rows (a device read: only when rows left)
                self.crop_shared_leading_holes()
            return in_place
        self._complete_host_state()
        parts = [] if self.cache is None else [(self.cache, self.mask)]
        parts += [(group.cache, group.mask) for group in groups]
        self.cache, self.mask = stack_rows(parts, self.config) if len(parts) > 1 else parts[0]
        # left padding keeps every row's trailing holes; rows of narrower parts gain leading holes only
        self.host_trailing = self.host_trailing + [0] * sum(len(g.requests) for g in groups)
        drafts = [group.draft_cache for group in groups]
        if all(d is not None for d in drafts):
            self.draft_cache = stack_draft_rows(([self.draft_cache] if self.draft_cache is not None else []) + drafts)
        self.requests.extend(r for group in groups for r in group.requests)
        new_anchors = [a for group in groups for a in group.anchors]
        new_positions = [p for group in groups for p in group.anchor_positions]
        self.anchors = torch.cat([self.anchors, torch.tensor(new_anchors, dtype=torch.long, device=self.device)])
        self.anchor_positions = torch.cat([self.anchor_positions,
                                           torch.tensor(new_positions, dtype=torch.long, device=self.device)])
        self.host_valid = self.host_valid + new_positions  # a prompt's committed slots = its length
        self.host_positions = self.host_positions + new_positions
        return in_place

    def _fill_vacant(self, groups: list[JoiningRows]) -> list[JoiningRows]:
        """Write joining rows into vacant rows, in place; returns the joining rows that did not go in (a row wider
        than the batch by more than its caches' front room, or no vacant row left), regrouped."""
        self._complete_host_state()
        vacant = sorted(self.vacant)
        rest: list[JoiningRows] = []
        for group in groups:
            placed = []
            for i in range(len(group.requests)):
                if not vacant or not self._write_row(vacant[0], group, i):
                    continue
                self.vacant.discard(vacant.pop(0))
                placed.append(i)
            if len(placed) < len(group.requests):
                rest.append(_without_rows(group, placed, self.config))
        return rest

    def _write_row(self, row: int, group: JoiningRows, i: int) -> bool:
        """Joining row ``i`` of ``group`` in place of vacant row ``row``, right-aligned (its left part holes). A row
        wider than the batch first widens every row to the left (:meth:`_widen`), where the cache has the room."""
        if (group.draft_cache is None) != (self.draft_cache is None):
            return False
        wider = group.mask.shape[1] - self.num_slots
        if wider > 0 and front_room(self.cache) < wider:
            return False
        if self.draft_cache is not None and not self.draft_cache.replace_row(row, group.draft_cache, i):
            return False
        if wider > 0:
            self._widen(wider)
        width, group_width = self.num_slots, group.mask.shape[1]
        for layer, new in zip(self.cache.layers, group.cache.layers):
            layer.keys[row, :, width - group_width:] = new.keys[i]
            layer.values[row, :, width - group_width:] = new.values[i]
        self.mask[row] = 0
        self.mask[row, width - group_width:] = group.mask[i]
        self.anchors[row] = group.anchors[i]
        self.anchor_positions[row] = group.anchor_positions[i]
        self.host_valid[row] = self.host_positions[row] = group.anchor_positions[i]  # committed = the prompt
        self.host_trailing[row] = 0
        self.requests[row] = group.requests[i]
        return True

    def _widen(self, slots: int) -> None:
        """``slots`` more slot columns in front of every row, holes (the layout stacking would give every row: left
        padding), written in the buffers' free front slots — no copy of the rows."""
        extend_front(self.cache, slots)
        self.mask = torch.cat([self.mask.new_zeros(self.mask.shape[0], slots), self.mask], dim=1)

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (finished and cancelled requests leave)."""
        if len(rows) != len(self.requests):
            self._complete_host_state()
            self.requests = [self.requests[i] for i in rows]
            self.vacant = {new for new, old in enumerate(rows) if old in self.vacant}
        super().keep(rows)


def _without_rows(group: JoiningRows, placed: list[int], config) -> JoiningRows:
    """``group`` less its rows ``placed`` (a copy of the rest's caches; the group's own when nothing was placed)."""
    if not placed:
        return group
    rows = [i for i in range(len(group.requests)) if i not in placed]
    index = torch.tensor(rows, dtype=torch.long, device=group.mask.device)
    cache = cache_from_tensors([(layer.keys[index], layer.values[index]) for layer in group.cache.layers], config)
    return JoiningRows([group.requests[i] for i in rows], cache, group.mask[index],
                       None if group.draft_cache is None else group.draft_cache.select_rows(rows),
                       [group.anchors[i] for i in rows], [group.anchor_positions[i] for i in rows])


__all__ = ["JoiningRows", "RunningBatch"]
