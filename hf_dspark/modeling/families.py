"""Target families: the few per-architecture facts a drafter backbone needs to copy a target's layer shapes.

Adding a family is one ``register_target_family`` call: the drafter's attention, MLP and norms are generic;
only these switches differ between Llama-style, Qwen2 and Qwen3 layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TargetFamily:
    name: str
    rotary_embedding: Callable[[object], nn.Module]  # target config -> module(x, position_ids) -> (cos, sin)
    use_qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    qkv_bias: Callable[[object], bool] = lambda cfg: bool(getattr(cfg, "attention_bias", False))
    o_bias: Callable[[object], bool] = lambda cfg: bool(getattr(cfg, "attention_bias", False))
    mlp_bias: Callable[[object], bool] = lambda cfg: bool(getattr(cfg, "mlp_bias", False))
    embed_scale: Callable[[object], float] = lambda cfg: 1.0
    logit_softcap: Callable[[object], float | None] = lambda cfg: getattr(cfg, "final_logit_softcapping", None)


TARGET_FAMILIES: dict[str, TargetFamily] = {}


def register_target_family(family: TargetFamily) -> None:
    TARGET_FAMILIES[family.name] = family


def get_target_family(model_type: str) -> TargetFamily:
    try:
        return TARGET_FAMILIES[model_type]
    except KeyError:
        raise ValueError(f"Target family {model_type!r} is not supported yet (supported: {sorted(TARGET_FAMILIES)}). "
                         "Add it with hf_dspark.modeling.families.register_target_family.") from None


def soft_cap_logits(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap · tanh(logits / cap) for families with a final logit soft-cap (``TargetFamily.logit_softcap``);
    unchanged without one. Shared by the drafter's use of the target's LM head and training's target logits."""
    return torch.tanh(logits / cap) * cap if cap else logits


def _llama_rotary(cfg):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(config=cfg)


def _qwen3_rotary(cfg):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    return Qwen3RotaryEmbedding(config=cfg)


def _qwen2_rotary(cfg):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    return Qwen2RotaryEmbedding(config=cfg)


register_target_family(TargetFamily("llama", _llama_rotary))
register_target_family(TargetFamily("mistral", _llama_rotary))
register_target_family(TargetFamily("qwen2", _qwen2_rotary, qkv_bias=lambda cfg: True, o_bias=lambda cfg: False))
# Qwen3 layers have one attention_bias for q/k/v/o and never an MLP bias (a Llama config's mlp_bias is ignored).
register_target_family(TargetFamily("qwen3", _qwen3_rotary, use_qk_norm=True, mlp_bias=lambda cfg: False))

#: Draft layer styles: ``"target"`` copies the target family's layer (what drafters before ``draft_layer_style``
#: had); any registered family name builds that family's layer with the target's shapes. New drafters use
#: ``"qwen3"``, the one layer speculators and vLLM build for every DSpark / DFlash drafter, whatever the target.
TARGET_LAYER_STYLE = "target"
PORTABLE_LAYER_STYLE = "qwen3"


def layer_family(layer_style: str, target_family: TargetFamily) -> TargetFamily:
    """The family whose layer switches (q/k norm, biases) a drafter's backbone uses; RoPE, embedding scale and
    logit soft-cap stay the target's, because they describe the target's positions, embedding and LM head."""
    if layer_style == TARGET_LAYER_STYLE:
        return target_family
    return get_target_family(layer_style)
