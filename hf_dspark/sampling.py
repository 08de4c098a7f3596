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


def nucleus(scores: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int | None = None,
            candidates: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens transformers' temperature, top-k and top-p warpers leave, and their probabilities: ([B, K] ids,
    [B, K] probabilities, zero outside the nucleus), for scores [B, V].

    The same rule as ``TopPLogitsWarper`` (a token stays while the mass ranked above it is below ``top_p``; the most
    likely always stays), ranked over the best ``candidates`` only: when they hold at least ``top_p`` of the mass
    the nucleus lies inside them, which at a model's recommended low temperature is nearly always; otherwise the
    whole vocabulary is ranked. Sorting a 49k vocabulary every step was most of a batched
    sampled decode's overhead on a CPU."""
    scaled = scores.float() / temperature
    if top_k:
        values, ids = scaled.topk(min(top_k, scaled.shape[-1]), dim=-1)
        log_total = values.logsumexp(-1, keepdim=True)  # top-k renormalises before top-p, as the warpers chain
    elif top_p >= 1.0:  # no nucleus: every token, unranked
        ids = torch.arange(scaled.shape[-1], device=scaled.device).expand_as(scaled)
        return ids, torch.softmax(scaled, dim=-1)
    else:
        log_total = scaled.logsumexp(-1, keepdim=True)
        values, ids = scaled.topk(min(candidates, scaled.shape[-1]), dim=-1)
        if bool(((values - log_total).exp().sum(-1) < top_p).any()):
            values, ids = scaled.sort(dim=-1, descending=True, stable=True)
    probs = (values - log_total).exp()
    mass_above = probs.cumsum(-1) - probs
    keep = mass_above < top_p
    keep[:, 0] = True
    return ids, probs * keep


def draw_from_nucleus(scores: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int | None = None,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of scores [B, V], drawn from :func:`nucleus`: [B]."""
    ids, probs = nucleus(scores, temperature, top_p, top_k)
    return ids.gather(1, sample_rows(probs, generator)[:, None]).squeeze(1)


class NucleusDraw:
    """A logits processor that draws the next token itself, from :func:`nucleus`, and leaves only that token
    finite: run ``generate`` greedy with it (``do_sample=False``) and it samples as ``do_sample=True`` with
    ``temperature`` / ``top_k`` / ``top_p`` would, the same distribution, without ranking and drawing over the
    whole vocabulary each step. For bulk sampling where only the tokens matter (the regeneration of training
    data): the scores ``generate`` reports are this one-hot, not the model's."""

    def __init__(self, temperature: float, top_p: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None):
        if temperature <= 0:
            raise ValueError(f"NucleusDraw samples: temperature must be > 0 (got {temperature}); use greedy instead")
        self.temperature, self.top_p, self.top_k, self.generator = temperature, top_p, top_k, generator

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        drawn = draw_from_nucleus(scores, self.temperature, self.top_p, self.top_k, self.generator)
        return torch.full_like(scores, float("-inf")).scatter_(1, drawn[:, None], 0.0)


__all__ = ["NucleusDraw", "draw_from_nucleus", "nucleus", "pick_tokens", "sample_rows"]
