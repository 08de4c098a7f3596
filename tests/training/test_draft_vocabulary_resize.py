"""Moving a trained drafter onto another draft vocabulary: kept tokens keep their logits (base + sequential
bias), new tokens get the target head's logit plus the mean learned bias, and the backbone / confidence are
untouched."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, make_tiny_llama

from hf_dspark import DSparkDraftModel
from hf_dspark.training.draft_vocabulary import with_draft_vocabulary

OLD = [2] + list(range(10, TINY_VOCAB, 2))
NEW = [2] + list(range(10, TINY_VOCAB // 2)) + [TINY_VOCAB - 2]  # keeps some old tokens, drops others, adds odd ids


@pytest.fixture(scope="module")
def drafter():
    target = make_tiny_llama(seed=0)
    torch.manual_seed(3)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=5, head="markov", markov_rank=8,
                                         draft_vocab=OLD).eval()
    with torch.no_grad():  # a trained-looking sequential head (its init is zero-ish)
        draft.markov_head.markov_w2.weight.normal_(std=0.5)
    return draft


def test_kept_tokens_keep_their_logits_and_new_ones_get_the_mean_bias(drafter):
    resized = with_draft_vocabulary(drafter, torch.tensor(NEW))
    assert resized.config.draft_vocab_size == len(set(NEW)) and resized.draft_to_target.tolist() == sorted(set(NEW))
    hidden = torch.randn(3, drafter.config.hidden_size)
    prev = drafter.markov_head.markov_w1(torch.tensor([5, 11, 12]))
    old = drafter.to_target_vocab(drafter.compute_draft_logits(hidden) + drafter.markov_head.bias(prev))
    new = resized.to_target_vocab(resized.compute_draft_logits(hidden) + resized.markov_head.bias(prev))
    kept = sorted(set(OLD) & set(NEW))
    added = sorted(set(NEW) - set(OLD))
    assert torch.allclose(old[:, kept], new[:, kept], atol=1e-5)
    full = drafter.compute_logits(hidden)  # the target head over every token
    mean_bias = prev @ drafter.markov_head.markov_w2.weight.mean(0)  # the mean learned row's bias
    assert torch.allclose(new[:, added], full[:, added] + mean_bias[:, None], atol=1e-5)
    assert torch.isinf(new[:, sorted(set(OLD) - set(NEW))]).all()
    for name, value in drafter.state_dict().items():
        if name != "draft_to_target" and "markov_w2" not in name:
            assert torch.equal(value, resized.state_dict()[name]), name


def test_full_vocabulary_drafters_are_refused():
    target = make_tiny_llama(seed=0)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=5, markov_rank=8)
    with pytest.raises(ValueError, match="reduced-vocabulary"):
        with_draft_vocabulary(draft, torch.tensor(NEW))
