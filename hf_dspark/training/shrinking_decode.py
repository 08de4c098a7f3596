"""Batched plain decoding whose batch shrinks as answers finish: the regeneration's decode loop.

``generate`` keeps every row of a batch until the longest answer ends. When answers run from a few dozen tokens to
the cap, most of a batch's late steps are spent on rows that already finished (their tokens are thrown away). Here
a finished row leaves the batch, and the KV cache with it, every ``compact_every`` steps, so later steps compute
only the answers still running. Between compactions a finished row keeps decoding, as in ``generate``, and its
tokens are ignored: compacting every step would copy the whole cache each time.

The tokens come from the same computation as ``generate``'s (left padding, positions from the attention mask, one
KV cache), so greedy answers equal ``generate``'s wherever the batch's shape does not tip an exact tie; sampled
answers draw from the same distribution (:func:`hf_dspark.sampling.nucleus`), with different random numbers once a
row has left.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..kv_cache import growing_cache
from ..modeling.target_support import cache_kwarg
from ..sampling import draw_from_nucleus

NextTokens = Callable[[torch.Tensor], torch.Tensor]  # last-position logits [B, V] -> token ids [B]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def nucleus_sampler(temperature: float, top_p: float = 1.0, top_k: int | None = None,
                    generator: torch.Generator | None = None) -> NextTokens:
    """Draws as ``do_sample=True`` with transformers' temperature / top-k / top-p warpers would."""
    if temperature <= 0:
        raise ValueError(f"nucleus_sampler samples: temperature must be > 0 (got {temperature}); use greedy_tokens")

    def draw(logits: torch.Tensor) -> torch.Tensor:
        return draw_from_nucleus(logits, temperature, top_p, top_k, generator)

    return draw


@dataclass
class DecodedRow:
    tokens: list[int]  # the answer's tokens, without the end-of-sequence token
    stop_token: int | None = None  # the end-of-sequence token that ended it (None: it reached max_new_tokens)

    @property
    def finished(self) -> bool:
        return self.stop_token is not None


@torch.inference_mode()
def decode_shrinking(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                     next_tokens: NextTokens = greedy_tokens, eos_token_ids: Iterable[int] = (),
                     compact_every: int = 16, cache: DynamicCache | None = None) -> list[DecodedRow]:
    """Decode up to ``max_new_tokens`` after each left-padded row of ``input_ids``; one :class:`DecodedRow` per row.

    ``compact_every``: how many steps pass between removals of finished rows (each copies the live rows' cache).
    ``cache``: an empty cache to fill (default: :func:`~hf_dspark.kv_cache.growing_cache`, which appends in place
    where transformers' ``DynamicCache`` copies every layer's whole cache at every step).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
    if compact_every < 1:
        raise ValueError(f"compact_every must be >= 1 (got {compact_every})")
    eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=input_ids.device)
    attention_mask = attention_mask.to(input_ids.device, torch.long)
    positions = (attention_mask.cumsum(-1) - 1).masked_fill_(attention_mask == 0, 1)  # as generate's
    cache = growing_cache(model.config) if cache is None else cache
    cache_arg = {cache_kwarg(model): cache}  # the keyword this transformers names the KV cache by
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                logits_to_keep=1, **cache_arg)
    next_position = positions[:, -1:] + 1
    live = torch.arange(input_ids.shape[0], device=input_ids.device)  # original row of each row still in the batch
    answers: list[list[int]] = [[] for _ in range(input_ids.shape[0])]
    stop_tokens: list[int | None] = [None] * input_ids.shape[0]
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for step in range(max_new_tokens):
        token = next_tokens(out.logits[:, -1])
        ended = torch.isin(token, eos)
        for row, t, end, was_done in zip(live.tolist(), token.tolist(), ended.tolist(), done.tolist()):
            if was_done:
                continue
            if end:
                stop_tokens[row] = t
            else:
                answers[row].append(t)
        done |= ended
        if step + 1 == max_new_tokens or bool(done.all()):
            break
        if (step + 1) % compact_every == 0 and bool(done.any()):
            keep = (~done).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            live, token, done = live[keep], token[keep], done[keep]
            attention_mask, next_position = attention_mask[keep], next_position[keep]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], dim=1)
        out = model(input_ids=token[:, None], attention_mask=attention_mask, position_ids=next_position,
                    use_cache=True, **cache_arg)
        next_position = next_position + 1
    return [DecodedRow(tokens, stop) for tokens, stop in zip(answers, stop_tokens)]


__all__ = ["DecodedRow", "NextTokens", "decode_shrinking", "greedy_tokens", "nucleus_sampler"]
