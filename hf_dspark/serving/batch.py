"""The engine's running batch: every decoding request as one row of a single ragged target cache.

Rows join after their prefill (alone, or together with short prompts admitted in the same step; their cache is
stacked onto the batch, left-padded with holes), leave
when they finish (``batch_select_indices``), and after each verify round keep only the slots of committed
tokens (the rest become holes, see ``generation/ragged_batch.py``). Holes cost attention compute and memory,
so the batch compacts itself when they pile up or when the next round would not fit its slot budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..generation.ragged_batch import (
    compact_draft_cache,
    compact_rows,
    crop_trailing_holes,
    stack_draft_rows,
    stack_rows,
)
from ..modeling.modeling import DraftCache
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


class RunningBatch:
    """Rows = running requests. ``mask`` [R, S] marks committed slots of ``cache``; ``anchors`` [R] are each
    row's last committed token (its K/V is not cached yet) at ``anchor_positions`` [R]."""

    def __init__(self, config, device: torch.device):
        self.config = config
        self.device = device
        self.requests: list[Request] = []
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=device)  # [R, S]
        self.draft_cache: DraftCache | None = None
        self.anchors = torch.zeros(0, dtype=torch.long, device=device)  # [R]
        self.anchor_positions = torch.zeros(0, dtype=torch.long, device=device)  # [R]
        # Target features of committed slots not yet projected into ``draft_cache``: while the scheduler skips
        # the drafter, extending its context every step would be pure overhead, so it happens in one batched
        # projection when drafts are next wanted (see ``defer_context`` / ``flush_context``).
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def _reset(self) -> None:
        self.requests = []
        self.cache, self.draft_cache = None, None
        self.mask = self.mask.new_zeros(0, 0)
        self.anchors, self.anchor_positions = self.anchors[:0], self.anchor_positions[:0]
        self._pending = []

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_slots(self) -> int:
        return self.mask.shape[1]

    def join(self, groups: list[JoiningRows]) -> None:
        """Stack freshly prefilled requests onto the batch (one copy of the cache for all of them)."""
        if not groups:
            return
        if self._pending:
            raise RuntimeError("flush_context() before join(): deferred drafter context has no rows for new requests")
        groups = [group for group in groups if group.requests]  # every request of a group may have finished
        if not groups:
            return
        parts = [] if self.cache is None else [(self.cache, self.mask)]
        parts += [(group.cache, group.mask) for group in groups]
        self.cache, self.mask = stack_rows(parts, self.config) if len(parts) > 1 else parts[0]
        drafts = [group.draft_cache for group in groups]
        if all(d is not None for d in drafts):
            self.draft_cache = stack_draft_rows(([self.draft_cache] if self.draft_cache is not None else []) + drafts)
        self.requests.extend(r for group in groups for r in group.requests)
        new_anchors = torch.tensor([a for group in groups for a in group.anchors], dtype=torch.long,
                                   device=self.device)
        new_positions = torch.tensor([p for group in groups for p in group.anchor_positions], dtype=torch.long,
                                     device=self.device)
        self.anchors = torch.cat([self.anchors, new_anchors])
        self.anchor_positions = torch.cat([self.anchor_positions, new_positions])

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (finished and cancelled requests leave)."""
        if len(rows) == len(self.requests):
            return
        if not rows:
            self._reset()
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.requests = [self.requests[i] for i in rows]
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        if self.draft_cache is not None:
            self.draft_cache = self.draft_cache.select_rows(index)
        self._pending = [(f[index], p[index], v[index]) for f, p, v in self._pending]
        self.anchors, self.anchor_positions = self.anchors[index], self.anchor_positions[index]
        # the rows that left may have been the only ones using the last columns
        self.mask = crop_trailing_holes(self.cache, self.mask)

    def commit_round(self, kept: torch.Tensor, next_tokens: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """After a verify forward appended W slots per row: keep slots of the anchor and accepted drafts
        (``kept`` [R, W]), advance anchors to the recovered / bonus tokens, crop holes shared by every row."""
        self.mask = crop_trailing_holes(self.cache, torch.cat([self.mask, kept.long()], dim=1))
        self.anchors = next_tokens
        self.anchor_positions = self.anchor_positions + num_accepted + 1

    @property
    def num_deferred_steps(self) -> int:
        return len(self._pending)

    def defer_context(self, features: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Remember one round's target features [R, W, m·d] (slots at ``positions``, committed where ``valid``)
        for the drafter context; nothing is computed until :meth:`flush_context`."""
        self._pending.append((features, positions, valid))

    def flush_context(self, draft) -> None:
        """Project every deferred round into ``draft_cache`` at once (slot order is irrelevant to the drafter:
        its attention masks by position and validity)."""
        if not self._pending:
            return
        features, positions, valid = (torch.cat(parts, dim=1) for parts in zip(*self._pending))
        self._pending = []
        self.draft_cache = draft.extend_context(self.draft_cache, features, positions, valid)

    def removable_slots(self) -> int:
        """Slot columns compaction would free: width minus the longest row's committed slots."""
        return self.num_slots - int(self.mask.sum(1).max()) if len(self) else 0

    def compact_if_needed(self, next_width: int, slot_budget: int, max_hole_fraction: float) -> bool:
        """Pack rows when the next round would exceed ``slot_budget`` columns or holes exceed the fraction."""
        if not len(self):
            return False
        too_wide = self.num_slots + next_width > slot_budget
        draft_waste = 0.0
        if self.draft_cache is not None and self.draft_cache.num_slots:
            draft_slots = self.draft_cache.num_slots
            draft_waste = (draft_slots - int(self.draft_cache.valid.sum(1).max())) / draft_slots
        target_waste = self.removable_slots() / max(self.num_slots, 1)
        if not too_wide and max(target_waste, draft_waste) <= max_hole_fraction:
            return False
        self.cache, self.mask = compact_rows(self.cache, self.mask, self.config)
        if self.draft_cache is not None:
            self.draft_cache = compact_draft_cache(self.draft_cache)
        return True


__all__ = ["JoiningRows", "RunningBatch"]
