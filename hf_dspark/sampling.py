"""Drawing tokens: the one sampling helper behind the first token, drafting and verification."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def sample_rows(probs: torch.Tensor, generator: torch.Generator | Sequence[torch.Generator] | None) -> torch.Tensor:
    """One token per row of probs [B, V], from one shared generator or from one generator per row (the engine's
    per-request streams: each row then consumes exactly one draw of its own generator)."""
    if isinstance(generator, (list, tuple)):
        return torch.cat([torch.multinomial(p[None], 1, generator=g) for p, g in zip(probs, generator)]).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def pick_tokens(logits: torch.Tensor, do_sample: bool,
                generator: torch.Generator | Sequence[torch.Generator] | None = None) -> torch.Tensor:
    """Greedy argmax, or a sample from softmax(logits) (logits already processed): [B, V] -> [B]."""
    if do_sample:
        return sample_rows(torch.softmax(logits.float(), dim=-1), generator)
    return logits.argmax(-1)


__all__ = ["pick_tokens", "sample_rows"]
