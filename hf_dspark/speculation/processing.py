"""Apply transformers' logits processors to ragged rows exactly as plain ``generate`` would, for p and for q.

In a speculative batch every row has its own length, while a ``LogitsProcessorList`` expects one rectangular
``input_ids``. Processors that ignore the ids (temperature, top-k/p/h, min-p, typical, ε/η, renormalisation, inf/nan
removal) run batched, and so do the common ones rewritten for a row without its padding (a repetition penalty reads
the set of ids; min-length and min-new-tokens only each row's length); any other processor (no-repeat-n-gram, forced
or suppressed tokens at a length, ``prefix_allowed_tokens_fn``, custom ones, ...) runs per row on the row as plain
batched ``generate`` shows it, left padding included, so it computes what plain generate computes for that row.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
from transformers.generation.logits_process import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SynthIDTextWatermarkLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)

from .row_tokens import pad_with_last

_IDS_INDEPENDENT = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper,
                    TypicalLogitsWarper, EpsilonLogitsWarper, EtaLogitsWarper, TopHLogitsWarper, LogitNormalization,
                    InfNanRemoveLogitsProcessor)


def _unpadded_repetition_penalty(processor: RepetitionPenaltyLogitsProcessor, row: int, num_pad: int):
    # prompt_ignore_length counts leading positions of the padded batch: one count for every row (a caller's int) or
    # one per row (generate() passes each row's padding length, so padding is not penalised). An unpadded row's own
    # tokens start num_pad positions later, so it skips that many fewer (None: it skips none).
    ignore = processor.prompt_ignore_length
    if ignore is None or (isinstance(ignore, int) and not num_pad):
        return processor
    ignore = int(ignore[row]) if isinstance(ignore, torch.Tensor) else ignore
    processor = copy.copy(processor)
    processor.prompt_ignore_length = max(ignore - num_pad, 0) or None
    return processor


def _unpadded_min_new_tokens(processor: MinNewTokensLengthLogitsProcessor, row: int, num_pad: int):
    # generate() counts new tokens from the padded prompt length; an unpadded row's prompt is num_pad shorter
    processor = copy.copy(processor)
    processor.prompt_length_to_skip = processor.prompt_length_to_skip - num_pad
    return processor


def _unpadded_min_length(processor: MinLengthLogitsProcessor, row: int, num_pad: int):
    # generate() compares min_length with the padded length; an unpadded row is num_pad shorter
    processor = copy.copy(processor)
    processor.min_length = max(processor.min_length - num_pad, 0)
    return processor


# Processors whose state depends on the batch's padding -> their form for one unpadded row (these read the row
# without its padding, which lets them run batched).
_ROW_ADAPTERS = {RepetitionPenaltyLogitsProcessor: _unpadded_repetition_penalty,
                 MinNewTokensLengthLogitsProcessor: _unpadded_min_new_tokens,
                 MinLengthLogitsProcessor: _unpadded_min_length}


class _PaddedRow(LogitsProcessor):
    """``processor`` shown one row as plain batched generate shows it: its left padding, then its own ids.

    Why: many processors read the row's length (suppressed tokens at the first step, forced EOS at max_length,
    forced BOS, the exponential length penalty, ``prefix_allowed_tokens_fn``, custom ones) or its padding ids
    (no-repeat-n-gram bans n-grams of pads too); given the row alone they act at other steps than plain generate."""

    def __init__(self, processor, padding: torch.Tensor):  # padding: [num_pad]
        self.processor, self.padding = processor, padding

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        padding = self.padding.to(input_ids.device).expand(input_ids.shape[0], -1)
        return self.processor(torch.cat([padding, input_ids], dim=1), scores)


def _row_of_prefix_constraint(processor: PrefixConstrainedLogitsProcessor, row: int):
    # the function is called with the batch index plain generate gives it, not 0 for every row alone
    allowed = processor._prefix_allowed_tokens_fn
    processor = copy.copy(processor)
    processor._prefix_allowed_tokens_fn = lambda _, sent: allowed(row, sent)
    return processor


def _row_of_encoder_no_repeat(processor: EncoderNoRepeatNGramLogitsProcessor, row: int):
    processor = copy.copy(processor)
    processor.generated_ngrams, processor.batch_size = [processor.generated_ngrams[row]], 1
    return processor


def _row_of_encoder_repetition_penalty(processor: EncoderRepetitionPenaltyLogitsProcessor, row: int):
    processor = copy.copy(processor)
    processor.encoder_input_ids = processor.encoder_input_ids[row:row + 1]
    return processor


# Processors holding one entry per batch row (for a decoder-only target, generate() passes the padded prompts as
# "encoder" ids) -> the processor of one row, called with that row alone.
_BATCH_ROW_ADAPTERS = {PrefixConstrainedLogitsProcessor: _row_of_prefix_constraint,
                       EncoderNoRepeatNGramLogitsProcessor: _row_of_encoder_no_repeat,
                       EncoderRepetitionPenaltyLogitsProcessor: _row_of_encoder_repetition_penalty}


def _for_row(processor, row: int, padding: torch.Tensor):
    if type(processor) in _ROW_ADAPTERS:
        return _ROW_ADAPTERS[type(processor)](processor, row, padding.shape[0])
    if type(processor) in _BATCH_ROW_ADAPTERS:
        processor = _BATCH_ROW_ADAPTERS[type(processor)](processor, row)
    if padding.shape[0] and not isinstance(processor, _IDS_INDEPENDENT):
        return _PaddedRow(processor, padding)
    return processor


# Processors that keep state advanced once per call (one call per generated token in plain generate): a speculative
# round calls them for drafted and verified positions, rejected ones included, so they cannot run here.
_PER_STEP_STATE = {
    UnbatchedClassifierFreeGuidanceLogitsProcessor:
        "guidance_scale (classifier-free guidance) is not supported with a DSpark assistant_model: its processor runs "
        "the target on the unconditional prompt one token per call, with a cache of its own, which a speculative "
        "round (several positions per call, rejected drafts) cannot feed. Drop guidance_scale or assistant_model.",
    SynthIDTextWatermarkLogitsProcessor:
        "watermarking_config=SynthIDTextWatermarkingConfig(...) is not supported with a DSpark assistant_model: its "
        "processor keeps state (the n-gram context and its history) advanced once per call, which drafted and "
        "rejected positions would advance too. WatermarkingConfig (stateless) works; or drop assistant_model.",
}


def _raise_if_per_step_state(processors: LogitsProcessorList) -> None:
    for processor in processors:
        if type(processor) in _PER_STEP_STATE:
            raise ValueError(_PER_STEP_STATE[type(processor)])


def adapt_for_rows(processors: LogitsProcessorList | None, input_ids: torch.Tensor,
                   num_pad: Sequence[int]) -> list[LogitsProcessorList]:
    """For each row, the processors generate() prepared for the padded batch ``input_ids`` [B, prompt] (row b has
    ``num_pad[b]`` pads on the left), rewritten to be called with that row's own ids alone. Refuses processors
    with per-step state (``_PER_STEP_STATE``)."""
    processors = processors or LogitsProcessorList()
    _raise_if_per_step_state(processors)
    return [LogitsProcessorList(_for_row(p, row, input_ids[row, :pad]) for p in processors)
            for row, pad in enumerate(num_pad)]


def apply_processors(processors: LogitsProcessorList, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``processors(input_ids, scores)`` without ``LogitsProcessorList.__call__``'s per-call ``inspect.signature``
    of every processor: plain generate pays it once per token, a speculative round once per drafted slot and
    verified position. Same semantics for the two-argument call generate makes."""
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
        num_rows = len(self.rows or self._prefixes or self.row_processors or [None])
        # one row is its own buffer slice already: per-row calls are cheaper than padding it
        self.batched = not self.ids_independent and num_rows > 1 and self._batchable()
        self._index_cache: dict = {}  # row indices on the device, for this batch of rows (one round)

    def _batchable(self) -> bool:
        """Whether every row's processors can run as one batched call (see :meth:`_batched_call`): the lists
        agree in types and, but for the per-row adapted fields, are the same processors."""
        lists = self.row_processors or [self.processors]
        if len({tuple(type(p) for p in procs) for procs in lists}) != 1:
            return False
        for i, processor in enumerate(self.processors):
            column = [procs[i] for procs in lists]
            if isinstance(processor, RepetitionPenaltyLogitsProcessor):
                if any(p.prompt_ignore_length is not None or p.penalty != processor.penalty for p in column):
                    return False
            elif isinstance(processor, (MinNewTokensLengthLogitsProcessor, MinLengthLogitsProcessor)):
                pass  # read per row from the row's own (adapted) instance
            elif not isinstance(processor, _IDS_INDEPENDENT) or any(p is not processor for p in column):
                return False
        return True

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
        if self.batched:
            return self._batched_call(tail_ids, logits)
        rows = []
        for b in range(logits.shape[0]):
            processors = self.processors if self.row_processors is None else self.row_processors[b]
            rows.append(apply_processors(processors, self._ids(b, tail_ids[b])[None], logits[b:b + 1]))
        return torch.cat(rows, dim=0)

    def _batched_call(self, tail_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """All rows at once, equal to the per-row calls: a repetition penalty reads the rows' ids right-padded with
        a duplicate of each row's last id (the set of ids, all it reads, is unchanged); min-new-tokens reads only
        each row's length (min-length likewise), so its EOS mask is applied to the rows still below the minimum; id-independent
        processors are shared by all rows."""
        num_rows, k = logits.shape[0], tail_ids.shape[1]
        if self._prefixes is None:
            lengths = [self.tokens.lengths[r] + k - self.tokens.num_pad[r] for r in self.rows]
        else:
            lengths = [prefix.shape[0] + k for prefix in self._prefixes]
        ids = tail_ids  # what id-independent processors get; the padded rows are built only for one that reads them
        if any(isinstance(p, RepetitionPenaltyLogitsProcessor) for p in self.processors):
            if self._prefixes is None:
                ids, _ = self.tokens.own_ids_with(self.rows, tail_ids, self._index_cache)
            else:
                ids = pad_with_last([self._ids(b, tail_ids[b]) for b in range(num_rows)])
        lists = self.row_processors or [self.processors] * num_rows
        for i, processor in enumerate(self.processors):
            if isinstance(processor, (MinNewTokensLengthLogitsProcessor, MinLengthLogitsProcessor)):
                # row b blocks EOS while its own length is below its threshold (both in the row's own tokens)
                if isinstance(processor, MinLengthLogitsProcessor):
                    thresholds = [procs[i].min_length for procs in lists]
                else:
                    thresholds = [procs[i].prompt_length_to_skip + procs[i].min_new_tokens for procs in lists]
                if any(n < t for n, t in zip(lengths, thresholds)):
                    eos, base, limit = self._length_masks(i, processor, thresholds, lengths, k, logits)
                    logits = torch.where(eos[None, :] & (base + k < limit)[:, None], -math.inf, logits)
            else:
                logits = processor(ids, logits)
        return logits

    def _length_masks(self, i: int, processor, thresholds, lengths, k: int, logits: torch.Tensor):
        """Processor i's EOS mask [V] and the rows' lengths before the tail and thresholds [R], on the device once
        per batch of rows (one round), not per call."""
        key = ("length", i)
        if key not in self._index_cache:
            vocab = torch.arange(logits.shape[-1], device=logits.device)
            eos = torch.isin(vocab, torch.as_tensor(processor.eos_token_id, device=logits.device))
            host = torch.tensor([[n - k for n in lengths], thresholds], dtype=torch.long, device=logits.device)
            self._index_cache[key] = (eos, host[0], host[1])
        return self._index_cache[key]

    def process_positions(self, tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Target side: logits [B, W, V] at the anchor and W-1 drafts ``tokens`` [B, W-1]; position i is
        processed with prefix + tokens[:, :i] (the same ids the draft side used for slot i)."""
        if self.is_identity:
            return logits
        return torch.stack([self(tokens[:, :i], logits[:, i]) for i in range(logits.shape[1])], dim=1)
