import torch

from hf_dspark.training.anchors import IGNORE_LABEL, anchor_candidates, make_block_targets, sample_anchors

MASK_ID = 99


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_candidates_need_anchor_and_next_token_in_mask():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1]])
    # p=2,3 (next in mask); p=4 (next out), p=6 (next in), p=7 (last: no next token)
    assert anchor_candidates(loss_mask)[0].nonzero().flatten().tolist() == [2, 3, 6]


def test_sampler_never_leaves_the_loss_mask():
    gen = _gen(0)
    for trial in range(50):
        t = 40
        loss_mask = (torch.rand(3, t, generator=gen) < 0.6).long()
        positions, keep = sample_anchors(loss_mask, num_anchors=8, generator=gen)
        for row in range(3):
            kept = positions[row][keep[row]]
            assert torch.all(loss_mask[row, kept] == 1)
            assert torch.all(loss_mask[row, kept + 1] == 1)
            assert kept.unique().numel() == kept.numel()  # without replacement
            assert torch.all(kept[1:] > kept[:-1])  # ascending
            num_cand = int(anchor_candidates(loss_mask)[row].sum())
            assert int(keep[row].sum()) == min(8, num_cand)


def test_dummy_blocks_when_too_few_candidates():
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 0]])
    positions, keep = sample_anchors(loss_mask, num_anchors=5, generator=_gen())
    assert positions.tolist() == [[1, 2, 0, 0, 0]]
    assert keep.tolist() == [[True, True, False, False, False]]
    # more anchors than positions at all
    positions, keep = sample_anchors(loss_mask, num_anchors=10, generator=_gen())
    assert positions.shape == (1, 10) and int(keep.sum()) == 2


def test_sampler_is_uniform_over_candidates():
    loss_mask = torch.zeros(1, 12, dtype=torch.long)
    loss_mask[0, 2:10] = 1  # candidates 2..8 (7 of them)
    counts = torch.zeros(12)
    gen = _gen(3)
    for _ in range(2000):
        positions, keep = sample_anchors(loss_mask, num_anchors=3, generator=gen)
        counts[positions[0][keep[0]]] += 1
    freq = counts[2:9] / 2000
    assert torch.all((freq - 3 / 7).abs() < 0.05), freq
    assert counts[:2].sum() == 0 and counts[9:].sum() == 0


def test_sampler_is_deterministic_given_the_generator():
    loss_mask = torch.ones(2, 30, dtype=torch.long)
    a = sample_anchors(loss_mask, 6, generator=_gen(7))
    b = sample_anchors(loss_mask, 6, generator=_gen(7))
    c = sample_anchors(loss_mask, 6, generator=_gen(8))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])


def test_block_targets_labels_and_cumulative_mask():
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17, 18]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 1]])  # response 2..4, then a gap at 5, then 6..8
    positions = torch.tensor([[2, 3, 6, 0]])
    keep = torch.tensor([[True, True, True, False]])
    bt = make_block_targets(input_ids, loss_mask, positions, keep, block_size=4, mask_token_id=MASK_ID)
    # block at p=2: labels 13,14 valid; 15 is outside the response -> stop (even though 16 is back inside)
    assert bt.eval_mask[0, 0].tolist() == [True, True, False, False]
    assert bt.labels[0, 0].tolist() == [13, 14, IGNORE_LABEL, IGNORE_LABEL]
    # block at p=3: label 14 then the gap
    assert bt.eval_mask[0, 1].tolist() == [True, False, False, False]
    # block at p=6: labels 17, 18 then past the end
    assert bt.eval_mask[0, 2].tolist() == [True, True, False, False]
    assert bt.labels[0, 2].tolist() == [17, 18, IGNORE_LABEL, IGNORE_LABEL]
    # dummy block: nothing supervised, all mask ids
    assert not bt.eval_mask[0, 3].any()
    assert bt.block_ids[0, 3].tolist() == [MASK_ID] * 4
    # block inputs: anchor then mask ids; teacher-forced previous tokens input_ids[p + j]
    assert bt.block_ids[0, 0].tolist() == [12, MASK_ID, MASK_ID, MASK_ID]
    assert bt.prev_ids[0, 0].tolist() == [12, 13, 14, 15]
    assert bt.target_positions[0, 2].tolist() == [6, 7, 8, 8]  # clamped past the end
    assert bt.num_supervised == 2 + 1 + 2


def test_padding_is_never_supervised():
    input_ids = torch.tensor([[5, 6, 7, 8, 0, 0]])
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 0]])
    bt = make_block_targets(input_ids, loss_mask, torch.tensor([[1]]), torch.tensor([[True]]), 5, MASK_ID)
    assert bt.eval_mask[0, 0].tolist() == [True, True, False, False, False]
