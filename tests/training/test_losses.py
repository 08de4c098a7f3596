import math

import pytest
import torch
from chat_data import single_thread  # noqa: F401
from torch import nn

from hf_dspark.training.anchors import IGNORE_LABEL, BlockTargets, make_block_targets, sample_anchors
from hf_dspark.training.losses import (
    LossConfig,
    LossStats,
    compute_block_hidden,
    compute_block_outputs,
    compute_loss,
    slot_weights,
)

LN2, LN3 = math.log(2.0), math.log(3.0)
W1 = math.exp(-0.25)
pytestmark = pytest.mark.usefixtures("single_thread")


class _StubHead(nn.Module):
    """A sequential head with zero bias: draft logits = base logits."""

    def __init__(self, vocab: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, 1)
        nn.init.zeros_(self.markov_w1.weight)

    def forward_teacher_forced(self, hidden, prev_emb):
        return prev_emb

    def bias(self, u):
        return torch.zeros(*u.shape[:-1], 2)


class _StubConfidence(nn.Module):
    def __init__(self, logit: float):
        super().__init__()
        self.logit = nn.Parameter(torch.tensor(logit))

    def forward(self, hidden, prev_emb):
        return self.logit.expand(hidden.shape[:-1])


class _StubDrafter(nn.Module):
    """Identity LM head over a 2-token vocabulary: hidden states *are* logits, so every term is hand-computable."""

    def __init__(self, with_confidence: bool, conf_logit: float = 0.0):
        super().__init__()
        self.markov_head = _StubHead(2) if with_confidence else None
        self.confidence_head = _StubConfidence(conf_logit) if with_confidence else None
        self.target = nn.Linear(2, 2, bias=False)  # only its weight dtype is read
        self.target.get_output_embeddings = lambda: self.target

    draft_to_target = None  # full vocabulary

    def compute_logits(self, hidden):
        return hidden

    compute_draft_logits = compute_logits


def _targets(mask_rows: list[list[bool]], labels: list[list[int]]) -> BlockTargets:
    mask = torch.tensor([mask_rows])  # [1, A, γ]
    a, gamma = mask.shape[1:]
    lab = torch.tensor([labels]).masked_fill(~mask, IGNORE_LABEL)
    zeros = torch.zeros(1, a, gamma, dtype=torch.long)
    return BlockTargets(anchor_positions=torch.zeros(1, a, dtype=torch.long), block_keep=torch.ones(1, a).bool(),
                        block_ids=zeros, labels=lab, eval_mask=mask, prev_ids=zeros,
                        target_positions=torch.arange(a * gamma).view(1, a, gamma))


def test_slot_weights_decay_and_mask():
    w = slot_weights(torch.tensor([[True, True, True, False]]), decay=4.0)
    expected = [1.0, math.exp(-0.25), math.exp(-0.5), 0.0]
    assert torch.allclose(w, torch.tensor([expected]))
    assert torch.allclose(slot_weights(torch.ones(1, 2).bool(), decay=1.0), torch.tensor([[1.0, math.exp(-1)]]))


def test_terms_on_a_hand_computed_block():
    # slot 0: p_d = (.5,.5), p_t = (.75,.25) -> L1 = .5, TV = .25, CE(label 0) = ln 2
    # slot 1: p_d = (.75,.25) (logits ln3, 0), p_t = (.5,.5) -> L1 = .5, CE(label 1) = ln 4
    hidden = torch.tensor([[[[0.0, 0.0], [LN3, 0.0]]]])  # [1, 1, γ=2, V=2]
    target_hidden = torch.tensor([[[LN3, 0.0], [0.0, 0.0]]])  # [1, T=2, V]
    targets = _targets([[True, True]], [[0, 1]])
    config = LossConfig(confidence_weight=0.0)
    out = compute_loss(_StubDrafter(False), hidden, targets, target_hidden, config)
    wsum = 1 + W1
    ce = (LN2 + W1 * 2 * LN2) / wsum
    l1 = (0.5 + W1 * 0.5) / wsum
    assert out.loss.item() == pytest.approx(0.1 * ce + 0.9 * l1, rel=1e-5)
    summary = out.stats.summary(config)
    assert summary["ce"] == pytest.approx(ce, rel=1e-5)
    assert summary["l1"] == pytest.approx(l1, rel=1e-5)
    assert summary["accept_rate@0"] == pytest.approx(0.75)
    assert summary["accept_rate@1"] == pytest.approx(0.75)
    assert summary["tau_probabilistic"] == pytest.approx(1 + 0.75 + 0.75 * 0.75)


