"""The loop's target cache: appends into spare capacity and installs tensors without copies, and every operation
the loop and transformers run on a DynamicCache (crop, leading slices, row selection, in-place row writes, masks)
gives exactly the logits of the stock cache."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_tiny_llama
from transformers import DynamicCache

from hf_dspark import kv_cache
from hf_dspark.kv_cache import GrowingLayer, cache_from_tensors, drop_rows_in_place, growing_cache
from hf_dspark.speculation.ragged_batch import _gather_slots, _left_pad, _stacked, packing_index


def _run(target, cache, script):
    """Feed ``script`` (a list of (ids [R, n], operation on the cache or None)) and return every forward's logits."""
    logits = []
    with torch.no_grad():
        for ids, operation in script:
            logits.append(target(input_ids=ids, cache=cache, use_cache=True).logits)
            if operation is not None:
                operation(cache)
    return logits


def test_growing_cache_matches_the_stock_cache_through_appends_crops_and_row_selection():
    target = make_tiny_llama(seed=0)
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, target.config.vocab_size, (3, n), generator=gen)  # noqa: E731
    script = [(ids(7), None), (ids(1), None), (ids(3), lambda c: c.crop(-2)), (ids(1), None),
              (ids(4), lambda c: c.batch_select_indices(torch.tensor([0, 2]))), (ids(1)[:2], None),
              (ids(2)[:2], lambda c: c.crop(-1))] + [(ids(1)[:2], None) for _ in range(70)]
    stock = _run(target, DynamicCache(config=target.config), script)
    grown = growing_cache(target.config)
    ours = _run(target, grown, script)
    assert all(isinstance(layer, GrowingLayer) for layer in grown.layers)
    for a, b in zip(stock, ours):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # the keys are a view of a larger buffer: the last append wrote in place
    layer = grown.layers[0]
    assert layer.keys.untyped_storage().nbytes() > layer.keys.numel() * layer.keys.element_size()


def test_growing_layer_appends_after_a_slice_of_leading_slots_and_in_place_row_writes():
    layer = GrowingLayer()
    first = torch.randn(2, 2, 5, 4)
    layer.update(first, first + 1)
    buffer = layer._key_buffer
    layer.keys, layer.values = layer.keys[:, :, 2:], layer.values[:, :, 2:]  # leading holes cropped (a view)
    layer.keys[1, :, 0] = 7.0  # a joining row written in place
    new = torch.randn(2, 2, 1, 4)
    keys, values = layer.update(new, new + 1)
    assert layer._key_buffer is buffer  # appended in place, no new buffer
    expected = torch.cat([first[:, :, 2:], new], 2)
    expected[1, :, 0] = 7.0
    assert torch.equal(keys, expected)
    assert torch.equal(values, torch.cat([first[:, :, 2:] + 1, new + 1], 2))


def test_growing_layer_restarts_its_buffer_when_keys_are_replaced_and_deepcopies_as_views():
    layer = GrowingLayer()
    layer.update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    replaced = torch.full((1, 1, 2, 2), 5.0)
    layer.keys, layer.values = replaced, replaced.clone()
    keys, _ = layer.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    assert keys[0, 0, :, 0].tolist() == [5.0, 5.0, 0.0] and torch.equal(replaced, torch.full((1, 1, 2, 2), 5.0))
    twin = copy.deepcopy(layer)
    twin.update(torch.full((1, 1, 1, 2), 3.0), torch.full((1, 1, 1, 2), 3.0))
    assert layer.keys.shape[2] == 3 and twin.keys[0, 0, :, 0].tolist() == [5.0, 5.0, 0.0, 3.0]


def test_cache_from_tensors_installs_without_copying():
    target = make_tiny_llama(seed=0)
    layers = [(torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)) for _ in target.model.layers]
    cache = cache_from_tensors(layers, target.config)
    for layer, (keys, values) in zip(cache.layers, layers):
        assert layer.keys is keys and layer.values is values
    assert cache.get_seq_length() == 6


