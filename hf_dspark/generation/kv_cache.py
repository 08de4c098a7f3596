"""The target's KV cache as the speculative loop holds it: transformers' ``DynamicCache``, built and grown without
copies it does not need.

Two costs of the stock cache show up in every round of a CPU loop:

* ``DynamicCache(ddp_cache_data=...)`` fills each layer through ``update``, i.e. ``torch.cat`` onto an empty tensor:
  a second copy of every K/V tensor we just built by stacking, packing or selecting rows (a fifth of what a
  compaction of the engine's batch cost, over half of a stack). :func:`cache_from_tensors` installs them as they are.
* ``DynamicLayer.update`` appends by ``torch.cat``, which copies the whole layer on every forward: with 16 rows of
  ~400 slots that is ~8 % of an engine step, and it grows with the context. :class:`GrowingLayer` appends into
  spare capacity instead (a quarter of its length, 64 to 1024 slots) and returns a view, so a round costs the K/V
  it adds.

Both stay ``DynamicCache`` / ``DynamicLayer`` for transformers (masking, ``crop``, ``batch_select_indices``,
in-place row writes and slicing all keep working): a crop or a slice of leading slots stays a view of the buffer,
and a layer whose ``keys`` were replaced by any other tensor (a row selection, a tensor built elsewhere) simply
starts a new buffer on its next append — no worse than ``torch.cat``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

#: spare slots a new buffer gets: a quarter of its length, at least 64 (short contexts reallocate rarely) and at
#: most 1024 (a long context on an accelerator must not hold much more memory than it uses; reallocating every
#: 1024 appended tokens is still ~1/1000 of the copying ``torch.cat`` does)
MIN_SPARE_SLOTS = 64
MAX_SPARE_SLOTS = 1024
SPARE_FRACTION = 0.25


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer whose appends write into spare capacity (``keys`` / ``values`` are views of a
    larger buffer along the slot dimension) instead of concatenating a new tensor every forward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def _start_in_buffer(self, tensor: torch.Tensor, buffer: torch.Tensor | None) -> int | None:
        """The slot at which ``tensor`` (this layer's keys or values) starts inside ``buffer``, when it is a plain
        slot-range view of it (what our appends, a ``crop`` or a slice of leading slots leave); else None."""
        if buffer is None or tensor.dim() != 4 or tensor.dtype != buffer.dtype or tensor.device != buffer.device:
            return None
        if tensor.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
            return None
        if tensor.shape[:2] != buffer.shape[:2] or tensor.shape[3] != buffer.shape[3]:
            return None
        if tensor.stride() != buffer.stride():
            return None
        offset = tensor.storage_offset() - buffer.storage_offset()
        slot_stride = buffer.stride(2)
        if offset < 0 or offset % slot_stride:
            return None
        start = offset // slot_stride
        return start if start + tensor.shape[2] <= buffer.shape[2] else None

    def _append(self, current: torch.Tensor, new: torch.Tensor, buffer: torch.Tensor | None):
        """``current`` + ``new`` along the slots, as a view of ``buffer`` or of a fresh, larger one."""
        start = self._start_in_buffer(current, buffer) if current.numel() else None
        length, added = (current.shape[2] if current.dim() == 4 else 0), new.shape[2]
        if start is None or start + length + added > buffer.shape[2]:
            spare = min(MAX_SPARE_SLOTS, max(MIN_SPARE_SLOTS, int(SPARE_FRACTION * (length + added))))
            capacity = length + added + spare
            buffer = new.new_empty(new.shape[0], new.shape[1], capacity, new.shape[3])
            if length:
                buffer[:, :, :length] = current
            start = 0
        buffer[:, :, start + length: start + length + added] = new
        return buffer[:, :, start: start + length + added], buffer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self._key_buffer = self._append(self.keys, key_states, self._key_buffer)
        self.values, self._value_buffer = self._append(self.values, value_states, self._value_buffer)
        return self.keys, self.values


def growing_cache(config) -> DynamicCache:
    """An empty ``DynamicCache`` for ``config`` whose full-attention layers are :class:`GrowingLayer` (sliding-window
    and other special layers are kept as transformers builds them)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def cache_from_tensors(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], config) -> DynamicCache:
    """A ``DynamicCache`` holding ``layers`` (keys, values per layer) as they are — no copy (the stock
    ``DynamicCache(ddp_cache_data=...)`` copies each through ``torch.cat``). Layers grow as :class:`GrowingLayer`."""
    cache = growing_cache(config)
    if len(cache.layers) != len(layers):  # a config whose layers do not map one to one: the stock path
        return DynamicCache(ddp_cache_data=list(layers), config=config)
    for layer, (keys, values) in zip(cache.layers, layers):
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    return cache


__all__ = ["GrowingLayer", "cache_from_tensors", "growing_cache"]
