"""DraftCache: packed per-row appends hold only committed context, in preallocated storage that grows by doubling,
and the drafter attends to it exactly as to the concatenated cache with holes."""

from __future__ import annotations

import torch

from hf_dspark.modeling.draft_cache import DraftCache


def _rounds(drafter, rows: int, widths=(5, 3, 4, 2, 6), seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    size = drafter.config.hidden_size * len(drafter.config.target_layer_ids)
    start, out = torch.zeros(rows, dtype=torch.long), []
    for w in widths:
        valid = torch.rand(rows, w, generator=g) > 0.4
        valid[:, 0] = True
        out.append((torch.randn(rows, w, size, generator=g), start[:, None] + torch.arange(w), valid))
        start = start + w
    return out, start


@torch.no_grad()
def test_packed_appends_attend_like_the_padded_cache(tiny_target, tiny_drafter):
    rounds, next_pos = _rounds(tiny_drafter, rows=3)
    padded, packed = DraftCache(), DraftCache()
    for feats, pos, valid in rounds:
        tiny_drafter.extend_context(padded, feats, pos, valid)
        tiny_drafter.extend_context(packed, feats, pos, valid, packed=True, counts=valid.sum(1).tolist())
    assert padded.num_slots == sum(f.shape[1] for f, _, _ in rounds)
    assert packed.num_slots == int(torch.stack([v.sum(1) for _, _, v in rounds]).sum(0).max())  # no holes kept
    assert bool(packed.valid.sum(1).eq(torch.tensor(packed.row_ends)).all())
    anchors = torch.tensor([3, 7, 11])
    torch.testing.assert_close(tiny_drafter.forward_block(packed, anchors, next_pos),
                               tiny_drafter.forward_block(padded, anchors, next_pos), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_storage_grows_without_changing_the_content(tiny_drafter):
    rounds, _ = _rounds(tiny_drafter, rows=2, widths=(3,) * 20)
    cache = DraftCache()
    capacities = set()
    for feats, pos, valid in rounds:
        tiny_drafter.extend_context(cache, feats, pos, valid, packed=True)
        capacities.add(cache._valid.shape[1])
    assert len(capacities) > 1  # it grew (by doubling), a few times, not once per round
    assert len(capacities) <= 4
    for row in range(2):
        want = torch.cat([p[row][v[row]] for _, p, v in rounds])
        assert torch.equal(cache.positions[row][cache.valid[row]], want)


@torch.no_grad()
def test_select_rows_keeps_each_rows_pointer(tiny_drafter):
    rounds, _ = _rounds(tiny_drafter, rows=3)
    cache = DraftCache()
    for feats, pos, valid in rounds:
        tiny_drafter.extend_context(cache, feats, pos, valid, packed=True)
    kept = cache.select_rows([2, 0])
    assert kept.row_ends == [cache.row_ends[2], cache.row_ends[0]]
    assert torch.equal(kept.positions[0, : kept.row_ends[0]], cache.positions[2, : cache.row_ends[2]])


def test_a_cache_from_given_tensors_keeps_them_untouched(tiny_drafter):
    keys = [torch.zeros(1, 2, 3, 16)]
    cache = DraftCache(keys, [torch.zeros(1, 2, 3, 16)], torch.ones(1, 3, dtype=torch.bool),
                       torch.arange(3)[None])
    cache.append([torch.ones(1, 2, 2, 16)], [torch.ones(1, 2, 2, 16)], torch.ones(1, 2, dtype=torch.bool),
                 torch.arange(3, 5)[None], packed=True, counts=[2])
    assert cache.num_slots == 5 and float(keys[0].sum()) == 0.0  # the caller's tensor was not written to


@torch.no_grad()
def test_dense_flag_tracks_holes_and_unmasked_attention_matches(tiny_drafter):
    """is_dense (a host fact) is true exactly while every visible slot of every row holds an entry, and with it a
    caller whose context precedes the anchors gets the same block states without the attention mask."""
    size = tiny_drafter.config.hidden_size * len(tiny_drafter.config.target_layer_ids)
    g = torch.Generator().manual_seed(3)
    cache = DraftCache()
    assert cache.is_dense
    for width in (6, 3, 4):  # rows commit alike: aligned, dense
        start = cache.num_slots
        tiny_drafter.extend_context(cache, torch.randn(2, width, size, generator=g),
                                    (start + torch.arange(width)).expand(2, -1), torch.ones(2, width, dtype=torch.bool),
                                    packed=True, counts=[width, width])
        assert cache.is_dense and bool(cache.valid.all())
    anchors, anchor_pos = torch.tensor([5, 9]), torch.full((2,), cache.num_slots)
    torch.testing.assert_close(tiny_drafter.forward_block(cache, anchors, anchor_pos, context_precedes_anchors=True),
                               tiny_drafter.forward_block(cache, anchors, anchor_pos), rtol=1e-5, atol=1e-5)
    assert cache.select_rows([1]).is_dense
    valid = torch.tensor([[True, True, False], [True, False, False]])  # rows commit differently: ragged
    tiny_drafter.extend_context(cache, torch.randn(2, 3, size, generator=g), (13 + torch.arange(3)).expand(2, -1),
                                valid, packed=True, counts=[2, 1])
    assert not cache.is_dense and not bool(cache.valid.all())
    # not dense: the mask is built even when the caller vouches for the positions (row 1 has a hole)
    anchor_pos = torch.tensor([15, 14])
    torch.testing.assert_close(tiny_drafter.forward_block(cache, anchors, anchor_pos, context_precedes_anchors=True),
                               tiny_drafter.forward_block(cache, anchors, anchor_pos), rtol=0, atol=0)
    padded = DraftCache()
    tiny_drafter.extend_context(padded, torch.randn(1, 4, size, generator=g), torch.arange(4)[None],
                                torch.ones(1, 4, dtype=torch.bool))
    assert not padded.is_dense  # unpacked appends may keep holes: the host does not know, so it never claims