def test_row_wise_gather_and_single_copy_stack_equal_the_reference_ops():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 9, 5, generator=gen)
    index = packing_index(torch.rand(4, 9, generator=gen) > 0.4)
    reference = x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))
    assert torch.equal(_gather_slots(x, index), reference)
    parts = [torch.randn(2, 3, 4, 5, generator=gen), torch.randn(1, 3, 7, 5, generator=gen)]
    assert torch.equal(_stacked(parts, 7, 2), torch.cat([_left_pad(p, 7, 2) for p in parts]))
    masks = [torch.ones(2, 4, dtype=torch.bool), torch.ones(1, 7, dtype=torch.bool)]
    assert torch.equal(_stacked(masks, 7, 1, value=False), torch.cat([_left_pad(m, 7, 1, value=False) for m in masks]))
    # only the padding is filled (the result is allocated empty): a fill value that uninitialised memory cannot fake
    parts = [torch.randn(2, 3, 4, 5, generator=gen), torch.randn(1, 3, 6, 5, generator=gen)]
    assert torch.equal(_stacked(parts, 9, 2, value=-7.0), torch.cat([_left_pad(p, 9, 2, value=-7.0) for p in parts]))


def test_growing_layer_prepends_zeroed_slots_in_its_front_room():
    """A buffer keeps free slots before its first one (the engine's batch widens to the left into them when a wider
    request joins): prepended slots are zeros whatever the buffer held there (a masked NaN would still poison
    attention), the keys stay a view of the same buffer, appends stay in place, and asking for more room than is
    free is an error (the batch stacks instead)."""
    layer = GrowingLayer()
    first = torch.randn(2, 2, 5, 4)
    layer.update(first, first + 1)
    room = layer.front_room()
    assert room >= kv_cache.MIN_LEAD_SLOTS
    buffer = layer._key_buffer
    buffer[:, :, :room] = float("nan")
    layer._value_buffer[:, :, :room] = float("nan")
    layer.extend_front(3)
    assert layer.front_room() == room - 3 and layer._key_buffer is buffer
    assert torch.equal(layer.keys, torch.cat([torch.zeros(2, 2, 3, 4), first], 2))
    assert torch.equal(layer.values, torch.cat([torch.zeros(2, 2, 3, 4), first + 1], 2))
    new = torch.randn(2, 2, 1, 4)
    layer.update(new, new)
    assert layer._key_buffer is buffer and torch.equal(layer.keys[:, :, -1:], new) and layer.keys.shape[2] == 9
    with pytest.raises(ValueError, match="free"):
        layer.extend_front(room)
    layer.keys = layer.keys.clone()  # replaced by a tensor of its own: no room until its next buffer
    assert layer.front_room() == 0


def test_rows_dropped_in_place_copy_only_the_rows_that_move():
    """Dropping rows of a growing cache moves the last rows into the freed places and keeps the first rows as views
    of the same buffers: the kept rows hold exactly their K/V, appends stay in that buffer, and a move that does not
    come from past the kept rows is refused (it would overwrite a row before reading it)."""
    layers = [GrowingLayer(), GrowingLayer()]
    cache = DynamicCache()
    cache.layers = layers
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randn(4, 2, 5, 3, generator=gen) for _ in layers]
    for layer, k in zip(layers, rows):
        layer.update(k, k + 1)
    buffers = [layer._key_buffer for layer in layers]
    assert drop_rows_in_place(cache, [(0, 3)], 2)  # rows 0 and 2 leave: row 3 takes row 0's place, row 1 stays
    for layer, k, buffer in zip(layers, rows, buffers):
        assert torch.equal(layer.keys, k[[3, 1]]) and torch.equal(layer.values, k[[3, 1]] + 1)
        assert layer.keys.data_ptr() == buffer[:, :, layer.front_room():].data_ptr()  # a view, not a copy
    new = torch.randn(2, 2, 1, 3, generator=gen)
    for layer in layers:
        layer.update(new, new)
    for layer, k, buffer in zip(layers, rows, buffers):
        assert layer._key_buffer.data_ptr() == buffer.data_ptr() and layer.keys.shape == (2, 2, 6, 3)
        assert torch.equal(layer.keys, torch.cat([k[[3, 1]], new], 2))
    with pytest.raises(ValueError, match="kept rows"):
        drop_rows_in_place(cache, [(0, 1)], 2)
    stock = DynamicCache(ddp_cache_data=[(rows[0], rows[0])])
    assert not drop_rows_in_place(stock, [(0, 3)], 2) and stock.layers[0].keys.shape[0] == 4  # untouched
