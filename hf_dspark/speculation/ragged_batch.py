"""One KV cache for a ragged batch: rows of different lengths, rejected draft slots kept as masked *holes*.

Layout shared by ``generate`` (one batch of prompts) and the serving engine (requests joining and leaving):
the target's ``DynamicCache`` holds tensors [R, H, S, hd] and a long mask [R, S] says which slots hold K/V of a
committed token (1) and which are holes (0). Every row carries explicit position ids, so a hole costs attention
compute but never shifts a position. Causality is by slot index: new tokens are always appended after every
existing slot, so holes anywhere in the past are harmless. The drafter's ``DraftCache`` has the same shape of
problem (``valid`` [R, S] plus per-slot ``positions``) and gets the same three operations:

* :func:`crop_trailing_holes` drops slot columns that are holes in every row (cheap, every round);
* :func:`stack_rows` puts separately prefilled rows into one batch, left-padding the shorter ones with holes;
* :func:`compact_rows` packs each row's committed slots to the right, removing holes (a full copy, so the
  engine runs it only when holes have piled up).

:class:`RaggedBatch` is the state object the speculative round works on (``generate`` and the engine's running
batch): the caches, each row's anchor, and the host-side facts (committed slots, trailing holes, positions) that
let a round decide cropping and compaction without reading anything back from the device.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..modeling.draft_cache import ContextUpdate, DraftCache
from ..modeling.target_support import cache_kwarg  # noqa: F401 (re-exported: this is where callers looked for it)
from ..kv_cache import cache_from_tensors, drop_rows_in_place


def num_trailing_holes(mask: torch.Tensor) -> int:
    """Slot columns at the end of the cache that are holes in every row. mask [R, S]."""
    return int((mask.flip(1).cumsum(1) == 0).sum(1).min())


def crop_trailing_holes(cache: DynamicCache, mask: torch.Tensor) -> torch.Tensor:
    """Drop the trailing columns that are holes in every row from ``cache`` (in place); returns the new mask."""
    trailing = num_trailing_holes(mask)
    if trailing:
        cache.crop(-trailing)  # transformers >= 5.24: a negative count is the number of slots to drop
        mask = mask[:, :-trailing]
    return mask


def _layer_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _left_pad(x: torch.Tensor, width: int, dim: int, value=0) -> torch.Tensor:
    """Pad ``x`` at the front of ``dim`` to ``width`` slots."""
    missing = width - x.shape[dim]
    if missing <= 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [missing, 0]
    return F.pad(x, pad, value=value)


def _stacked(tensors: Sequence[torch.Tensor], width: int, dim: int, value=0) -> torch.Tensor:
    """``tensors`` concatenated along dim 0, each right-aligned in ``width`` slots of ``dim`` (left-padded with
    ``value``): one copy of each part into the result (padding then concatenating copies every part twice), and
    only the padding filled (filling the whole result first wrote every slot twice)."""
    if len(tensors) == 1:
        return _left_pad(tensors[0], width, dim, value)
    shape = list(tensors[0].shape)
    shape[0], shape[dim] = sum(t.shape[0] for t in tensors), width
    out = tensors[0].new_empty(shape)
    row = 0
    for t in tensors:
        rows, missing = out[row: row + t.shape[0]], width - t.shape[dim]
        rows.narrow(dim, missing, t.shape[dim]).copy_(t)
        if missing:
            rows.narrow(dim, 0, missing).fill_(value)
        row += t.shape[0]
    return out


def stack_rows(parts: Sequence[tuple[DynamicCache, torch.Tensor]], config) -> tuple[DynamicCache, torch.Tensor]:
    """Concatenate ragged-batch caches along the batch; shorter ones are left-padded with holes.

    ``parts``: (cache [r_i, H, S_i, hd] per layer, mask [r_i, S_i]). Returns a new cache and mask [Σr_i, max S_i]."""
    width = max(mask.shape[1] for _, mask in parts)
    per_part = [_layer_tensors(cache) for cache, _ in parts]
    layers = [(_stacked([tensors[layer][0] for tensors in per_part], width, 2),
               _stacked([tensors[layer][1] for tensors in per_part], width, 2)) for layer in range(len(per_part[0]))]
    mask = _stacked([mask for _, mask in parts], width, 1)
    return cache_from_tensors(layers, config), mask


def packing_index(valid: torch.Tensor) -> torch.Tensor:
    """[R, S'] slot indices that move each row's valid slots (in order) to the right end of a width-S' row,
    S' = the largest number of valid slots in a row; the leading entries of shorter rows point at holes."""
    counts = valid.long().sum(1)
    width = int(counts.max()) if counts.numel() else 0
    # stable sort on the 0/1 flag: holes first, then valid slots in their original order
    order = torch.sort(valid.to(torch.uint8), dim=1, stable=True).indices
    return order[:, order.shape[1] - width:]


def _gather_slots(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [R, H, S, hd], index [R, S'] -> [R, H, S', hd] (a view of a [R, S', H, hd] tensor): one row-wise
    ``index_select`` over (row, slot) pairs moves whole H × hd blocks, ~3× faster on a CPU than an elementwise
    ``gather`` with the index broadcast over heads and head dims."""
    rows, heads, slots, dim = x.shape
    flat = (index + torch.arange(rows, device=index.device)[:, None] * slots).reshape(-1)
    picked = x.transpose(1, 2).reshape(rows * slots, heads, dim).index_select(0, flat)
    return picked.view(rows, index.shape[1], heads, dim).transpose(1, 2)


def compact_rows(cache: DynamicCache, mask: torch.Tensor, config) -> tuple[DynamicCache, torch.Tensor]:
    """Remove holes: every row keeps exactly its committed slots, packed right (positions are unchanged, as they
    travel as explicit ids). Returns a new cache and mask [R, max valid]."""
    index = packing_index(mask.bool())
    layers = [(_gather_slots(k, index), _gather_slots(v, index)) for k, v in _layer_tensors(cache)]
    return cache_from_tensors(layers, config), mask.gather(1, index)


def stack_draft_rows(parts: Sequence[DraftCache]) -> DraftCache:
    """:func:`stack_rows` for drafter caches (padding slots are invalid, position 0)."""
    width = max(part.num_slots for part in parts)
    num_layers = len(parts[0].keys)
    keys = [_stacked([p.keys[i] for p in parts], width, 2) for i in range(num_layers)]
    values = [_stacked([p.values[i] for p in parts], width, 2) for i in range(num_layers)]
    valid = _stacked([p.valid for p in parts], width, 1, value=False)
    positions = _stacked([p.positions for p in parts], width, 1)
    has_tail = all(p.tail is not None for p in parts)  # autoregressive drafters: each row's last entry state
    return DraftCache(keys, values, valid, positions, torch.cat([p.tail for p in parts]) if has_tail else None,
                      torch.cat([p.tail_positions for p in parts]) if has_tail else None)


def compact_draft_cache(cache: DraftCache) -> DraftCache:
    """:func:`compact_rows` for a drafter cache."""
    if cache.valid is None:
        return cache
    index = packing_index(cache.valid)
    return DraftCache([_gather_slots(k, index) for k in cache.keys], [_gather_slots(v, index) for v in cache.values],
                      cache.valid.gather(1, index), cache.positions.gather(1, index), cache.tail,
                      cache.tail_positions)


def fill_from_the_end(num_rows: int, leaving: Iterable[int]) -> list[int]:
    """The rows to keep when ``leaving`` rows leave a batch of ``num_rows``: the rows that stay, each in its own
    place except the last ones, which move into the places the leaving rows free below them. Handed to
    :meth:`RaggedBatch.keep`, dropping rows then copies only the few that move (keeping the rows in order would
    shift, so copy, every row after the first that leaves)."""
    leaving = set(leaving)
    staying = [row for row in range(num_rows) if row not in leaving]
    kept = len(staying)
    movers = iter(row for row in staying if row >= kept)
    return [row if row not in leaving else next(movers) for row in range(kept)]


class RaggedBatch:
    """Rows of a speculative batch sharing one target cache (``mask`` [R, S]: 1 = a committed token's K/V,
    0 = a hole) and one drafter cache; ``anchors`` [R] are each row's last committed token (not cached yet) at
    ``anchor_positions`` [R]. Host mirrors (``host_*``) track what the round needs to decide without a device
    read: committed slots per row, trailing holes per row, anchor positions.

    The drafter context of committed slots is deferred (:meth:`defer_context`) and projected in one batched
    call when drafts are next wanted (:meth:`flush_context`): while a policy skips the drafter, extending its
    context every round would be pure overhead.
    """

    def __init__(self, config, device: torch.device):
        self.config = config
        self.device = device
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=device)  # [R, S]
        self.draft_cache: DraftCache | None = None
        self.anchors = torch.zeros(0, dtype=torch.long, device=device)  # [R]
        self.anchor_positions = torch.zeros(0, dtype=torch.long, device=device)  # [R]
        self.host_valid: list[int] = []  # committed slots per row in the target cache
        self.host_trailing: list[int] = []  # trailing holes per row
        self.host_positions: list[int] = []  # anchor position per row
        self._pending: list[ContextUpdate] = []  # deferred drafter context, one entry per round

    def __len__(self) -> int:
        return self.anchors.shape[0]

    @property
    def num_slots(self) -> int:
        return self.mask.shape[1]

    @property
    def has_holes(self) -> bool:
        """Whether any slot of any row is a hole (host mirrors only, no device read). Without holes the mask is
        all ones and slot order is position order, so the target's own causal mask is the same mask."""
        self._complete_host_state()
        return any(valid != self.num_slots for valid in self.host_valid)

    def start(self, cache: DynamicCache, mask: torch.Tensor, anchors: torch.Tensor, anchor_positions: torch.Tensor,
              host_valid: Sequence[int], host_positions: Sequence[int], draft_cache: DraftCache | None = None,
              host_trailing: Sequence[int] | None = None) -> None:
        """Install freshly prefilled rows (replacing whatever the batch held)."""
        self.cache, self.mask, self.draft_cache = cache, mask, draft_cache
        self.anchors, self.anchor_positions = anchors, anchor_positions
        self.host_valid, self.host_positions = list(host_valid), list(host_positions)
        self.host_trailing = list(host_trailing) if host_trailing is not None else [0] * len(self.host_valid)
        self._pending = []

    def _reset(self) -> None:
        self.cache, self.draft_cache = None, None
        self.mask = self.mask.new_zeros(0, 0)
        self.anchors, self.anchor_positions = self.anchors[:0], self.anchor_positions[:0]
        self.host_valid, self.host_trailing, self.host_positions = [], [], []
        self._pending = []

    def _complete_host_state(self) -> None:
        """Fill host mirrors a caller did not provide (rows set up by hand) from the device state, once."""
        rows = self.mask.shape[0]
        if len(self.host_valid) != rows:
            self.host_valid = self.mask.sum(1).tolist()
        if len(self.host_trailing) != rows:
            self.host_trailing = (self.mask.flip(1).cumsum(1) == 0).sum(1).tolist()
        if len(self.host_positions) != rows:
            self.host_positions = self.anchor_positions.tolist()

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (finished and cancelled rows leave; host ints, in order). When every row that changes
        place comes from past the kept ones (:func:`fill_from_the_end` orders them so), only those rows' K/V are
        copied and the rest stay in place; any other order copies every kept row."""
        rows = list(rows)
        if len(rows) == self.mask.shape[0]:
            return
        if not rows:
            self._reset()
            return
        self._complete_host_state()
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        moves = [(dst, src) for dst, src in enumerate(rows) if dst != src]
        in_place = len(set(rows)) == len(rows) and all(src >= len(rows) for _, src in moves)
        if not (in_place and drop_rows_in_place(self.cache, moves, len(rows))):
            self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        if self.draft_cache is not None:
            self.draft_cache = self.draft_cache.select_rows(rows)
        self._pending = [ContextUpdate(part.features[index], part.positions[index], part.valid[index],
                                       None if part.next_ids is None else part.next_ids[index],
                                       None if part.counts is None else [part.counts[r] for r in rows])
                         for part in self._pending]
        self.anchors, self.anchor_positions = self.anchors[index], self.anchor_positions[index]
        self.host_valid = [self.host_valid[r] for r in rows]
        self.host_trailing = [self.host_trailing[r] for r in rows]
        self.host_positions = [self.host_positions[r] for r in rows]
        self._crop_shared_trailing_holes()  # the rows that left may have been the only ones using the last columns

    def commit_round(self, kept: torch.Tensor, next_tokens: torch.Tensor, num_accepted: torch.Tensor,
                     host_accepted: Sequence[int] | None = None) -> None:
        """After a verify forward appended W slots per row: keep the slots of the anchor and the accepted drafts
        (``kept`` [R, W]), advance anchors to the recovered / bonus tokens, crop holes shared by every row.
        ``host_accepted`` (the accepted counts as host ints) keeps the host mirrors exact without a device read."""
        width = kept.shape[1]
        self._complete_host_state()
        if host_accepted is None:
            host_accepted = num_accepted.tolist()
        self.mask = torch.cat([self.mask, kept.to(self.mask.dtype)], dim=1)
        self.host_valid = [v + a + 1 for v, a in zip(self.host_valid, host_accepted)]
        self.host_trailing = [width - 1 - a for a in host_accepted]  # the anchor slot is always kept
        self.host_positions = [p + a + 1 for p, a in zip(self.host_positions, host_accepted)]
        self.anchors = next_tokens
        self.anchor_positions = self.anchor_positions + num_accepted + 1
        self._crop_shared_trailing_holes()

    def crop_shared_leading_holes(self) -> int:
        """Drop the leading slot columns that are holes in every row (a view of the caches, no copy; one device
        read): after rows leave or join, the columns only the longest rows reached may be empty in every row.
        Returns how many were dropped."""
        if self.cache is None or not self.num_slots:
            return 0
        leading = int((self.mask.cumsum(1) == 0).sum(1).min())
        if leading:
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, leading:], layer.values[:, :, leading:]
            self.mask = self.mask[:, leading:]
        return leading

    def _crop_shared_trailing_holes(self) -> None:
        trailing = min(self.host_trailing, default=0)
        if trailing:
            self.cache.crop(-trailing)  # transformers >= 5.24: a negative count is the number of slots to drop
            self.mask = self.mask[:, :-trailing]
            self.host_trailing = [t - trailing for t in self.host_trailing]

    # -- drafter context --------------------------------------------------------------------------------------
    @property
    def num_deferred_steps(self) -> int:
        return len(self._pending)

    def defer_context(self, features: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                      next_ids: torch.Tensor | None = None, counts: Sequence[int] | None = None) -> None:
        """Remember one round's target features [R, W, m·d] (slots at ``positions``, committed where ``valid``;
        ``next_ids`` the token after each slot, for autoregressive drafters; ``counts`` the committed slots per
        row on the host); nothing is computed until :meth:`flush_context`."""
        self._pending.append(ContextUpdate(features, positions, valid, next_ids,
                                           None if counts is None else list(counts)))

    def take_context(self) -> ContextUpdate | None:
        """Every deferred round joined into one update (None when nothing is deferred), handed to a drafter that
        projects it in its drafting pass (``DrafterArchitecture.fuses_context``); the batch forgets it."""
        pending, self._pending = self._pending, []
        if len(pending) <= 1:
            return pending[0] if pending else None

        def joined(name: str) -> torch.Tensor:
            return torch.cat([getattr(part, name) for part in pending], dim=1)

        next_ids = joined("next_ids") if all(part.next_ids is not None for part in pending) else None
        host_counts = [part.counts for part in pending]
        counts = [sum(c) for c in zip(*host_counts)] if all(c is not None for c in host_counts) else None
        return ContextUpdate(joined("features"), joined("positions"), joined("valid"), next_ids, counts)

    def flush_context(self, draft) -> None:
        """Project every deferred round into ``draft_cache`` at once, packed (slot order is irrelevant to the
        drafter: its attention masks by position and validity)."""
        update = self.take_context()
        if update is None:
            return
        cache = self.draft_cache if self.draft_cache is not None else DraftCache()
        self.draft_cache = draft.extend_context(cache, update.features, update.positions, update.valid,
                                                update.next_ids, packed=True, counts=update.counts)

    def flush_backlog(self, draft) -> None:
        """Project every deferred round but the latest (the next drafting pass takes that one as usual): what
        rounds the drafter skipped left behind, so a drafting round can time its own work apart from it."""
        if len(self._pending) <= 1:
            return
        latest = self._pending.pop()
        self.flush_context(draft)
        self._pending.append(latest)

    def row_caches(self, row: int, draft=None) -> tuple[DynamicCache, DraftCache | None]:
        """Row ``row``'s committed K/V as a dense batch-1 target cache (slot = position: its holes dropped) and,
        with ``draft``, its drafter context (deferred rounds projected first): what a later request continuing
        this row's text can start from instead of prefilling it."""
        if draft is not None:
            self.flush_context(draft)
        index = self.mask[row].nonzero()[:, 0]  # a device read: once per kept request, not per round
        layers = [(k[row:row + 1].index_select(2, index), v[row:row + 1].index_select(2, index))
                  for k, v in _layer_tensors(self.cache)]
        cache = cache_from_tensors(layers, self.config)
        draft_cache = self.draft_cache.row(row) if draft is not None and self.draft_cache is not None else None
        return cache, draft_cache

    # -- holes ------------------------------------------------------------------------------------------------
    def removable_slots(self) -> int:
        """Slot columns compaction would free: width minus the longest row's committed slots."""
        return self.num_slots - max(self.host_valid) if len(self) else 0

    def compact_if_needed(self, next_width: int, slot_budget: int, max_hole_fraction: float) -> bool:
        """Pack rows when the next round would exceed ``slot_budget`` columns or holes exceed the fraction (the
        drafter cache, whose holes come from the same rows, is packed with it)."""
        if not len(self):
            return False
        too_wide = self.num_slots + next_width > slot_budget
        if not too_wide and self.removable_slots() <= max_hole_fraction * max(self.num_slots, 1):
            return False
        self.cache, self.mask = compact_rows(self.cache, self.mask, self.config)
        self.host_trailing = [0] * len(self)
        if self.draft_cache is not None and self.draft_cache.num_slots:
            self.draft_cache = compact_draft_cache(self.draft_cache)
        return True


__all__ = ["RaggedBatch", "cache_kwarg", "compact_draft_cache", "compact_rows", "crop_trailing_holes", "fill_from_the_end",
           "num_trailing_holes", "packing_index", "stack_draft_rows", "stack_rows"]
