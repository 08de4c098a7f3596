"""Logits processors on ragged rows: the buffered prefixes give exactly what per-row concatenation gives, and the
direct processor calls equal LogitsProcessorList's."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
)

from hf_dspark.speculation.processing import RowLogitsProcessor, adapt_for_rows, apply_processors
from hf_dspark.speculation.row_tokens import RowTokens


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
    buffered = RowLogitsProcessor(adapt_for_rows(_processors(), ids, num_pad), tokens=tokens, rows=rows)
    concatenated = RowLogitsProcessor(adapt_for_rows(_processors(), ids, num_pad),
                                      [tokens.own_view(r).clone() for r in rows])
    assert [p.tolist() for p in buffered.prefixes] == [p.tolist() for p in concatenated.prefixes]
    drafts, logits = torch.tensor([[3, 9, 5], [3, 9, 9]]), torch.randn(2, 4, 16)
    torch.testing.assert_close(buffered.process_positions(drafts, logits.clone()),
                               concatenated.process_positions(drafts, logits.clone()))
    assert tokens.own_view(1).tolist() == [7, 5, 9, 3, 5, 9, 5]  # drafting wrote only past the committed tokens


def _per_row(processor: RowLogitsProcessor, tail: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The reference: each row alone, with its own processors and ids."""
    out = []
    for b in range(logits.shape[0]):
        procs = processor.processors if processor.row_processors is None else processor.row_processors[b]
        out.append(apply_processors(procs, processor._ids(b, tail[b])[None], logits[b:b + 1].clone()))
    return torch.cat(out)


def test_batched_processors_equal_per_row_processing():
    """A repetition penalty and min-new-tokens (with warpers that ignore the ids around them: renormalize_logits,
    top-h, inf/nan removal) run as one batched call on ragged,
    left-padded rows, with buffered and with given prefixes: bit-identical to each row processed alone, for every
    tail length and for rows on both sides of the min-new-tokens boundary."""
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([[0, 0, 0, 5, 9, 3], [7, 5, 9, 3, 5, 11], [0, 4, 4, 4, 8, 1]])
    mask = (ids != 0).long()
    mask[2, 0] = 0
    num_pad = (mask.cumsum(-1) == 0).sum(-1).tolist()
    processors = LogitsProcessorList([InfNanRemoveLogitsProcessor(), TemperatureLogitsWarper(0.7),
                                      MinLengthLogitsProcessor(9, eos_token_id=4),
                                      MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=6, min_new_tokens=3,
                                                                        eos_token_id=[2, 13]),
                                      RepetitionPenaltyLogitsProcessor(1.7), TopHLogitsWarper(0.6),
                                      LogitNormalization()])
    tokens = RowTokens(ids, mask, capacity=32, mirror=True)
    tokens.append(0, [9, 2])
    tokens.append(2, [12])
    rows = [0, 1, 2]
    buffered = RowLogitsProcessor(adapt_for_rows(processors, ids, num_pad), tokens=tokens, rows=rows)
    given = RowLogitsProcessor(adapt_for_rows(processors, ids, num_pad), [tokens.own_view(r).clone() for r in rows])
    assert buffered.batched and given.batched
    for k in range(4):
        tail = torch.randint(1, 16, (3, k), generator=g)
        logits = torch.randn(3, 16, generator=g)
        for processor in (buffered, given):
            assert torch.equal(processor(tail, logits.clone()), _per_row(processor, tail, logits))


def test_processors_that_read_ids_otherwise_stay_per_row():
    """n-gram blocking reads the order of ids (padding would change it): those rows are processed one by one."""
    ids = torch.tensor([[5, 9, 5, 9, 3], [7, 5, 9, 3, 5]])
    processor = RowLogitsProcessor(adapt_for_rows(_processors(), ids, [0, 0]), [ids[0], ids[1]])
    assert not processor.batched
    penalty_with_cut = RowLogitsProcessor(LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5, 2)]),
                                          [ids[0], ids[1]])
    assert not penalty_with_cut.batched


def test_min_length_counts_the_padded_length_as_plain_generate_does():
    """Plain batched generate compares min_length with the padded row; an unpadded row (3 pads shorter) must block
    EOS for exactly as long."""
    padded = torch.tensor([[0, 0, 0, 5, 9, 3, 7]])  # 3 pads + 4 own tokens: padded length 7
    processor = LogitsProcessorList([MinLengthLogitsProcessor(8, eos_token_id=2)])
    (row,) = adapt_for_rows(processor, padded, [3])
    for extra in range(3):  # padded length 7, 8, 9 <-> own length 4, 5, 6
        scores = torch.randn(1, 16)
        ids = torch.cat([padded, torch.full((1, extra), 4)], dim=1)
        assert torch.equal(apply_processors(row, ids[:, 3:], scores.clone()), processor(ids, scores.clone()))
