"""Per-request logits processing over a batch whose rows carry different sampling settings.

Rows are grouped by their settings (``SamplingParams.processing_key``); each group is processed in one call by
``speculation/processing.py``'s RowLogitsProcessor, so p (target) and q (drafter) of a row see exactly the
same warpers, as lossless sampling requires. When a batch mixes greedy and sampled requests the drafter must
sample (``do_sample`` is per batch); greedy rows then get logits that keep only their argmax, so their q is
one-hot and they still draft exactly greedily.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..speculation.processing import RowLogitsProcessor
from .requests import Request


def keep_argmax(logits: torch.Tensor) -> torch.Tensor:
    """-inf everywhere except each row's argmax: softmax is one-hot, sampling is greedy. [n, V]."""
    out = torch.full_like(logits, float("-inf"))
    return out.scatter(-1, logits.argmax(-1, keepdim=True), logits.gather(-1, logits.argmax(-1, keepdim=True)))


class BatchLogitsProcessor:
    """``self(tail_ids [R, k], logits [R, V])`` processes row r's drafter logits with request r's warpers (the
    drafting callback); :meth:`process_positions` does the same for the verify logits [R, W, V]."""

    def __init__(self, requests: Sequence[Request]):
        self.requests = list(requests)
        self.do_sample = any(r.params.do_sample for r in self.requests)
        self._prefixes: list[torch.Tensor] | None = None
        groups: dict[tuple, list[int]] = {}
        for row, request in enumerate(self.requests):
            groups.setdefault(request.params.processing_key, []).append(row)
        self.groups: list[tuple[torch.Tensor, bool, RowLogitsProcessor]] = []
        for rows in groups.values():
            first = self.requests[rows[0]]
            processor = RowLogitsProcessor(first.processors, [])
            if not processor.is_identity and not processor.ids_independent:
                processor.prefixes = [self.prefixes[row] for row in rows]
            self.groups.append((torch.tensor(rows, dtype=torch.long), first.params.do_sample, processor))
        self.is_identity = all(p.is_identity and is_sampled == self.do_sample for _, is_sampled, p in self.groups)

    @property
    def prefixes(self) -> list[torch.Tensor]:
        """Each row's ids so far (prompt + generated; the last one is the anchor), built on first use."""
        if self._prefixes is None:
            self._prefixes = [torch.tensor(r.prompt_ids + r.tokens, dtype=torch.long) for r in self.requests]
        return self._prefixes

    @property
    def generators(self) -> list[torch.Generator]:
        return [r.generator for r in self.requests]

    @property
    def sampled_rows(self) -> list[int]:
        return [row for row, r in enumerate(self.requests) if r.params.do_sample]

    @property
    def greedy_mask(self) -> list[bool]:
        """Per row: decodes greedily (its confidences use the drafter's greedy calibration)."""
        return [not r.params.do_sample for r in self.requests]

    @property
    def greedy_rows(self) -> list[int]:
        return [row for row, r in enumerate(self.requests) if not r.params.do_sample]

    def __call__(self, tail_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if self.is_identity:
            return logits
        out = logits.clone()
        for rows, is_sampled, processor in self.groups:
            rows = rows.to(logits.device)
            if is_sampled:
                out[rows] = processor(tail_ids[rows], logits[rows])
            elif self.do_sample:
                out[rows] = keep_argmax(logits[rows])
        return out

    def process_positions(self, drafts: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Verify logits [R, W, V] at the anchor and drafts [R, W-1]; greedy rows are left raw (argmax only)."""
        out = logits
        for rows, is_sampled, processor in self.groups:
            if is_sampled and not processor.is_identity:
                rows = rows.to(logits.device)
                out = out.clone() if out is logits else out
                out[rows] = processor.process_positions(drafts[rows], logits[rows])
        return out


__all__ = ["BatchLogitsProcessor", "keep_argmax"]
