"""Sequential heads and the confidence head: slot k depends on the drafts x_<k only, and `none` is DFlash."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper

from hf_dspark import DraftCache, DSparkDraftModel

GAMMA, RANK = 5, 8
SEQUENTIAL = ["markov", "gated", "rnn"]


def make_drafter(target, head: str, top_k: int = 0) -> DSparkDraftModel:
    torch.manual_seed(2)
    model = DSparkDraftModel.from_target(target, num_layers=1, block_size=GAMMA, head=head, markov_rank=RANK,
                                         target_layer_ids=[0, 1]).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.3)
    model.config.sequential_top_k = top_k
    return model


def draft(model, do_sample=False, seed=0, **kwargs):
    feats = torch.randn(2, 7, 128, generator=torch.Generator().manual_seed(0))
    cache = model.extend_context(DraftCache(), feats, torch.arange(7).expand(2, -1))
    generator = torch.Generator().manual_seed(seed)
    return model.draft_block(cache, torch.tensor([5, 9]), torch.tensor([7, 7]), do_sample=do_sample,
                             generator=generator, **kwargs)


def teacher_forced_logits(model, block, prev_tokens) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Slot logits and confidence logits recomputed from a given previous-token sequence [B, γ]."""
    head = model.markov_head
    prev_emb = head.markov_w1(prev_tokens)
    logits = block.base_logits + head.bias(head.forward_teacher_forced(block.hidden, prev_emb)).float()
    conf = model.confidence_head(block.hidden, prev_emb) if model.confidence_head is not None else None
    return logits, conf


def prefix_of(block, anchors=torch.tensor([5, 9])) -> torch.Tensor:
    """[anchor, x_0, .., x_{γ-2}]: slot k's previous token is the anchor for k = 0, else the draft x_{k-1}."""
    return torch.cat([anchors[:, None], block.tokens[:, :-1]], dim=1)


