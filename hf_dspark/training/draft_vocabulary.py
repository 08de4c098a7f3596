"""Choosing a reduced draft vocabulary: the target tokens a drafter may propose (EAGLE-3's d2t idea).

A drafter's LM head is a row slice of the target's. On a small target the full-vocabulary head dominates both
drafting and training cost (SmolLM2: 49,152 × 576 against ~4 M multiply-adds for a drafter layer), while the
target's answers use a few thousand distinct tokens. Keeping the most frequent answer tokens loses only the
rare ones: the drafter cannot propose them (q = 0 there, which verification handles losslessly), so they cost
acceptance only where the target would have emitted them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from .target_cache import load_manifest

logger = logging.getLogger(__name__)


def count_answer_tokens(cache_dir: str | os.PathLike, vocab_size: int) -> torch.Tensor:
    """How often each target token id occurs in the supervised (assistant) positions of a target cache: [V]."""
    cache_dir = Path(cache_dir)
    manifest = load_manifest(cache_dir)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for shard in manifest["shards"]:
        with safe_open(cache_dir / shard["file"], framework="pt") as f:
            ids = f.get_tensor("input_ids").long()
            mask = f.get_tensor("loss_mask").bool()
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def most_frequent_tokens(counts: torch.Tensor, size: int, always_include: Iterable[int] = ()) -> torch.Tensor:
    """The ``size`` most frequent token ids (ties broken by lower id), always containing ``always_include``.

    Returns a sorted LongTensor. ``always_include`` is for tokens that matter beyond their frequency (EOS and
    end-of-turn markers: a drafter that cannot propose them cannot end an answer inside a block).
    """
    vocab = counts.numel()
    if not 1 <= size <= vocab:
        raise ValueError(f"size={size} must be in [1, {vocab}].")
    forced = sorted({int(t) for t in always_include if t is not None and 0 <= int(t) < vocab})
    if len(forced) > size:
        raise ValueError(f"{len(forced)} forced tokens do not fit a draft vocabulary of {size}.")
    # stable ordering: by count descending, then by id ascending
    order = torch.argsort(-counts.double() + torch.arange(vocab, dtype=torch.double) / (2.0 * vocab))
    chosen = list(forced)
    seen = set(forced)
    for token in order.tolist():
        if len(chosen) == size:
            break
        if token not in seen:
            chosen.append(token)
            seen.add(token)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def coverage(counts: torch.Tensor, token_ids: torch.Tensor) -> float:
    """Fraction of counted tokens that fall inside the draft vocabulary ``token_ids``."""
    total = int(counts.sum())
    return float(counts[token_ids].sum()) / total if total else 0.0


def count_text_tokens(tokenizer, texts: Iterable[str], vocab_size: int) -> torch.Tensor:
    """Token counts of plain texts (e.g. answers of records no target cache holds yet): [V]. Tokenising is cheap
    next to a target pass, so a vocabulary can be chosen from more text than has been cached."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for text in texts:
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        counts += torch.bincount(ids[ids < vocab_size], minlength=vocab_size)
    return counts


@torch.no_grad()
def with_draft_vocabulary(drafter, token_ids: torch.Tensor):
    """A copy of a trained reduced-vocabulary drafter that proposes ``token_ids`` instead (any size).

    Why this keeps what the drafter learned: its base logits are rows of the target's LM head applied to its own
    hidden state, so a token new to the vocabulary gets a real logit at once; only the sequential head's output
    rows W2 are indexed by the draft vocabulary: kept tokens keep their rows, new ones start at the mean learned row.
    Why the mean, not zero: the learned bias carries a prior shared by all tokens (on SmolLM2's drafter, zero rows
    let the new tokens crowd out right drafts and cost held-out τ before any retraining; mean rows cost nothing).
    The backbone and the confidence head do not depend on the vocabulary. A vocabulary chosen on narrow data
    caps acceptance wherever the target emits a token outside it; this widens it without retraining from scratch.
    """
    if drafter.draft_to_target is None:
        raise ValueError("with_draft_vocabulary needs a reduced-vocabulary drafter (draft_vocab_size is None).")
    new_ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().unique(sorted=True)
    old_ids = drafter.draft_to_target.cpu()
    config = type(drafter.config).from_dict(drafter.config.to_dict())
    config.draft_vocab_size = int(new_ids.numel())
    fresh = type(drafter)(config).to(device=drafter.fc.weight.device, dtype=drafter.fc.weight.dtype)
    state = {k: v for k, v in drafter.state_dict().items() if k != "draft_to_target" and "markov_w2" not in k}
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    if unexpected or any(k != "draft_to_target" and "markov_w2" not in k for k in missing):
        raise ValueError(f"state mismatch while changing the draft vocabulary: {missing} / {unexpected}")
    fresh.set_draft_vocabulary(new_ids)
    head = drafter.markov_head
    if head is not None:
        position = torch.full((config.target_config["vocab_size"],), -1, dtype=torch.long)
        position[old_ids] = torch.arange(old_ids.numel())
        old_rows = position[new_ids]  # row of each new draft token in the old W2 (-1: new token)
        kept = old_rows >= 0
        w2 = head.markov_w2.weight.mean(0, keepdim=True).to(fresh.markov_head.markov_w2.weight).expand_as(
            fresh.markov_head.markov_w2.weight).clone()
        w2[kept] = head.markov_w2.weight[old_rows[kept].to(w2.device)].to(w2.dtype)
        fresh.markov_head.markov_w2.weight.copy_(w2)
    try:
        fresh.bind_target(drafter.target)
    except RuntimeError:
        pass  # an unbound drafter stays unbound
    logger.info("Draft vocabulary %d -> %d tokens (%d kept, %d new)", old_ids.numel(), new_ids.numel(),
                int(torch.isin(new_ids, old_ids).sum()), int((~torch.isin(new_ids, old_ids)).sum()))
    return fresh
