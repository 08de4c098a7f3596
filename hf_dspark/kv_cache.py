"""The target's KV cache as the speculative loop holds it: transformers' ``DynamicCache``, built and grown without
copies it does not need.

Two costs of the stock cache show up in every round of a CPU loop:

* ``DynamicCache(ddp_cache_data=...)`` fills each layer through ``update``, i.e. ``torch.cat`` onto an empty tensor:
  a second copy of every K/V tensor we just built by stacking, packing or selecting rows (a fifth of what a
  compaction of the engine's batch cost, over half of a stack). :func:`cache_from_tensors` installs them as they are.
* ``DynamicLayer.update`` appends by ``torch.cat``, which copies the whole layer on every forward: with 16 rows of
  ~400 slots that is ~8 % of an engine step, and it grows with the context. :class:`GrowingLayer` appends into
  spare capacity instead (a quarter of its length, 64 to 1024 slots) and returns a view, so a round costs the K/V
  it adds. The buffer keeps free slots before the first one too (an eighth of its length, 128 to 256), so that the
  engine's batch can widen to the left in place when a request joins with a prompt wider than the batch.

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
#: free slots a new buffer keeps *before* its first slot: a request joining the engine's batch with a prompt wider
#: than the batch widens every row to the left into them (zeroed holes) and takes a finished request's row in
#: place; without the room it is stacked onto a copy of the whole batch (then the vacant row dropped: another copy,
#: and a new buffer on the next append: a third). An eighth of the length, 128 to 256 slots (memory: at most half
#: the spare kept after the last slot). At least 128 because an agent's next request is its last one plus a reply
#: and a tool result, and joins that outgrow the room by a few slots each copy the whole batch.
MIN_LEAD_SLOTS = 128
MAX_LEAD_SLOTS = 256
LEAD_FRACTION = 0.125


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
            lead = min(MAX_LEAD_SLOTS, max(MIN_LEAD_SLOTS, int(LEAD_FRACTION * (length + added))))
            buffer = new.new_empty(new.shape[0], new.shape[1], lead + length + added + spare, new.shape[3])
            if length:
                buffer[:, :, lead:lead + length] = current
            start = lead
        buffer[:, :, start + length: start + length + added] = new
        return buffer[:, :, start: start + length + added], buffer

    def front_room(self) -> int:
        """Free slots before the first slot (both keys and values in their buffers; 0 when either is not)."""
        if not self.is_initialized:
            return 0
        starts = (self._start_in_buffer(self.keys, self._key_buffer),
                  self._start_in_buffer(self.values, self._value_buffer))
        return 0 if None in starts else min(starts)

    def extend_front(self, slots: int) -> None:
        """Prepend ``slots`` zeroed slots (within :meth:`front_room`): holes for the caller's mask, zeros so that a
        masked key or value never carries a NaN into attention."""
        room = self.front_room()
        if slots > room:
            raise ValueError(f"GrowingLayer: {slots} slots asked before the first, {room} free")
        for name, buffer in (("keys", self._key_buffer), ("values", self._value_buffer)):
            current = getattr(self, name)
            start = self._start_in_buffer(current, buffer)
            buffer[:, :, start - slots:start].zero_()
            setattr(self, name, buffer[:, :, start - slots:start + current.shape[2]])

    def keep_leading_rows(self, rows: int) -> None:
        """Keep rows [0, rows) as views of the same buffers: the rows past them are dropped without a copy and
        appends stay in place (their memory is released when the buffer next grows, within ``MAX_SPARE_SLOTS``
        appended slots)."""
        for name, buffer_name in (("keys", "_key_buffer"), ("values", "_value_buffer")):
            current, buffer = getattr(self, name), getattr(self, buffer_name)
            in_buffer = self._start_in_buffer(current, buffer) is not None
            setattr(self, name, current[:rows])
            setattr(self, buffer_name, buffer[:rows] if in_buffer else None)

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


def front_room(cache: DynamicCache) -> int:
    """Slots every layer of ``cache`` can prepend in place (:meth:`GrowingLayer.extend_front`); 0 if any cannot."""
    return min((layer.front_room() if isinstance(layer, GrowingLayer) else 0 for layer in cache.layers), default=0)


def extend_front(cache: DynamicCache, slots: int) -> None:
    """Prepend ``slots`` zeroed slots to every layer (within :func:`front_room`)."""
    for layer in cache.layers:
        layer.extend_front(slots)


def drop_rows_in_place(cache: DynamicCache, moves: Sequence[tuple[int, int]], rows: int) -> bool:
    """Keep ``rows`` rows of ``cache`` where row ``dst`` takes row ``src`` for each (dst, src) of ``moves`` (every
    ``dst`` < ``rows`` <= every ``src``) and every other kept row stays where it is: only the moved rows are copied,
    the kept ones stay views of their buffers (``batch_select_indices`` copies every row that stays, and the next
    append starts a new buffer: a second copy). False, nothing changed, for a cache whose layers are not all
    :class:`GrowingLayer` (other layer kinds may keep per-row state of their own) or an object standing in for one."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(isinstance(layer, GrowingLayer) and layer.is_initialized for layer in layers):
        return False
    if any(not dst < rows <= src for dst, src in moves):
        raise ValueError(f"drop_rows_in_place: every move must go from past the {rows} kept rows into them: {moves}")
    for layer in cache.layers:
        for dst, src in moves:
            layer.keys[dst] = layer.keys[src]
            layer.values[dst] = layer.values[src]
        layer.keep_leading_rows(rows)
    return True


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


__all__ = ["GrowingLayer", "cache_from_tensors", "drop_rows_in_place", "extend_front", "front_room", "growing_cache"]
