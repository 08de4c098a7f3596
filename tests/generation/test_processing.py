"""Logits processors on ragged rows: the buffered prefixes give exactly what per-row concatenation gives, and the
direct processor calls equal LogitsProcessorList's."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
)

from hf_dspark.generation.processing import RowLogitsProcessor, adapt_for_rows, apply_processors
from hf_dspark.generation.row_tokens import RowTokens


def _processors() -> LogitsProcessorList:
    return LogitsProcessorList([MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=2, min_new_tokens=4, eos_token_id=2),
                                RepetitionPenaltyLogitsProcessor(1.7), NoRepeatNGramLogitsProcessor(2)])


def test_apply_processors_equals_the_processor_list():
    ids, scores = torch.tensor([[5, 9, 5, 9, 3]]), torch.randn(1, 16)
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), *_processors()])
    torch.testing.assert_close(apply_processors(processors, ids, scores.clone()), processors(ids, scores.clone()))


def test_buffered_prefixes_equal_concatenated_ones():
    ids = torch.tensor([[0, 0, 5, 9, 3], [7, 5, 9, 3, 5]])
    mask = (ids != 0).long()
    num_pad = (mask.cumsum(-1) == 0).sum(-1).tolist()
    tokens = RowTokens(ids, mask, capacity=16, mirror=True)
    tokens.append(0, [9])
    tokens.append(1, [9, 5])
    rows = [0, 1]
    buffered = RowLogitsProcessor(adapt_for_rows(_processors(), num_pad), tokens=tokens, rows=rows)
    concatenated = RowLogitsProcessor(adapt_for_rows(_processors(), num_pad), [tokens.own_view(r).clone() for r in rows])
    assert [p.tolist() for p in buffered.prefixes] == [p.tolist() for p in concatenated.prefixes]
    drafts, logits = torch.tensor([[3, 9, 5], [3, 9, 9]]), torch.randn(2, 4, 16)
    torch.testing.assert_close(buffered.process_positions(drafts, logits.clone()),
                               concatenated.process_positions(drafts, logits.clone()))
    assert tokens.own_view(1).tolist() == [7, 5, 9, 3, 5, 9, 5]  # drafting wrote only past the committed tokens
