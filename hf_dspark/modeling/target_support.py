"""What a target must offer for speculative decoding with a ragged cache, and how to call its forward.

One place for the checks ``generate``, the engine and the step-cost profiler share: rejected draft slots stay in
the target's ``DynamicCache`` as masked holes (or are cropped), which only full-attention decoder layers can hold.
"""

from __future__ import annotations

import inspect


def cache_kwarg(model) -> str:
    """The forward's cache argument: transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name still
    works but warns)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def raise_if_unsupported_target(model, who: str = "hf-dspark") -> None:
    """Refuse encoder-decoder targets and targets with sliding-window / linear-attention layers."""
    if model.config.is_encoder_decoder:
        raise ValueError(f"{who} supports decoder-only targets only (got an encoder-decoder "
                         f"{type(model).__name__}).")
    layer_types = getattr(model.config.get_text_config(), "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"{who} needs a target with full attention in every layer: rejected draft slots are kept "
                         "as masked holes or rolled back, which sliding-window and linear-attention caches cannot do "
                         f"(layer types: {sorted(set(layer_types))}).")


__all__ = ["cache_kwarg", "raise_if_unsupported_target"]
