"""Apply transformers' logits processors to ragged rows exactly as plain ``generate`` would, for p and for q.

In a speculative batch every row has its own length, while a ``LogitsProcessorList`` expects one rectangular
``input_ids``. Processors that ignore the ids (temperature, top-k, top-p, min-p, typical, ε/η) run batched;
any other processor (repetition penalty, no-repeat-n-gram, min-new-tokens, ...) runs per row on that row's
own sequence, so the processed logits equal what plain generation of that row computes.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
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


def _unpadded_repetition_penalty(processor: RepetitionPenaltyLogitsProcessor, num_pad: int):
    # generate() gives it the batch's left-padding lengths so padding is not penalised; our rows are unpadded
    if isinstance(processor.prompt_ignore_length, torch.Tensor):
        processor = copy.copy(processor)
        processor.prompt_ignore_length = None
    return processor


def _unpadded_min_new_tokens(processor: MinNewTokensLengthLogitsProcessor, num_pad: int):
    # generate() counts new tokens from the padded prompt length; an unpadded row's prompt is num_pad shorter
    processor = copy.copy(processor)
    processor.prompt_length_to_skip = processor.prompt_length_to_skip - num_pad
    return processor


# Processors whose state depends on the batch's padding -> their form for one unpadded row.
_ROW_ADAPTERS = {RepetitionPenaltyLogitsProcessor: _unpadded_repetition_penalty,
                 MinNewTokensLengthLogitsProcessor: _unpadded_min_new_tokens}


def adapt_for_rows(processors: LogitsProcessorList | None, num_pad: Sequence[int]) -> list[LogitsProcessorList]:
    """For each row, the processors generate() prepared for the padded batch, rewritten for that row alone."""
    processors = processors or LogitsProcessorList()
    return [LogitsProcessorList(_ROW_ADAPTERS[type(p)](p, pad) if type(p) in _ROW_ADAPTERS else p for p in processors)
            for pad in num_pad]


def apply_processors(processors: LogitsProcessorList, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``processors(input_ids, scores)`` without ``LogitsProcessorList.__call__``'s per-call ``inspect.signature``
    of every processor (≈ 0.2 ms each): plain generate pays it once per token, a speculative round once per drafted
    slot and verified position. Same semantics for the two-argument call generate makes."""
    for processor in processors:
        scores = processor(input_ids, scores)
    return scores


class RowLogitsProcessor:
    """Per-row processors bound to per-row prefixes: ``self(tail_ids [B, k], logits [B, V])`` processes row b's
    logits with ``processors[b]`` and input ids ``prefix_b + tail_ids[b]``. ``processors`` is one list per row
    (see :func:`adapt_for_rows`) or a single list shared by all rows.

    Prefixes come either as tensors (``prefixes``) or from a :class:`~.row_tokens.RowTokens` (``tokens`` and the
    batch's ``rows``): then "prefix + tail" is a slice of its device buffer, built in O(k) instead of
    concatenating the whole prefix for every slot and position."""

    def __init__(self, processors, prefixes: Sequence[torch.Tensor] | None = None, *, tokens=None,
                 rows: Sequence[int] | None = None):
        if processors is None or isinstance(processors, LogitsProcessorList):
            self.processors = processors or LogitsProcessorList()
            self.row_processors = None  # one list shared by every row
        else:
            self.row_processors = list(processors)
            self.processors = self.row_processors[0] if self.row_processors else LogitsProcessorList()
        self._prefixes = None if prefixes is None else list(prefixes)
        self.tokens, self.rows = tokens, None if rows is None else list(rows)
        self.is_identity = len(self.processors) == 0 and not any(self.row_processors or [])
        self.ids_independent = all(isinstance(p, _IDS_INDEPENDENT) for p in self.processors)

    @property
    def prefixes(self) -> list[torch.Tensor]:
        """Each row's ids so far (its own tokens, the anchor last)."""
        if self._prefixes is not None:
            return self._prefixes
        return [self.tokens.own_view(row) for row in self.rows]

    @prefixes.setter
    def prefixes(self, value: Sequence[torch.Tensor]) -> None:
        self._prefixes = list(value)

    def _ids(self, b: int, tail: torch.Tensor) -> torch.Tensor:
        if self._prefixes is None:
            return self.tokens.own_view_with(self.rows[b], tail)
        return torch.cat([self._prefixes[b], tail])

    def __call__(self, tail_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if self.is_identity:
            return logits
        if self.ids_independent:
            return apply_processors(self.processors, tail_ids, logits)
        rows = []
        for b in range(logits.shape[0]):
            processors = self.processors if self.row_processors is None else self.row_processors[b]
            rows.append(apply_processors(processors, self._ids(b, tail_ids[b])[None], logits[b:b + 1]))
        return torch.cat(rows, dim=0)

    def process_positions(self, tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Target side: logits [B, W, V] at the anchor and W-1 drafts ``tokens`` [B, W-1]; position i is
        processed with prefix + tokens[:, :i] (the same ids the draft side used for slot i)."""
        if self.is_identity:
            return logits
        return torch.stack([self(tokens[:, :i], logits[:, i]) for i in range(logits.shape[1])], dim=1)
