"""The drafter's backbone layers: pre-norm decoder layers with the target's shapes, whose attention reads the
context only through K/V (SPEC §2: queries are the block; keys are the cached context plus the block).

Kept apart from ``modeling.py`` (the model: caches, blocks, target binding) because Eagle3 reuses them with a
wider input, and because the round's fused pass lives here: a layer can take the committed context that is not
in the cache yet (``new_context``) and project it with the block's keys and values in one go, as DFlash's
reference does, instead of in a separate pass before drafting.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from .families import TargetFamily


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalised in fp32, scaled in the input dtype (the reference convention); F.rms_norm is the same
        # arithmetic as x · rsqrt(mean(x²) + eps) (bit-identical, tested) in one call instead of five
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, n, hd], cos/sin [B, n, hd] (the HF rotary convention: halves rotated)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DraftAttention(nn.Module):
    """GQA attention whose keys/values are [context K/V ; block K/V]; queries are the block only."""

    def __init__(self, tcfg, family: TargetFamily, input_size: int | None = None):
        super().__init__()
        self.num_heads = tcfg.num_attention_heads
        self.num_kv_heads = tcfg.num_key_value_heads
        self.head_dim = getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads
        d, qkv_bias = tcfg.hidden_size, family.qkv_bias(tcfg)
        n_in = input_size or d  # Eagle3's layer reads [token embedding ; feature] (2d) and writes d
        self.q_proj = nn.Linear(n_in, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(n_in, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(n_in, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=family.o_bias(tcfg))
        if family.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, tcfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, tcfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def _heads(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        return x.view(*x.shape[:2], num_heads, self.head_dim).transpose(1, 2)  # [B, H, n, hd]

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, n, d] -> post-norm, post-RoPE keys and values [B, Hkv, n, hd]."""
        k = self._heads(self.k_proj(x), self.num_kv_heads)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return _apply_rotary(k, cos, sin), self._heads(self.v_proj(x), self.num_kv_heads)

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, n, d] -> post-norm, post-RoPE queries [B, H, n, hd]."""
        q = self._heads(self.q_proj(x), self.num_heads)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return _apply_rotary(q, cos, sin)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask, new_context: torch.Tensor | None = None,
                new_kv: list | None = None) -> torch.Tensor:
        """x [B, q, d]; ctx_k/v [B, Hkv, S, hd]; mask [B, 1, q, S + n + q] bool (True = attend).

        ``new_context`` [B, n, d] (fused target features of committed positions not cached yet): projected with
        the block's keys/values in one pass (cos/sin then cover [n context ; q block] positions) and appended to
        ``new_kv`` as (keys, values) [B, Hkv, n, hd] for the caller to cache."""
        n = 0 if new_context is None else new_context.shape[1]
        q = self.project_q(x, cos[:, n:], sin[:, n:]) if n else self.project_q(x, cos, sin)
        k, v = self.project_kv(x if not n else torch.cat([new_context, x], dim=1), cos, sin)
        if n:
            new_kv.append((k[:, :, :n], v[:, :, :n]))
        k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))


class DraftMLP(nn.Module):
    def __init__(self, tcfg, family: TargetFamily):
        super().__init__()
        d, ffn, bias = tcfg.hidden_size, tcfg.intermediate_size, family.mlp_bias(tcfg)
        self.gate_proj = nn.Linear(d, ffn, bias=bias)
        self.up_proj = nn.Linear(d, ffn, bias=bias)
        self.down_proj = nn.Linear(ffn, d, bias=bias)
        self.act_fn = ACT2FN[getattr(tcfg, "hidden_act", "silu")]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DraftDecoderLayer(nn.Module):
    """Pre-norm decoder layer with the target's shapes; the context enters only through K/V."""

    def __init__(self, tcfg, family: TargetFamily):
        super().__init__()
        self.self_attn = DraftAttention(tcfg, family)
        self.mlp = DraftMLP(tcfg, family)
        self.input_layernorm = RMSNorm(tcfg.hidden_size, tcfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(tcfg.hidden_size, tcfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask, new_context=None, new_kv=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask, new_context, new_kv)
        return x + self.mlp(self.post_attention_layernorm(x))


__all__ = ["DraftAttention", "DraftDecoderLayer", "DraftMLP", "RMSNorm"]
