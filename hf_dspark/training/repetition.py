"""Answer tokens that repeat earlier text of their conversation: left out of a drafter's loss on request.

Why: the target's own answers loop (a third of the regenerated answer tokens complete an 8-gram seen earlier in the
same conversation, against an eighth of the held-out answers, which stop at 128 tokens), and at serving time such
text is the lookup proposer's: it drafts repeats for free, and the scheduler picks it there. Blocks spent on loops
teach the drafter copying it will rarely be asked for; masking them spends every step on text only it can predict.
"""

from __future__ import annotations

import torch


def repeated_ngram_mask(input_ids: torch.Tensor, n: int) -> torch.Tensor:
    """bool [T]: True where token t completes an ``n``-gram (tokens t-n+1..t) that occurred earlier in the sequence.

    Occurrences may overlap (a run of one repeated token is a repeat from its n+1-th token on).
    """
    if n < 1:
        raise ValueError(f"n={n} must be >= 1.")
    ids = input_ids.tolist()
    out = torch.zeros(len(ids), dtype=torch.bool)
    seen: set[tuple[int, ...]] = set()
    for t in range(n - 1, len(ids)):
        gram = tuple(ids[t - n + 1: t + 1])
        if gram in seen:
            out[t] = True
        else:
            seen.add(gram)
    return out


def mask_repeats(loss_mask: torch.Tensor, input_ids: torch.Tensor, n: int) -> torch.Tensor:
    """``loss_mask`` with repeated ``n``-gram completions (:func:`repeated_ngram_mask`) set to 0."""
    return loss_mask.masked_fill(repeated_ngram_mask(input_ids, n), 0)


__all__ = ["mask_repeats", "repeated_ngram_mask"]
