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
