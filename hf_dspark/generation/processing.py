"""Apply transformers' logits processors to ragged rows exactly as plain ``generate`` would, for p and for q.

In a speculative batch every row has its own length, while a ``LogitsProcessorList`` expects one rectangular
``input_ids``. Processors that ignore the ids (temperature, top-k, top-p, min-p, typical, ε/η) run batched;
any other processor (repetition penalty, no-repeat-n-gram, min-new-tokens, ...) runs per row on that row's
own sequence, so the processed logits equal what plain generation of that row computes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

_IDS_INDEPENDENT = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper,
                    TypicalLogitsWarper, EpsilonLogitsWarper, EtaLogitsWarper)


class RowLogitsProcessor:
    """``processors`` bound to per-row prefixes: ``self(tail_ids [B, k], logits [B, V])`` processes row b's
    logits with input ids ``prefixes[b] + tail_ids[b]``."""

    def __init__(self, processors: LogitsProcessorList | None, prefixes: Sequence[torch.Tensor]):
        self.processors = processors or LogitsProcessorList()
        self.prefixes = prefixes
        self.is_identity = len(self.processors) == 0
        self.ids_independent = all(isinstance(p, _IDS_INDEPENDENT) for p in self.processors)

    def __call__(self, tail_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if self.is_identity:
            return logits
        if self.ids_independent:
            return self.processors(tail_ids, logits)
        rows = []
        for b, prefix in enumerate(self.prefixes):
            ids = torch.cat([prefix, tail_ids[b]])[None]
            rows.append(self.processors(ids, logits[b:b + 1]))
        return torch.cat(rows, dim=0)

    def process_positions(self, tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Target side: logits [B, W, V] at the anchor and W-1 drafts ``tokens`` [B, W-1]; position i is
        processed with prefix + tokens[:, :i] (the same ids the draft side used for slot i)."""
        if self.is_identity:
            return logits
        return torch.stack([self(tokens[:, :i], logits[:, i]) for i in range(logits.shape[1])], dim=1)
