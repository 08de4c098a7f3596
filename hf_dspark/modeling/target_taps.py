"""Capture raw outputs of chosen target decoder layers with forward hooks.

Why hooks and not ``output_hidden_states``: the list form of ``output_hidden_states`` changed meaning twice in
transformers 5.x (layer-indexed in 5.18, tuple-indexed in 5.23), and ``True`` materialises every layer for the
whole prompt. A hook on ``decoder.layers[i]`` returns the raw output of layer i in every version.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
from torch import nn


def decoder_layers(target: nn.Module) -> nn.ModuleList:
    """The target's decoder-layer list (``model.model.layers`` for Llama/Qwen-style causal LMs)."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else getattr(target, "model", target)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"Cannot find the decoder layers of {type(target).__name__}: expected "
                         "`target.get_decoder().layers`.")
    return layers


class TargetFeatureTap:
    """Records the outputs of ``layer_ids`` on every target forward run by the thread that attached it;
    :meth:`features` concatenates them.

    Why per thread: the hooks sit on the shared target, and two ``generate`` calls on one target in two threads
    (or a call beside the serving engine) each tap it; a tap that recorded every forward would hand one call the
    other's features. Use as a context manager (hooks are removed on exit) or call :meth:`attach`/:meth:`detach`.
    """

    def __init__(self, target: nn.Module, layer_ids: list[int]):
        self.target = target
        self.layer_ids = list(layer_ids)
        self._outputs: dict[int, torch.Tensor] = {}
        self._handles: list = []
        self._thread: int | None = None

    def _hook(self, layer_id: int):
        def hook(module, args, output):
            if threading.get_ident() == self._thread:
                self._outputs[layer_id] = output[0] if isinstance(output, (tuple, list)) else output
        return hook

    def attach(self) -> "TargetFeatureTap":
        self._thread = threading.get_ident()
        if not self._handles:
            layers = decoder_layers(self.target)
            for i in self.layer_ids:
                if not 0 <= i < len(layers):
                    raise ValueError(f"target_layer_ids contains {i}, but the target has {len(layers)} layers.")
                self._handles.append(layers[i].register_forward_hook(self._hook(i)))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._outputs.clear()

    def __enter__(self) -> "TargetFeatureTap":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    def features(self) -> torch.Tensor:
        """[B, n, m·d]: the last forward's tapped outputs, concatenated in ascending layer order."""
        missing = [i for i in self.layer_ids if i not in self._outputs]
        if missing:
            raise RuntimeError(f"No target forward has run through layers {missing} since the tap was attached.")
        return torch.cat([self._outputs[i] for i in self.layer_ids], dim=-1)


@contextmanager
def tap_target(target: nn.Module, layer_ids: list[int]):
    tap = TargetFeatureTap(target, layer_ids).attach()
    try:
        yield tap
    finally:
        tap.detach()
