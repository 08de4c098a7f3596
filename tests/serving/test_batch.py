"""RunningBatch: deferring the drafter-context update while the drafter is skipped changes nothing it drafts."""

from __future__ import annotations

import pytest
import torch

from hf_dspark.modeling.draft_cache import DraftCache
from hf_dspark.serving.batch import RunningBatch


def _rounds(drafter, rows: int, seed: int = 0):
    """Three rounds of fake target features for ``rows`` rows: a prompt chunk, a 3-wide verify, a 1-wide step."""
    g = torch.Generator().manual_seed(seed)
    width = drafter.config.hidden_size * len(drafter.config.target_layer_ids)
    start = torch.zeros(rows, dtype=torch.long)
    out = []
    for w in (4, 3, 1):
        positions = start[:, None] + torch.arange(w)
        valid = torch.rand(rows, w, generator=g) > 0.3
        valid[:, 0] = True
        out.append((torch.randn(rows, w, width, generator=g), positions, valid))
        start = start + w
    return out, start


@torch.no_grad()
def test_deferred_context_drafts_like_eager_updates(tiny_target, tiny_drafter):
    rounds, next_pos = _rounds(tiny_drafter, rows=3)
    eager = DraftCache()
    for feats, pos, valid in rounds:
        eager = tiny_drafter.extend_context(eager, feats, pos, valid)
    keep = torch.tensor([0, 2])
    eager = eager.select_rows(keep)

    batch = RunningBatch(tiny_target.config, torch.device("cpu"))
    batch.requests = [object()] * 3  # only the row count matters to keep()
    batch.cache = type("NoCache", (), {"batch_select_indices": lambda self, i: None, "crop": lambda self, n: None})()
    batch.mask = torch.ones(3, 1, dtype=torch.long)
    batch.anchors, batch.anchor_positions = torch.zeros(3, dtype=torch.long), next_pos.clone()
    batch.draft_cache = tiny_drafter.extend_context(DraftCache(), *rounds[0])
    for feats, pos, valid in rounds[1:]:
        batch.defer_context(feats, pos, valid)
    assert batch.num_deferred_steps == 2
    batch.keep([0, 2])
    batch.flush_context(tiny_drafter)
    assert batch.num_deferred_steps == 0

    anchors = torch.tensor([5, 7])
    expected = tiny_drafter.forward_block(eager, anchors, next_pos[keep])
    actual = tiny_drafter.forward_block(batch.draft_cache, anchors, next_pos[keep])
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_join_refuses_unflushed_context(tiny_target, tiny_drafter):
    batch = RunningBatch(tiny_target.config, torch.device("cpu"))
    rounds, _ = _rounds(tiny_drafter, rows=1)
    batch.defer_context(*rounds[0])
    with pytest.raises(RuntimeError, match="flush_context"):
        batch.join([object()])


def test_leading_columns_that_are_holes_in_every_row_are_cropped_as_views(tiny_target):
    """After the widest row left, the first columns are holes in every row: they are dropped without a copy (the
    K/V are views of the same storage) and every row keeps its committed slots."""
    from transformers import DynamicCache

    batch = RunningBatch(tiny_target.config, torch.device("cpu"))
    layers = tiny_target.config.num_hidden_layers
    keys = [torch.randn(2, 2, 6, 4) for _ in range(layers)]
    values = [torch.randn(2, 2, 6, 4) for _ in range(layers)]
    batch.cache = DynamicCache(ddp_cache_data=list(zip(keys, values)), config=tiny_target.config)
    batch.mask = torch.tensor([[0, 0, 1, 0, 1, 1], [0, 0, 0, 1, 1, 1]])
    before = [layer.keys for layer in batch.cache.layers]
    assert batch.crop_shared_leading_holes() == 2
    assert batch.mask.tolist() == [[1, 0, 1, 1], [0, 1, 1, 1]]
    for layer, k, v, stored in zip(batch.cache.layers, keys, values, before):
        assert torch.equal(layer.keys, k[:, :, 2:]) and layer.keys.data_ptr() == stored[:, :, 2:].data_ptr()
        assert torch.equal(layer.values, v[:, :, 2:])
    assert batch.cache.get_seq_length() == 4 and batch.crop_shared_leading_holes() == 0


def test_vacant_rows_are_filled_from_the_end_copying_only_the_rows_that_move(tiny_target):
    """Finished requests' rows leave by the last rows moving into their places: every request keeps its own K/V,
    mask, anchor and host mirrors, and the rows that did not move stay views of the same buffers (dropping rows in
    order copied every row after the first that left)."""
    from hf_dspark.kv_cache import cache_from_tensors
    from hf_dspark.speculation.ragged_batch import fill_from_the_end

    assert fill_from_the_end(5, {0, 2}) == [3, 1, 4]  # rows 3 and 4 take the places of 0 and 2
    assert fill_from_the_end(4, {3}) == [0, 1, 2] and fill_from_the_end(3, {0, 1, 2}) == []
    batch = RunningBatch(tiny_target.config, torch.device("cpu"))
    layers = tiny_target.config.num_hidden_layers
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(5, 2, 6, 4, generator=gen) for _ in range(layers)]
    batch.cache = cache_from_tensors([(k, k + 1) for k in keys], tiny_target.config)
    for index in range(layers):  # one append each: every layer a view of a growing buffer
        batch.cache.update(*(2 * [torch.zeros(5, 2, 1, 4)]), index)
    batch.mask = torch.arange(35).reshape(5, 7) % 3
    batch.anchors, batch.anchor_positions = torch.arange(5) + 10, torch.arange(5) + 20
    batch.host_valid, batch.host_trailing, batch.host_positions = [1, 2, 3, 4, 5], [0] * 5, [20, 21, 22, 23, 24]
    batch.requests = ["r0", "r1", "r2", "r3", "r4"]
    before = [layer.keys for layer in batch.cache.layers]
    full = [layer.keys.clone() for layer in batch.cache.layers]
    batch.vacate([0, 2])
    batch.drop_vacant()
    assert batch.requests == ["r3", "r1", "r4"] and not batch.vacant
    assert batch.anchors.tolist() == [13, 11, 14] and batch.host_valid == [4, 2, 5]
    assert batch.host_positions == [23, 21, 24]
    assert torch.equal(batch.mask, (torch.arange(35).reshape(5, 7) % 3)[[3, 1, 4]])
    for layer, old, stored in zip(batch.cache.layers, full, before):
        assert torch.equal(layer.keys, old[[3, 1, 4]]) and layer.keys.data_ptr() == stored.data_ptr()
