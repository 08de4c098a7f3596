"""Reduced draft vocabulary: the drafter proposes only chosen target tokens, q is 0 elsewhere, greedy output stays
identical to plain greedy, the loss equals its full-vocabulary definition, and the ids survive save/load."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, make_tiny_llama

from hf_dspark import DraftCache, DSparkDraftModel
from hf_dspark.training.anchors import make_block_targets, sample_anchors
from hf_dspark.training.draft_vocabulary import coverage, most_frequent_tokens
from hf_dspark.training.losses import LossConfig, compute_block_hidden, compute_loss

DRAFT_VOCAB = [2] + list(range(10, TINY_VOCAB, 2))  # EOS plus every even id from 10


@pytest.fixture(scope="module")
def target():
    return make_tiny_llama(seed=0)


def make_drafter(target, head: str = "markov", vocab=DRAFT_VOCAB) -> DSparkDraftModel:
    torch.manual_seed(3)
    return DSparkDraftModel.from_target(target, num_layers=1, block_size=5, head=head, markov_rank=8,
                                        draft_vocab=vocab).eval()


def features(draft, n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, n, len(draft.config.target_layer_ids) * 64, generator=gen)


def loss_inputs(draft, seed: int, n: int = 2, t: int = 30):
    """(features, context_valid, block targets, final target states) of a random 2-sequence batch."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, TINY_VOCAB, (n, t), generator=gen)
    loss_mask = torch.zeros(n, t, dtype=torch.long)
    loss_mask[:, 5:] = 1
    feats = torch.randn(n, t, len(draft.config.target_layer_ids) * 64, generator=gen)
    last_hidden = torch.randn(n, t, 64, generator=gen)
    positions, keep = sample_anchors(loss_mask, 4, generator=gen)
    targets = make_block_targets(ids, loss_mask, positions, keep, 5, draft.config.mask_token_id)
    return feats, torch.ones(n, t, dtype=torch.bool), targets, last_hidden


def test_config_and_shapes(target):
    draft = make_drafter(target)
    assert draft.config.draft_vocab_size == len(DRAFT_VOCAB)
    assert draft.draft_to_target.tolist() == sorted(DRAFT_VOCAB)
    assert draft.markov_head.markov_w2.weight.shape == (len(DRAFT_VOCAB), 8)
    assert draft.markov_head.markov_w1.weight.shape == (TINY_VOCAB, 8)  # previous tokens can be any target token
    hidden = torch.randn(3, 64)
    full = draft.compute_logits(hidden)
    torch.testing.assert_close(draft.compute_draft_logits(hidden), full[:, draft.draft_to_target])


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("top_k", [0, 4])
def test_drafts_stay_inside_the_draft_vocabulary(target, do_sample, top_k):
    draft = make_drafter(target)
    draft.config.sequential_top_k = top_k
    cache = draft.extend_context(DraftCache(), features(draft, 7), torch.arange(7)[None])
    block = draft.draft_block(cache, torch.tensor([3]), torch.tensor([7]), do_sample=do_sample,
                              generator=torch.Generator().manual_seed(0))
    allowed = torch.zeros(TINY_VOCAB, dtype=torch.bool)
    allowed[DRAFT_VOCAB] = True
    assert allowed[block.tokens].all()
    assert block.draft_logits.shape[-1] == TINY_VOCAB  # processors and verification see the target vocabulary
    assert torch.isneginf(block.draft_logits[..., ~allowed]).all()
    if do_sample:
        assert (block.draft_probs[..., ~allowed] == 0).all()
        torch.testing.assert_close(block.draft_probs.sum(-1), torch.ones(1, 5))


@pytest.mark.parametrize("head", ["markov", "none"])
def test_greedy_generate_is_identical_to_plain_greedy(target, head):
    draft = make_drafter(target, head=head)
    gen = torch.Generator().manual_seed(5)
    prompts = torch.randint(3, TINY_VOCAB, (3, 9), generator=gen)
    plain = target.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=24,
                            pad_token_id=0)
    ours = target.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=24,
                           pad_token_id=0, assistant_model=draft)
    assert torch.equal(plain, ours)
    assert draft.stats.proposed_tokens > 0


