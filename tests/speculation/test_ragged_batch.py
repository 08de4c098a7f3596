"""Ragged-batch cache operations: stacking separately prefilled rows, holes, compaction and cropping must leave
every row's next-token logits exactly what that row computes alone."""

from __future__ import annotations

import torch
from conftest import make_tiny_llama
from transformers import DynamicCache

from hf_dspark.speculation.ragged_batch import (
    compact_draft_cache,
    compact_rows,
    crop_trailing_holes,
    num_trailing_holes,
    packing_index,
    stack_draft_rows,
    stack_rows,
)
from hf_dspark.modeling.draft_cache import DraftCache


def prefill(target, ids: list[int]) -> tuple[DynamicCache, torch.Tensor]:
    cache = DynamicCache(config=target.config)
    target(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    return cache, torch.ones(1, len(ids), dtype=torch.long)


def next_logits(target, cache, mask, tokens: list[int], positions: list[int]) -> torch.Tensor:
    out = target(input_ids=torch.tensor(tokens)[:, None], position_ids=torch.tensor(positions)[:, None],
                 attention_mask=torch.cat([mask, torch.ones(len(tokens), 1, dtype=torch.long)], 1), cache=cache,
                 use_cache=True)
    return out.logits[:, -1]


def alone(target, ids: list[int], token: int) -> torch.Tensor:
    return target(input_ids=torch.tensor([ids + [token]])).logits[0, -1]


def test_packing_index_moves_valid_slots_right_in_order():
    valid = torch.tensor([[1, 0, 1, 1, 0], [0, 1, 0, 0, 0]], dtype=torch.bool)
    index = packing_index(valid)
    assert index.shape == (2, 3)
    assert index[0].tolist() == [0, 2, 3]
    assert index[1, -1].item() == 1 and not valid[1, index[1, :2]].any()


def test_stack_compact_and_crop_keep_each_row_exact():
    torch.manual_seed(0)
    target = make_tiny_llama(seed=0)
    prompts = [[5, 9, 11, 40, 7, 3], [8, 60], [33, 21, 17, 90]]
    with torch.no_grad():
        cache, mask = stack_rows([prefill(target, p) for p in prompts], target.config)
        assert mask.tolist()[1] == [0, 0, 0, 0, 1, 1]
        # a round of 3 slots per row where only some are committed: the rest become holes
        garbage = torch.tensor([[4, 4, 4], [6, 6, 6], [12, 12, 12]])
        positions = torch.tensor([len(p) for p in prompts])[:, None] + torch.arange(3)
        target(input_ids=garbage, position_ids=positions, attention_mask=torch.cat([mask, torch.ones_like(garbage)], 1),
               cache=cache, use_cache=True)
        kept = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # row 2 keeps nothing: its prompt is unchanged
        mask = torch.cat([mask, kept], 1)
        mask = crop_trailing_holes(cache, mask)
        assert mask.shape[1] == 8 and cache.get_seq_length() == 8
        histories = [prompts[0] + [4, 4], prompts[1] + [6], prompts[2]]
        token_pos = [len(h) for h in histories]
        expected = torch.stack([alone(target, h, 50) for h in histories])
        before = next_logits(target, cache, mask, [50, 50, 50], token_pos)
        torch.testing.assert_close(before, expected, atol=1e-4, rtol=1e-4)
        # compaction drops every hole column; the freshly appended slot is a hole-free row end again
        cache.crop(-1)
        compacted, packed = compact_rows(cache, mask, target.config)
        assert packed.shape[1] == max(len(h) for h in histories) and packed.sum(1).tolist() == token_pos
        after = next_logits(target, compacted, packed, [50, 50, 50], token_pos)
        torch.testing.assert_close(after, expected, atol=1e-4, rtol=1e-4)


def test_trailing_holes_counts_columns_empty_in_every_row():
    assert num_trailing_holes(torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]])) == 1
    assert num_trailing_holes(torch.tensor([[1, 1], [1, 1]])) == 0


def test_draft_cache_stack_and_compact():
    def part(num_rows, slots, seed):
        gen = torch.Generator().manual_seed(seed)
        keys = [torch.randn(num_rows, 2, slots, 4, generator=gen)]
        valid = torch.rand(num_rows, slots, generator=gen) > 0.3
        positions = torch.arange(slots).expand(num_rows, -1).clone()
        return DraftCache(keys, [k + 1 for k in keys], valid, positions)

    a, b = part(2, 5, 0), part(1, 3, 1)
    stacked = stack_draft_rows([a, b])
    assert stacked.num_slots == 5 and not stacked.valid[2, :2].any()
    assert torch.equal(stacked.keys[0][2, :, 2:], b.keys[0][0])
    packed = compact_draft_cache(stacked)
    assert packed.num_slots == int(stacked.valid.sum(1).max())
    for row in range(3):
        keep = stacked.valid[row]
        n = int(keep.sum())
        assert torch.equal(packed.keys[0][row, :, packed.num_slots - n:], stacked.keys[0][row][:, keep])
        assert torch.equal(packed.values[0][row, :, packed.num_slots - n:], stacked.values[0][row][:, keep])
        assert torch.equal(packed.positions[row, packed.num_slots - n:], stacked.positions[row][keep])
        assert int(packed.valid[row].sum()) == n
