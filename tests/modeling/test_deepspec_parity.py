"""Published DeepSpec drafters draft exactly as DeepSpec does, at T = 0 and T = 1, as loaded (no option to set).

Fixtures (``tests/fixtures/deepspec``, made by ``make_fixtures.py`` there): random weights in DeepSpec's own
checkpoint layout for its four released variants (DSpark with the vanilla Markov, gated and RNN heads, each with a
confidence head; DFlash) and a tiny Qwen3 target. The reference values are computed here by a deliberately slow,
independent pure-PyTorch path written from the DSpark paper and DeepSpec's description (SPEC §2; notes/
deepspec_reference.md §1): it reads the raw tensors by DeepSpec's names and shares no code with hf-dspark's model
(explicit per-head loops for attention, RoPE and RMSNorm by hand). For every prompt and slot it gives the greedy ids,
the base logits U_k, the base + sequential-bias logits, q_k at T = 1 on the prefix actually sampled, and the
confidences c_k. The sequential bias is over the full vocabulary, as in DeepSpec (``sequential_top_k = 0``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_dspark import DraftCache, DSparkDraftModel

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspec"
VARIANTS = ["dspark_markov", "dspark_gated", "dspark_rnn", "dflash"]
PROMPTS = [[1, 17, 42, 8, 63, 5], [1, 3, 3, 90, 12, 77, 41, 20, 9, 33, 64], [1, 50, 28]]
# ours runs in float32, the reference in float64: logits (|U + B| up to ~10 here) agree to float32 rounding
LOGIT_ATOL, ATOL = 1e-5, 5e-6


# -------------------------------------------------------------------------------------------------------
# The independent reference (DeepSpec semantics, written out by hand)
# -------------------------------------------------------------------------------------------------------
class DeepSpecReference:
    """Qwen3DSparkModel's inference, from its published description.

    Block = [anchor, MASK × (γ-1)] at positions p .. p+γ-1; every slot predicts (slot k -> token p+k+1).
    Context = RMSNorm(fc(concat of raw taps hidden_states[i+1])) at positions 0 .. p-1, projected by each layer's
    k/v (with k_norm and RoPE at the context positions) and prepended to the block's keys/values; block queries
    attend to the whole context and bidirectionally to the block. Logits U_k = lm_head(norm(h_k)); the sequential
    head adds B_k(x_{k-1}) (x_{-1} = anchor) left to right; q_k = softmax((U_k + B_k) / T);
    c_k = σ(w·[h_k ; W1[x_{k-1}]] + b).
    """

    def __init__(self, path: Path):
        self.cfg = json.loads((path / "config.json").read_text())
        self.w = {k: v.double() for k, v in load_file(str(path / "model.safetensors")).items()}
        c = self.cfg
        self.heads, self.kv_heads, self.hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.eps = c["rms_norm_eps"]
        rope = c.get("rope_parameters") or {}
        self.theta = rope.get("rope_theta", c.get("rope_theta"))
        self.head_type = c["markov_head_type"] if c["markov_rank"] else None

    def rms(self, x, weight):
        return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps))

    def rope(self, x, pos: int):
        """x [hd] at absolute position pos: rotate (x1, x2) halves by pos · θ^(-2i/hd)."""
        half = self.hd // 2
        out = torch.empty_like(x)
        for i in range(half):
            angle = pos * self.theta ** (-2.0 * i / self.hd)
            c, s = math.cos(angle), math.sin(angle)
            out[i] = x[i] * c - x[i + half] * s
            out[i + half] = x[i + half] * c + x[i] * s
        return out

    def backbone(self, features: torch.Tensor, block_ids: list[int], p: int) -> torch.Tensor:
        """features [p, m·d] (context positions 0..p-1); returns final-normed h [γ, d]."""
        w, hd = self.w, self.hd
        ctx = self.rms(features.double() @ w["fc.weight"].T, w["hidden_norm.weight"])
        x = w["embed_tokens.weight"][block_ids]  # the frozen copy of the target embedding (mask = its row)
        gamma = len(block_ids)
        for layer in range(self.cfg["num_hidden_layers"]):
            pre = f"layers.{layer}."
            h = self.rms(x, w[pre + "input_layernorm.weight"])

            def heads(mat, n, norm, positions):
                out = []
                for t in range(mat.shape[0]):
                    row = []
                    for j in range(n):
                        v = mat[t, j * hd:(j + 1) * hd]
                        if norm is not None:
                            v = self.rope(self.rms(v, w[pre + norm]), positions[t])
                        row.append(v)
                    out.append(torch.stack(row))
                return torch.stack(out)  # [t, n, hd]

            block_pos = [p + k for k in range(gamma)]
            ctx_pos = list(range(p))
            q = heads(h @ w[pre + "self_attn.q_proj.weight"].T, self.heads, "self_attn.q_norm.weight", block_pos)
            k = torch.cat([heads(ctx @ w[pre + "self_attn.k_proj.weight"].T, self.kv_heads, "self_attn.k_norm.weight",
                                 ctx_pos),
                           heads(h @ w[pre + "self_attn.k_proj.weight"].T, self.kv_heads, "self_attn.k_norm.weight",
                                 block_pos)])
            v = torch.cat([heads(ctx @ w[pre + "self_attn.v_proj.weight"].T, self.kv_heads, None, ctx_pos),
                           heads(h @ w[pre + "self_attn.v_proj.weight"].T, self.kv_heads, None, block_pos)])
            attn = torch.zeros(gamma, self.heads * hd, dtype=torch.float64)
            group = self.heads // self.kv_heads
            for t in range(gamma):
                for j in range(self.heads):
                    kv = j // group
                    scores = torch.stack([q[t, j] @ k[s, kv] for s in range(k.shape[0])]) / math.sqrt(hd)
                    probs = torch.softmax(scores, dim=0)
                    attn[t, j * hd:(j + 1) * hd] = sum(probs[s] * v[s, kv] for s in range(k.shape[0]))
            x = x + attn @ w[pre + "self_attn.o_proj.weight"].T
            m = self.rms(x, w[pre + "post_attention_layernorm.weight"])
            gate, up = m @ w[pre + "mlp.gate_proj.weight"].T, m @ w[pre + "mlp.up_proj.weight"].T
            x = x + (gate * torch.sigmoid(gate) * up) @ w[pre + "mlp.down_proj.weight"].T
        return self.rms(x, w["norm.weight"])

    def draft(self, features, anchor: int, p: int, sampled: list[int] | None = None) -> dict:
        """Greedy drafting (``sampled`` None) or the same chain conditioned on the given sampled tokens."""
        w, gamma = self.w, self.cfg["block_size"]
        h = self.backbone(features, [anchor] + [self.cfg["mask_token_id"]] * (gamma - 1), p)
        base = h @ w["lm_head.weight"].T
        tokens, logits, conf = [], [], []
        prev, state = anchor, torch.zeros(self.cfg["markov_rank"], dtype=torch.float64)
        for k in range(gamma):
            bias = torch.zeros_like(base[k])
            if self.head_type is not None:
                e = w["markov_head.markov_w1.weight"][prev]
                if self.head_type == "vanilla":
                    u = e
                elif self.head_type == "gated":
                    g = torch.sigmoid(w["markov_head.gate_proj.weight"] @ torch.cat([h[k], e])
                                      + w["markov_head.gate_proj.bias"])
                    u = g * e
                else:  # rnn, paper Eq. 6
                    z = (w["markov_head.joint_proj.weight"] @ torch.cat([state, e, h[k]])
                         + w["markov_head.joint_proj.bias"])
                    r = self.cfg["markov_rank"]
                    gate, cand, out = torch.sigmoid(z[:r]), z[r:2 * r], z[2 * r:]
                    state = gate * state + (1 - gate) * torch.tanh(cand)
                    u = torch.tanh(out)
                bias = w["markov_head.markov_w2.weight"] @ u
                conf.append(torch.sigmoid(w["confidence_head.proj.weight"][0] @ torch.cat([h[k], e])
                                          + w["confidence_head.proj.bias"][0]))
            logits.append(base[k] + bias)
            token = int(logits[-1].argmax()) if sampled is None else sampled[k]
            tokens.append(token)
            prev = token
        return {"tokens": tokens, "base": base, "logits": torch.stack(logits),
                "q": torch.softmax(torch.stack(logits), dim=-1),
                "confidence": torch.stack(conf) if conf else None}


# -------------------------------------------------------------------------------------------------------
# The checks
# -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target():
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(FIXTURES / "target", dtype=torch.float32).eval()


def context(target, reference: DeepSpecReference, prompt: list[int]):
    """Raw taps hidden_states[i+1] of the prompt, and the anchor: the target's greedy next token at position p."""
    with torch.no_grad():
        out = target(torch.tensor([prompt]), output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1][0] for i in reference.cfg["target_layer_ids"]], dim=-1)
    return feats, int(out.logits[0, -1].argmax()), len(prompt)


