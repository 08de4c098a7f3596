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

from ..generation.ragged_batch import RaggedBatch, stack_draft_rows, stack_rows
from ..modeling.draft_cache import DraftCache
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
    """The shared :class:`~hf_dspark.generation.ragged_batch.RaggedBatch` plus the engine's request of each row
    and :meth:`join` for rows prefilled elsewhere."""

    def __init__(self, config, device: torch.device):
        super().__init__(config, device)
        self.requests: list[Request] = []

    def _reset(self) -> None:
        super()._reset()
        self.requests = []

    def __len__(self) -> int:
        return len(self.requests)

    def join(self, groups: list[JoiningRows]) -> None:
        """Stack freshly prefilled requests onto the batch (one copy of the cache for all of them)."""
        if not groups:
            return
        if self._pending:
            raise RuntimeError("flush_context() before join(): deferred drafter context has no rows for new requests")
        groups = [group for group in groups if group.requests]  # every request of a group may have finished
        if not groups:
            return
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

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (finished and cancelled requests leave)."""
        if len(rows) != len(self.requests):
            self._complete_host_state()
            self.requests = [self.requests[i] for i in rows]
        super().keep(rows)


__all__ = ["JoiningRows", "RunningBatch"]
