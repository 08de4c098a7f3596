"""The drafter's layers: committed context projected in the drafting pass (``forward_block(new_context=)``) gives
the same block states and the same cache as projecting it first (``extend_context``) and drafting after, and the
RMSNorm is the reference arithmetic."""

from __future__ import annotations

import pytest
import torch

from hf_dspark import DSparkDraftModel
from hf_dspark.modeling.draft_cache import ContextUpdate, DraftCache
from hf_dspark.modeling.layers import RMSNorm


def _features(drafter, rows: int, width: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, width, drafter.config.hidden_size * len(drafter.config.target_layer_ids), generator=g)


def _prefilled(drafter, rows: int, width: int, g: torch.Generator) -> DraftCache:
    cache = DraftCache()
    drafter.extend_context(cache, _features(drafter, rows, width, g), torch.arange(width).expand(rows, -1),
                           torch.ones(rows, width, dtype=torch.bool), packed=True, counts=[width] * rows)
    return cache


def _cache_state(cache: DraftCache) -> list[torch.Tensor]:
    """What attention reads: each row's entries (keys, values, positions) in slot order."""
    out = []
    for r, end in enumerate(cache.row_ends):
        keep = cache.valid[r, :end]
        out += [k[r][:, :end][:, keep] for k in cache.keys] + [v[r][:, :end][:, keep] for v in cache.values]
        out.append(cache.positions[r, :end][keep])
    return out


@pytest.mark.parametrize("case", ["aligned", "ragged", "empty cache", "ragged cache"])
def test_new_context_in_the_drafting_pass_matches_extend_then_draft(tiny_drafter, case):
    g = torch.Generator().manual_seed(7)
    rows = 2
    prior = 0 if case == "empty cache" else 6
    if case == "ragged cache":  # rows already differ (a hole-free but unaligned cache: the mask path)
        cache_a = _prefilled(tiny_drafter, rows, prior, g)
        tiny_drafter.extend_context(cache_a, _features(tiny_drafter, rows, 2, g), (prior + torch.arange(2)).expand(rows, -1),
                                    torch.tensor([[True, True], [True, False]]), packed=True, counts=[2, 1])
        starts = torch.tensor([prior + 2, prior + 1])
    else:
        cache_a = _prefilled(tiny_drafter, rows, prior, g) if prior else DraftCache()
        starts = torch.full((rows,), prior)
    cache_b = DraftCache() if not prior else _clone(cache_a)
    width = 4
    valid = torch.ones(rows, width, dtype=torch.bool)
    counts = [width] * rows
    if case == "ragged":
        valid = torch.tensor([[True, True, True, False], [True, False, False, False]])
        counts = [3, 1]
    update = ContextUpdate(_features(tiny_drafter, rows, width, g), starts[:, None] + torch.arange(width), valid,
                           counts=counts)
    anchors = torch.tensor([5, 9])
    anchor_positions = starts + torch.tensor(counts)

    tiny_drafter.extend_context(cache_a, update.features, update.positions, update.valid, packed=True,
                                counts=update.counts)
    two_passes = tiny_drafter.forward_block(cache_a, anchors, anchor_positions, context_precedes_anchors=True)
    one_pass = tiny_drafter.forward_block(cache_b, anchors, anchor_positions, context_precedes_anchors=True,
                                          new_context=update)
    torch.testing.assert_close(one_pass, two_passes, rtol=1e-5, atol=1e-5)
    assert cache_b.row_ends == cache_a.row_ends and cache_b.is_dense == cache_a.is_dense
    for x, y in zip(_cache_state(cache_b), _cache_state(cache_a)):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    # and the next round drafts the same from either cache
    torch.testing.assert_close(tiny_drafter.forward_block(cache_b, anchors, anchor_positions + 1),
                               tiny_drafter.forward_block(cache_a, anchors, anchor_positions + 1), rtol=1e-5, atol=1e-5)


def _clone(cache: DraftCache) -> DraftCache:
    out = DraftCache([k.clone() for k in cache.keys], [v.clone() for v in cache.values], cache.valid.clone(),
                     cache.positions.clone())
    out._ends, out._num_slots, out._dense = list(cache.row_ends), cache.num_slots, cache.is_dense
    return out


def test_draft_block_passes_the_new_context_through(tiny_drafter):
    """The public primitive takes the update too: same drafts and confidences as extending first."""
    g = torch.Generator().manual_seed(11)
    cache_a, cache_b = _prefilled(tiny_drafter, 1, 5, g), None
    cache_b = _clone(cache_a)
    update = ContextUpdate(_features(tiny_drafter, 1, 3, g), (5 + torch.arange(3))[None], torch.ones(1, 3, dtype=torch.bool),
                           counts=[3])
    tiny_drafter.extend_context(cache_a, update.features, update.positions, update.valid, packed=True, counts=[3])
    anchors, positions = torch.tensor([4]), torch.tensor([8])
    a = tiny_drafter.draft_block(cache_a, anchors, positions, context_precedes_anchors=True)
    b = tiny_drafter.draft_block(cache_b, anchors, positions, context_precedes_anchors=True, new_context=update)
    assert torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(a.confidence, b.confidence, rtol=1e-5, atol=1e-5)
    assert cache_b.num_slots == cache_a.num_slots == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_the_reference_arithmetic(dtype):
    """x · rsqrt(mean(x²) + eps) in fp32, scaled by the weight in the input dtype: bit for bit."""
    torch.manual_seed(0)
    norm = RMSNorm(48, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 48, dtype=dtype)
    xf = x.float()
    reference = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.equal(norm(x), reference)


def test_only_architectures_that_fuse_get_the_update():
    from hf_dspark.modeling.architectures import architecture_named

    assert architecture_named("block").fuses_context
    assert architecture_named("block").model_class is DSparkDraftModel
    assert not architecture_named("eagle3").fuses_context