def test_confidence_target_is_one_minus_tv_and_detached():
    hidden = torch.tensor([[[[0.0, 0.0]]]], requires_grad=True)  # p_d = (.5, .5)
    target_hidden = torch.tensor([[[LN3, 0.0]]])  # p_t = (.75, .25): c* = .75
    targets = _targets([[True]], [[0]])
    drafter = _StubDrafter(True, conf_logit=0.0)  # c = σ(0) = .5
    config = LossConfig(ce_weight=0.0, l1_weight=0.0, confidence_weight=1.0)
    out = compute_loss(drafter, hidden, targets, target_hidden, config)
    assert out.loss.item() == pytest.approx(LN2, rel=1e-5)  # BCE(z=0, .75) = ln 2 for any target
    summary = out.stats.summary(config)
    assert summary["confidence_abs_error"] == pytest.approx(0.25)
    assert summary["confidence_bias"] == pytest.approx(-0.25)
    out.loss.backward()
    # d BCE / dz = σ(z) − c* = −.25; c* is detached, so the draft logits get no gradient from this term
    assert drafter.confidence_head.logit.grad.item() == pytest.approx(-0.25, rel=1e-5)
    assert hidden.grad is None or torch.count_nonzero(hidden.grad) == 0


def test_cumulative_mask_drops_slots_and_tau_uses_full_blocks_only():
    hidden = torch.zeros(1, 2, 2, 2)  # two blocks, γ = 2, uniform draft
    target_hidden = torch.tensor([[[LN3, 0.0], [LN3, 0.0], [LN3, 0.0], [LN3, 0.0]]])
    targets = _targets([[True, True], [True, False]], [[0, 0], [0, 0]])
    config = LossConfig(confidence_weight=0.0)
    out = compute_loss(_StubDrafter(False), hidden, targets, target_hidden, config)
    assert out.stats.weight_sum.item() == pytest.approx(2 + W1)
    assert out.stats.slot_count.tolist() == [2.0, 1.0]
    assert out.stats.num_full_blocks.item() == 1
    assert out.stats.summary(config)["tau_probabilistic"] == pytest.approx(1 + 0.75 + 0.75 ** 2)
    assert out.loss.item() == pytest.approx(0.1 * LN2 + 0.9 * 0.5, rel=1e-5)


def test_dflash_config_is_ce_only():
    cfg = LossConfig.for_head("none")
    assert (cfg.ce_weight, cfg.l1_weight, cfg.confidence_weight) == (1.0, 0.0, 0.0)
    assert LossConfig.for_head("markov") == LossConfig()
    with pytest.raises(ValueError, match="decay"):
        LossConfig(decay=0)


def test_denominator_overrides_local_weight_sum():
    hidden = torch.zeros(1, 1, 1, 2)
    target_hidden = torch.tensor([[[LN3, 0.0]]])
    targets = _targets([[True]], [[0]])
    config = LossConfig(confidence_weight=0.0)
    local = compute_loss(_StubDrafter(False), hidden, targets, target_hidden, config).loss
    halved = compute_loss(_StubDrafter(False), hidden, targets, target_hidden, config, denominator=2.0).loss
    assert halved.item() == pytest.approx(local.item() / 2)


def test_stats_vector_round_trip_and_sum():
    stats = LossStats.zeros(3)
    stats.accept_sum += torch.tensor([1.0, 2.0, 3.0])
    stats.weight_sum += 5
    twice = LossStats.from_vector((stats + stats).to_vector(), 3)
    assert twice.accept_sum.tolist() == [2.0, 4.0, 6.0] and twice.weight_sum.item() == 10