@pytest.mark.parametrize("head", SEQUENTIAL)
@torch.no_grad()
def test_draft_distribution_is_the_one_at_the_sampled_prefix(tiny_target, head):
    model = make_drafter(tiny_target, head)
    block = draft(model, do_sample=True)
    logits, conf = teacher_forced_logits(model, block, prefix_of(block))
    torch.testing.assert_close(block.draft_logits, logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(block.draft_probs, torch.softmax(logits, -1), rtol=0, atol=1e-6)
    torch.testing.assert_close(block.confidence_logits, conf, rtol=0, atol=1e-5)


@pytest.mark.parametrize("head", SEQUENTIAL)
@torch.no_grad()
def test_slot_k_depends_only_on_earlier_tokens(tiny_target, head):
    model = make_drafter(tiny_target, head)
    block = draft(model, do_sample=True)
    prev = prefix_of(block)
    base, base_conf = teacher_forced_logits(model, block, prev)
    k = 2
    later = prev.clone()
    later[:, k + 1:] = (later[:, k + 1:] + 17) % 96  # x_k, x_{k+1}, .. (prev slot k+1 holds x_k)
    logits, conf = teacher_forced_logits(model, block, later)
    torch.testing.assert_close(logits[:, :k + 1], base[:, :k + 1], rtol=0, atol=0)
    torch.testing.assert_close(conf[:, :k + 1], base_conf[:, :k + 1], rtol=0, atol=0)  # non-anticipating c_k
    assert (logits[:, k + 1] - base[:, k + 1]).abs().max() > 1e-3
    previous = prev.clone()
    previous[:, k] = (previous[:, k] + 17) % 96  # x_{k-1}
    logits, conf = teacher_forced_logits(model, block, previous)
    assert (logits[:, k] - base[:, k]).abs().max() > 1e-3
    assert (conf[:, k] - base_conf[:, k]).abs().max() > 1e-4
    torch.testing.assert_close(logits[:, :k], base[:, :k], rtol=0, atol=0)


@torch.no_grad()
def test_rnn_head_carries_the_whole_prefix_markov_only_the_last_token(tiny_target):
    for head, sees_older in (("rnn", True), ("markov", False), ("gated", False)):
        model = make_drafter(tiny_target, head)
        block = draft(model)
        prev = prefix_of(block)
        base, _ = teacher_forced_logits(model, block, prev)
        older = prev.clone()
        older[:, 1] = (older[:, 1] + 17) % 96  # x_0, two slots before slot 2
        changed = (teacher_forced_logits(model, block, older)[0][:, 3] - base[:, 3]).abs().max() > 1e-4
        assert bool(changed) is sees_older, head


@pytest.mark.parametrize("head", SEQUENTIAL)
@torch.no_grad()
def test_greedy_draft_is_argmax_left_to_right(tiny_target, head):
    model = make_drafter(tiny_target, head)
    block = draft(model)
    assert block.draft_probs is None
    assert torch.equal(block.tokens, block.draft_logits.argmax(-1))
    logits, _ = teacher_forced_logits(model, block, prefix_of(block))
    assert torch.equal(block.tokens, logits.argmax(-1))


@torch.no_grad()
def test_none_head_reproduces_dflash(tiny_target):
    model = make_drafter(tiny_target, "none")
    assert model.markov_head is None and model.confidence_head is None
    greedy = draft(model)
    assert torch.equal(greedy.draft_logits, greedy.base_logits)
    assert torch.equal(greedy.tokens, greedy.base_logits.argmax(-1))
    assert greedy.confidence is None
    samples = [draft(model, do_sample=True, seed=seed) for seed in range(4)]
    for block in samples:  # slots are independent: q never depends on what was sampled before
        torch.testing.assert_close(block.draft_probs, torch.softmax(greedy.base_logits, -1), rtol=0, atol=1e-6)
    assert len({tuple(b.tokens.flatten().tolist()) for b in samples}) > 1


@torch.no_grad()
def test_top_k_restricts_q_to_the_base_top_k(tiny_target):
    model = make_drafter(tiny_target, "markov", top_k=8)
    block = draft(model, do_sample=True)
    support = torch.isfinite(block.draft_logits)
    assert torch.equal(support.sum(-1), torch.full((2, GAMMA), 8))
    top = block.base_logits.topk(8, dim=-1).indices
    assert torch.equal(support, torch.zeros_like(support).scatter(-1, top, True))
    full, _ = teacher_forced_logits(model, block, prefix_of(block))
    torch.testing.assert_close(block.draft_logits[support], full[support], rtol=0, atol=1e-5)
    assert torch.all(block.draft_probs[~support] == 0)


@torch.no_grad()
def test_logits_processors_shape_q(tiny_target):
    model = make_drafter(tiny_target, "markov")
    block = draft(model, do_sample=True, logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.5)]),
                  prefix_ids=torch.tensor([[1, 5], [1, 9]]))
    logits, _ = teacher_forced_logits(model, block, prefix_of(block))
    torch.testing.assert_close(block.draft_probs, torch.softmax(logits / 0.5, -1), rtol=0, atol=1e-6)


@torch.no_grad()
def test_confidence_threshold_stops_at_the_first_low_slot(tiny_target):
    model = make_drafter(tiny_target, "markov")
    block = draft(model)
    threshold = float(block.confidence[0].median())
    stopped = draft(model, confidence_threshold=threshold)
    for row in range(2):
        below = (block.confidence[row] < threshold).nonzero()
        expected = int(below[0]) if len(below) else GAMMA
        assert int(stopped.num_drafts[row]) == expected


@pytest.mark.parametrize("do_sample", [False, True])
@torch.no_grad()
def test_threshold_drafts_only_slots_someone_will_verify(tiny_target, do_sample):
    """Under a threshold, drafting ends once every row has stopped; the drafted slots are the full block's."""
    model = make_drafter(tiny_target, "markov")
    full = draft(model, do_sample=do_sample)
    per_row_stop = []
    for threshold in sorted(set(full.confidence.flatten().tolist())) + [1.01]:
        block = draft(model, do_sample=do_sample, confidence_threshold=threshold)
        below = full.confidence < threshold
        expected = torch.where(below.any(-1), below.float().argmax(-1), torch.full((2,), GAMMA))
        assert torch.equal(block.num_drafts, expected)
        drafted = block.tokens.shape[1]
        assert drafted == int(expected.max())  # nothing beyond the longest proposal
        assert torch.equal(block.tokens, full.tokens[:, :drafted])
        torch.testing.assert_close(block.draft_logits, full.draft_logits[:, :drafted])
        if do_sample:
            torch.testing.assert_close(block.draft_probs, full.draft_probs[:, :drafted])
        per_row_stop.append(drafted)
    assert per_row_stop[-1] == 0 and max(per_row_stop) > 0  # 1.01: no slot drafted at all