def ours(draft, feats, anchor: int, p: int, **kwargs):
    cache = draft.extend_context(DraftCache(), feats[None], torch.arange(p)[None])
    return draft.draft_block(cache, torch.tensor([anchor]), torch.tensor([p]), **kwargs)


@pytest.mark.parametrize("variant", VARIANTS)
def test_loaded_as_published_drafts_like_deepspec(target, variant):
    reference = DeepSpecReference(FIXTURES / variant)
    draft = DSparkDraftModel.from_pretrained(FIXTURES / variant, target=target)
    assert draft.config.sequential_top_k == 0  # nothing to set: exact by default
    assert draft.config.sequential_head == {"dspark_markov": "markov", "dspark_gated": "gated",
                                            "dspark_rnn": "rnn", "dflash": "none"}[variant]
    vocab = target.config.vocab_size
    for i, prompt in enumerate(PROMPTS):
        feats, anchor, p = context(target, reference, prompt)
        # T = 0: greedy ids, base logits, base + sequential-bias logits, confidences
        greedy = ours(draft, feats, anchor, p, do_sample=False)
        ref = reference.draft(feats, anchor, p)
        assert greedy.tokens[0].tolist() == ref["tokens"], (variant, i)
        torch.testing.assert_close(greedy.base_logits[0].double(), ref["base"], rtol=0, atol=LOGIT_ATOL)
        torch.testing.assert_close(greedy.draft_logits[0].double(), ref["logits"], rtol=0, atol=LOGIT_ATOL)
        if ref["confidence"] is not None:
            torch.testing.assert_close(greedy.confidence[0].double(), ref["confidence"], rtol=0, atol=ATOL)
        # T = 1: q_k on the prefix actually sampled (the q that rejection sampling uses)
        sampled = ours(draft, feats, anchor, p, do_sample=True, generator=torch.Generator().manual_seed(i))
        ref = reference.draft(feats, anchor, p, sampled=sampled.tokens[0].tolist())
        assert sampled.draft_probs.shape[-1] == vocab
        torch.testing.assert_close(sampled.draft_probs[0].double(), ref["q"], rtol=0, atol=ATOL)
        if ref["confidence"] is not None:
            torch.testing.assert_close(sampled.confidence[0].double(), ref["confidence"], rtol=0, atol=ATOL)


def test_the_top_k_cpu_option_is_a_different_proposal(target):
    """Why the default is the full vocabulary: the top-k restriction (64 was the default before) changes q; it is an
    opt-in CPU option, not the reference."""
    reference = DeepSpecReference(FIXTURES / "dspark_markov")
    draft = DSparkDraftModel.from_pretrained(FIXTURES / "dspark_markov", target=target)
    draft.config.sequential_top_k = 64
    feats, anchor, p = context(target, reference, PROMPTS[0])
    sampled = ours(draft, feats, anchor, p, do_sample=True, generator=torch.Generator().manual_seed(0))
    ref = reference.draft(feats, anchor, p, sampled=sampled.tokens[0].tolist())
    assert (sampled.draft_probs[0].double() - ref["q"]).abs().max() > 1e-3
