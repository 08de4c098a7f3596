"""One KV cache for a ragged batch: rows of different lengths, rejected draft slots kept as masked *holes*.

Layout shared by ``generate`` (one batch of prompts) and the serving engine (requests joining and leaving):
the target's ``DynamicCache`` holds tensors [R, H, S, hd] and a long mask [R, S] says which slots hold K/V of a
committed token (1) and which are holes (0). Every row carries explicit position ids, so a hole costs attention
compute but never shifts a position. Causality is by slot index: new tokens are always appended after every
existing slot, so holes anywhere in the past are harmless. The drafter's ``DraftCache`` has the same shape of
problem (``valid`` [R, S] plus per-slot ``positions``) and gets the same three operations:

* :func:`crop_trailing_holes` drops slot columns that are holes in every row (cheap, every round);
* :func:`stack_rows` puts separately prefilled rows into one batch, left-padding the shorter ones with holes;
* :func:`compact_rows` packs each row's committed slots to the right, removing holes (a full copy, so the
  engine runs it only when holes have piled up).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..modeling.modeling import DraftCache


def cache_kwarg(model) -> str:
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name still works but warns)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def num_trailing_holes(mask: torch.Tensor) -> int:
    """Slot columns at the end of the cache that are holes in every row. mask [R, S]."""
    return int((mask.flip(1).cumsum(1) == 0).sum(1).min())


def crop_trailing_holes(cache: DynamicCache, mask: torch.Tensor) -> torch.Tensor:
    """Drop the trailing columns that are holes in every row from ``cache`` (in place); returns the new mask."""
    trailing = num_trailing_holes(mask)
    if trailing:
        cache.crop(-trailing)  # transformers >= 5.24: a negative count is the number of slots to drop
        mask = mask[:, :-trailing]
    return mask


def _layer_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _left_pad(x: torch.Tensor, width: int, dim: int, value=0) -> torch.Tensor:
    """Pad ``x`` at the front of ``dim`` to ``width`` slots."""
    missing = width - x.shape[dim]
    if missing <= 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [missing, 0]
    return F.pad(x, pad, value=value)


def stack_rows(parts: Sequence[tuple[DynamicCache, torch.Tensor]], config) -> tuple[DynamicCache, torch.Tensor]:
    """Concatenate ragged-batch caches along the batch; shorter ones are left-padded with holes.

    ``parts``: (cache [r_i, H, S_i, hd] per layer, mask [r_i, S_i]). Returns a new cache and mask [Σr_i, max S_i]."""
    width = max(mask.shape[1] for _, mask in parts)
    per_part = [_layer_tensors(cache) for cache, _ in parts]
    layers = []
    for layer in range(len(per_part[0])):
        keys = torch.cat([_left_pad(tensors[layer][0], width, 2) for tensors in per_part])
        values = torch.cat([_left_pad(tensors[layer][1], width, 2) for tensors in per_part])
        layers.append((keys, values))
    mask = torch.cat([_left_pad(mask, width, 1) for _, mask in parts])
    return DynamicCache(ddp_cache_data=layers, config=config), mask


def packing_index(valid: torch.Tensor) -> torch.Tensor:
    """[R, S'] slot indices that move each row's valid slots (in order) to the right end of a width-S' row,
    S' = the largest number of valid slots in a row; the leading entries of shorter rows point at holes."""
    counts = valid.long().sum(1)
    width = int(counts.max()) if counts.numel() else 0
    # stable sort on the 0/1 flag: holes first, then valid slots in their original order
    order = torch.sort(valid.to(torch.uint8), dim=1, stable=True).indices
    return order[:, order.shape[1] - width:]


def _gather_slots(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [R, H, S, hd], index [R, S'] -> [R, H, S', hd]."""
    return x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


def compact_rows(cache: DynamicCache, mask: torch.Tensor, config) -> tuple[DynamicCache, torch.Tensor]:
    """Remove holes: every row keeps exactly its committed slots, packed right (positions are unchanged, as they
    travel as explicit ids). Returns a new cache and mask [R, max valid]."""
    index = packing_index(mask.bool())
    layers = [(_gather_slots(k, index), _gather_slots(v, index)) for k, v in _layer_tensors(cache)]
    return DynamicCache(ddp_cache_data=layers, config=config), mask.gather(1, index)


def stack_draft_rows(parts: Sequence[DraftCache]) -> DraftCache:
    """:func:`stack_rows` for drafter caches (padding slots are invalid, position 0)."""
    width = max(part.num_slots for part in parts)
    num_layers = len(parts[0].keys)
    keys = [torch.cat([_left_pad(p.keys[i], width, 2) for p in parts]) for i in range(num_layers)]
    values = [torch.cat([_left_pad(p.values[i], width, 2) for p in parts]) for i in range(num_layers)]
    valid = torch.cat([_left_pad(p.valid, width, 1, value=False) for p in parts])
    positions = torch.cat([_left_pad(p.positions, width, 1) for p in parts])
    return DraftCache(keys, values, valid, positions)


def compact_draft_cache(cache: DraftCache) -> DraftCache:
    """:func:`compact_rows` for a drafter cache."""
    if cache.valid is None:
        return cache
    index = packing_index(cache.valid)
    return DraftCache([_gather_slots(k, index) for k in cache.keys], [_gather_slots(v, index) for v in cache.values],
                      cache.valid.gather(1, index), cache.positions.gather(1, index))


__all__ = ["cache_kwarg", "compact_draft_cache", "compact_rows", "crop_trailing_holes", "num_trailing_holes",
           "packing_index", "stack_draft_rows", "stack_rows"]
