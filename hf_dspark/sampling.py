"""Drawing tokens: the one sampling helper behind the first token, drafting and verification."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def sample_rows(probs: torch.Tensor, generator: torch.Generator | Sequence[torch.Generator] | None) -> torch.Tensor:
    """One token per row of probs [B, V] (non-negative, any positive total), from one shared generator or from one
    generator per row (the engine's per-request streams: each row then consumes exactly one draw of its own).

    Inverse CDF: one uniform u per row, the token is the first whose running sum exceeds u · total. That is the
    search ``torch.multinomial`` runs too (running sums in float64, as its CPU kernel accumulates), without its
    per-call overhead, which over a large vocabulary dominates on a CPU; a sampled round draws once per draft and
    once to recover. A token with p = 0 is never drawn: its running sum equals its predecessor's."""
    cdf = probs.to(torch.float64).cumsum_(-1)
    total = cdf[:, -1:]
    if probs.device.type == "cpu" and not bool(((total > 0) & torch.isfinite(total)).all()):
        raise ValueError("sample_rows: every row of probs needs a positive, finite total (got inf, nan or all "
                         "zeros)")
    if isinstance(generator, (list, tuple)):
        uniform = torch.cat([torch.rand(1, dtype=torch.float64, device=probs.device, generator=g)
                             for g in generator])[:, None]
    else:
        uniform = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device, generator=generator)
    index = torch.searchsorted(cdf, uniform * total, right=True)
    # u · total rounds to total at worst: the last token with mass is then the draw (never one past the end, nor
    # a trailing zero)
    last = (cdf < total).sum(-1, keepdim=True)
    return torch.minimum(index, last).squeeze(-1)


def pick_tokens(logits: torch.Tensor, do_sample: bool,
                generator: torch.Generator | Sequence[torch.Generator] | None = None) -> torch.Tensor:
    """Greedy argmax, or a sample from softmax(logits) (logits already processed): [B, V] -> [B]."""
    if do_sample:
        return sample_rows(torch.softmax(logits.float(), dim=-1), generator)
    return logits.argmax(-1)


__all__ = ["pick_tokens", "sample_rows"]