def test_save_load_round_trip_keeps_the_vocabulary(tmp_path, target):
    draft = make_drafter(target)
    draft.save_pretrained(tmp_path)
    loaded = DSparkDraftModel.from_pretrained(tmp_path, target=target)
    assert loaded.config.draft_vocab_size == len(DRAFT_VOCAB)
    assert torch.equal(loaded.draft_to_target, draft.draft_to_target)
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


@pytest.mark.parametrize("damage", ["out_of_range", "repeated"])
def test_a_damaged_stored_draft_vocabulary_is_refused_at_load(tmp_path, target, damage):
    from safetensors.torch import load_file, save_file

    from hf_dspark.modeling.checkpoint_files import CheckpointError

    make_drafter(target).save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    # out of range: an IndexError deep inside drafting; repeated: one target token with two rows of q
    state["draft_to_target"][-1] = TINY_VOCAB + 5 if damage == "out_of_range" else state["draft_to_target"][0]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"draft_to_target must hold strictly ascending target token ids"):
        DSparkDraftModel.from_pretrained(tmp_path, target=target)


def test_set_draft_vocabulary_refuses_bad_ids(target):
    draft = make_drafter(target)
    with pytest.raises(ValueError, match="unique"):
        draft.set_draft_vocabulary([2, 2] + DRAFT_VOCAB[2:])
    with pytest.raises(ValueError, match="unique and within"):
        draft.set_draft_vocabulary(DRAFT_VOCAB[:-1] + [TINY_VOCAB])
    with pytest.raises(ValueError, match="draft token ids for draft_vocab_size"):
        draft.set_draft_vocabulary(DRAFT_VOCAB[:-1])
    full = DSparkDraftModel.from_target(target, num_layers=1, block_size=5, markov_rank=8)
    with pytest.raises(ValueError, match="full target vocabulary"):
        full.set_draft_vocabulary(DRAFT_VOCAB)


def test_loss_equals_its_full_vocabulary_definition(target):
    """‖q − p‖₁ with q scattered to the target vocabulary (0 outside) is what the reduced loss computes."""
    draft = make_drafter(target).train()
    feats, valid, targets, last_hidden = loss_inputs(draft, seed=0)
    hidden = compute_block_hidden(draft, feats, valid, targets)
    out = compute_loss(draft, hidden, targets, last_hidden, LossConfig(ce_weight=0.0, confidence_weight=0.0,
                                                                       l1_weight=1.0))
    # by hand, in the target vocabulary
    from hf_dspark.training.losses import compute_block_logits, gather_target_hidden, slot_weights

    sup = targets.eval_mask[..., 0]
    logits, _ = compute_block_logits(draft, hidden[sup], targets.prev_ids[sup])
    q = torch.softmax(draft.to_target_vocab(logits), -1)
    p = torch.softmax(draft.compute_logits(gather_target_hidden(last_hidden, targets)[sup]), -1)
    w = slot_weights(targets.eval_mask[sup])
    expected = (w * (q - p).abs().sum(-1)).sum() / w.sum()
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    assert draft.markov_head.markov_w2.weight.grad is not None


def test_most_frequent_tokens_forces_eos_and_breaks_ties_by_id():
    counts = torch.tensor([0, 5, 0, 9, 5, 5, 1])
    ids = most_frequent_tokens(counts, 3, always_include=[2])
    assert ids.tolist() == [1, 2, 3]  # 2 forced, then 3 (9), then the lowest id among the 5s
    assert coverage(counts, ids) == pytest.approx(14 / 25)
    with pytest.raises(ValueError, match="size"):
        most_frequent_tokens(counts, 8)


def test_cached_logsumexp_gives_the_same_loss_as_the_full_softmax(target):
    draft = make_drafter(target).train()
    feats, valid, targets, last_hidden = loss_inputs(draft, seed=1)
    lse = torch.logsumexp(draft.compute_logits(last_hidden).float(), -1)
    losses = []
    for side_car in (None, lse):
        hidden = compute_block_hidden(draft, feats, valid, targets)
        losses.append(compute_loss(draft, hidden, targets, last_hidden, LossConfig(), target_logsumexp=side_car))
    torch.testing.assert_close(losses[0].loss, losses[1].loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses[0].stats.to_vector(), losses[1].stats.to_vector(), rtol=1e-5, atol=1e-5)