def _real_batch(drafter, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n, t = 2, 24
    d = drafter.config.target_hidden_size
    input_ids = torch.randint(3, 90, (n, t), generator=gen)
    loss_mask = torch.zeros(n, t, dtype=torch.long)
    loss_mask[:, 6:] = 1
    features = torch.randn(n, t, len(drafter.config.target_layer_ids) * d, generator=gen)
    last_hidden = torch.randn(n, t, d, generator=gen)
    positions, keep = sample_anchors(loss_mask, 6, generator=gen)
    targets = make_block_targets(input_ids, loss_mask, positions, keep, drafter.config.block_size,
                                 drafter.config.mask_token_id)
    return features, torch.ones(n, t, dtype=torch.bool), targets, last_hidden


def test_chunked_loss_matches_unchunked_loss_and_gradients(tiny_drafter):
    drafter = tiny_drafter.train()
    features, valid, targets, last_hidden = _real_batch(drafter)
    grads, losses = [], []
    for chunk in (1000, 3):  # one chunk, then several checkpointed chunks
        drafter.zero_grad()
        hidden = compute_block_hidden(drafter, features, valid, targets)
        out = compute_loss(drafter, hidden, targets, last_hidden, LossConfig(chunk_blocks=chunk))
        out.loss.backward()
        losses.append(out.loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in drafter.parameters() if p.grad is not None]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
    # every drafter parameter trains (markov head and confidence head included)
    assert all(p.grad is not None for p in drafter.parameters())


def test_overlapping_blocks_share_soft_labels_as_the_per_slot_definition(tiny_drafter):
    """Blocks overlap (6 anchors of 5 slots on 18 answer positions): each position's soft labels are computed once
    and shared; the L1 term must still equal Σ w·‖q − p‖₁ with p computed slot by slot, in chunks or not."""
    from hf_dspark.training.losses import compute_block_logits, gather_target_hidden

    drafter = tiny_drafter.train()
    features, valid, targets, last_hidden = _real_batch(drafter)
    sup = targets.eval_mask[..., 0]
    rows = (torch.arange(2).view(2, 1, 1) * last_hidden.shape[1] + targets.target_positions)[sup]
    assert rows.unique().numel() < rows.numel()  # several slots predict the same position
    hidden = compute_block_hidden(drafter, features, valid, targets)
    logits, _ = compute_block_logits(drafter, hidden[sup], targets.prev_ids[sup])
    p = torch.softmax(drafter.compute_logits(gather_target_hidden(last_hidden, targets)[sup]), -1)
    w = slot_weights(targets.eval_mask[sup])
    expected = (w * (torch.softmax(logits, -1) - p).abs().sum(-1)).sum() / w.sum()
    for chunk in (1000, 3):
        out = compute_loss(drafter, hidden, targets, last_hidden,
                           LossConfig(ce_weight=0.0, confidence_weight=0.0, l1_weight=1.0, chunk_blocks=chunk))
        torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)


def test_block_outputs_match_drafting_primitive(tiny_drafter):
    # the many-blocks training forward equals the inference primitive on the same block (slot 0 has no
    # teacher forcing difference: its previous token is the anchor in both)
    from hf_dspark import DraftCache

    drafter = tiny_drafter
    drafter.config.sequential_top_k = 0  # full-vocabulary bias, as in training
    features, valid, targets, _ = _real_batch(drafter, seed=1)
    with torch.no_grad():
        out = compute_block_outputs(drafter, features, valid, targets)
        assert out.draft_logits.shape[:3] == targets.block_ids.shape
        assert out.confidence_logits.shape == targets.block_ids.shape
        p = int(targets.anchor_positions[0, 2])
        cache = drafter.extend_context(DraftCache(), features[:1, :p], torch.arange(p)[None])
        block = drafter.draft_block(cache, targets.block_ids[:1, 2, 0], torch.tensor([p]))
    assert torch.allclose(block.base_logits[0], drafter.compute_logits(out.hidden[0, 2]), atol=1e-4)
    assert torch.allclose(block.draft_logits[0, 0], out.draft_logits[0, 2, 0], atol=1e-4)
    assert torch.allclose(block.confidence_logits[0, 0], out.confidence_logits[0, 2, 0], atol=1e-4)


@pytest.mark.parametrize("reduced", [False, True])
def test_soft_labels_keep_the_heads_precision_inside_bf16_autocast(tiny_target, reduced):
    # a bf16 autocast training step must not round the target's probabilities (the labels) to bf16
    from hf_dspark import DSparkDraftModel
    from hf_dspark.training.losses import target_probabilities

    torch.manual_seed(0)
    vocab = list(range(0, tiny_target.config.vocab_size, 2)) if reduced else None
    drafter = DSparkDraftModel.from_target(tiny_target, block_size=4, markov_rank=8, draft_vocab=vocab)
    hidden = torch.randn(3, 5, tiny_target.config.hidden_size)
    lse = None
    if reduced:
        lse = torch.logsumexp(hidden @ tiny_target.get_output_embeddings().weight.T, dim=-1)
    exact = target_probabilities(drafter, hidden, lse)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert drafter.compute_logits(hidden).dtype == torch.bfloat16  # autocast is really on
        labels = target_probabilities(drafter, hidden, lse)
    assert labels.dtype == torch.float32 and torch.equal(labels, exact)
    assert float(labels.sum(-1).max()) <= 1 + 1e-5
