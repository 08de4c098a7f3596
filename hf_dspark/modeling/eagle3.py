"""Eagle3DraftModel: the autoregressive Eagle3-style baseline (SPEC §2: "1 autoregressive layer fed with
fc(features)"), in the same library, checkpoint format and verification path as the DSpark drafter.

Entry t of the drafter's sequence pairs what is known at position t with the token that follows it:

    input_t = [RMSNorm(embed(x_{t+1})) ; RMSNorm(g_t)]  (2d)  --one decoder layer (causal over entries)-->  o_t
    g_t = fc(target taps at t) for committed positions;  RMSNorm(o_t) --target's LM head--> x_{t+2}

Drafting one round from the anchor x_p (entries < p committed, the last one, p − 1, paired with x_p):
draft 1 comes from o_{p−1}; draft k+1 from a new entry at position p + k − 1 whose feature is the drafter's
own previous output o (the target's feature there is unknown until verification) and whose token is draft k.
So each draft costs one single-token pass, where the block drafter drafts γ tokens in one pass: that is the
difference the baseline exists to measure. Training unrolls the same chain with the data's tokens (teacher
forcing on the tokens, the drafter's own states as features: Eagle3's "training-time test"), and returns
h [N, A, γ, d] in the block drafter's slot convention, so the losses, trainer and evaluation are shared.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .architectures import DrafterArchitecture, register_drafter_architecture
from .draft_cache import DraftCache
from .drafting import DraftBlock, draw_draft_token
from .layers import DraftAttention, DraftMLP, RMSNorm
from .modeling import DSparkDraftModel


class Eagle3Layer(nn.Module):
    """One pre-norm decoder layer reading [embedding ; feature] (2d); the residual stream is the feature."""

    def __init__(self, tcfg, family):
        super().__init__()
        d = tcfg.hidden_size
        self.self_attn = DraftAttention(tcfg, family, input_size=2 * d)
        self.mlp = DraftMLP(tcfg, family)
        self.input_layernorm = RMSNorm(d, tcfg.rms_norm_eps)  # of the token embedding
        self.post_attention_layernorm = RMSNorm(d, tcfg.rms_norm_eps)

    def finish(self, feature: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Residual + o_proj, then the MLP block: the entry's (pre-norm) output o."""
        x = feature + self.self_attn.o_proj(attended)
        return x + self.mlp(self.post_attention_layernorm(x))


def _attend(q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, ctx_mask: torch.Tensor,
            chain_k: torch.Tensor | None = None, chain_v: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of queries over context entries plus, per query, its own chain of draft entries.

    q [B, H, A, hd]; ctx_k/v [B, Hkv, S, hd]; ctx_mask [B, A, S] bool; chain_k/v [B, Hkv, A, j, hd]: the j
    entries only query a attends to (its own earlier draft steps and itself). Returns [B, A, H·hd].
    Why by hand: each query's chain is private (a diagonal, not a shared key set), which SDPA cannot express
    without materialising an [A, A·j] mask per step. GQA groups the query heads of one K/V head instead of
    repeating K/V: the context cache is read as it is, once per draft step."""
    bsz, heads, num_q, head_dim = q.shape
    kv_heads = ctx_k.shape[1]
    scale = 1.0 / math.sqrt(head_dim)
    grouped = q.view(bsz, kv_heads, heads // kv_heads, num_q, head_dim)  # head h reads K/V head h // group
    scores = (grouped @ ctx_k[:, :, None].transpose(-1, -2)).float() * scale  # [B, Hkv, g, A, S]
    has_chain = chain_k is not None and chain_k.shape[3] > 0
    # a query with nothing to attend to (a padding entry) attends everywhere: finite, and never used
    mask = ctx_mask if has_chain else ctx_mask | ~ctx_mask.any(-1, keepdim=True)
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    if has_chain:
        chain_scores = torch.einsum("bkgad,bkajd->bkgaj", grouped, chain_k).float() * scale
        probs = torch.softmax(torch.cat([scores, chain_scores], dim=-1), dim=-1).to(q.dtype)
        ctx_probs, chain_probs = probs[..., : scores.shape[-1]], probs[..., scores.shape[-1]:]
        out = ctx_probs @ ctx_v[:, :, None] + torch.einsum("bkgaj,bkajd->bkgad", chain_probs, chain_v)
    else:
        out = torch.softmax(scores, dim=-1).to(q.dtype) @ ctx_v[:, :, None]
    return out.reshape(bsz, heads, num_q, head_dim).transpose(1, 2).reshape(bsz, num_q, -1)


class Eagle3DraftModel(DSparkDraftModel):
    """Eagle3-style autoregressive drafter (``DSparkConfig(drafter_architecture="eagle3")``); see the module
    docstring. ``from_target`` builds one; ``DSparkDraftModel.from_pretrained`` loads it back as this class."""

    def _build_layers(self, tcfg) -> nn.ModuleList:
        return nn.ModuleList([Eagle3Layer(tcfg, self.layer_family)])

    @classmethod
    def from_target(cls, target, block_size: int = 7, target_layer_ids: list[int] | None = None,
                    draft_vocab=None, **config_kwargs) -> Eagle3DraftModel:
        """A new, randomly initialised Eagle3 drafter for ``target`` (``block_size`` = drafts per round)."""
        return super().from_target(target, num_layers=1, block_size=block_size, head="none",
                                   target_layer_ids=target_layer_ids, use_confidence_head=False,
                                   draft_vocab=draft_vocab, drafter_architecture="eagle3", **config_kwargs)

    def grow_layers(self, num_layers: int):
        raise ValueError("An Eagle3 drafter has exactly one layer.")

    # ---------------------------------------------------------------------------------------------------
    # One entry of the sequence
    # ---------------------------------------------------------------------------------------------------
    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """Raw target taps [.., m·d] -> g [.., d] (normalised inside the layer, like the drafter's own o)."""
        return self.fc(features)

    def _entry_inputs(self, feature: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """feature [.., d] (g or o), next_ids [..] -> the layer's input [.., 2d]."""
        layer = self.layers[0]
        return torch.cat([layer.input_layernorm(self.embed(next_ids)), self.hidden_norm(feature)], dim=-1)

    def _keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[0].self_attn.project_kv(x, *self.rotary_emb(x, positions))

    def _queries(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.layers[0].self_attn.project_q(x, *self.rotary_emb(x, positions))

    def _queries_keys_values(self, feature: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor):
        """feature [B, n, d], next_ids [B, n], positions [B, n] -> q [B,H,n,hd], k, v [B,Hkv,n,hd]."""
        x = self._entry_inputs(feature, next_ids)
        return (self._queries(x, positions), *self._keys_values(x, positions))

    def _outputs_at(self, x: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor, index: torch.Tensor,
                    keys: torch.Tensor, values: torch.Tensor, key_valid: torch.Tensor,
                    key_positions: torch.Tensor) -> torch.Tensor:
        """Outputs o of the entries ``index`` [B, A] only (x / feature / positions [B, n, ..]): each attends to
        the valid keys at positions up to its own. Why: only the newest committed entry of a round (inference)
        or the entry before each anchor (training) is ever read, so the other entries need keys, not outputs."""
        pick = index[..., None]
        x_at = x.gather(1, pick.expand(-1, -1, x.shape[-1]))
        pos_at = positions.gather(1, index)
        mask = key_valid[:, None, :] & (key_positions[:, None, :] <= pos_at[..., None])
        attended = _attend(self._queries(x_at, pos_at), keys, values, mask)
        return self.layers[0].finish(feature.gather(1, pick.expand(-1, -1, feature.shape[-1])), attended)

    # ---------------------------------------------------------------------------------------------------
    # Inference: context and drafting (the interface generate uses for every drafter)
    # ---------------------------------------------------------------------------------------------------
    def extend_context(self, cache: DraftCache, features: torch.Tensor, positions: torch.Tensor,
                       valid: torch.Tensor | None = None, next_ids: torch.Tensor | None = None, *,
                       packed: bool = False, counts=None) -> DraftCache:
        """Append committed positions: features [B, n, m·d], positions [B, n], valid [B, n], and ``next_ids``
        [B, n], the committed token after each position (an entry pairs position t with token t + 1)."""
        if next_ids is None:
            raise ValueError("An Eagle3 drafter needs next_ids (the token after each committed position) in "
                             "extend_context; this caller only provides features.")
        if valid is None:
            valid = torch.ones(positions.shape, dtype=torch.bool, device=positions.device)
        if features.shape[1] == 0:
            return cache
        feature = self.fuse_features(features)
        x = self._entry_inputs(feature, next_ids)
        k, v = self._keys_values(x, positions)
        if cache.num_slots:
            keys, values = torch.cat([cache.keys[0], k], 2), torch.cat([cache.values[0], v], 2)
            key_valid, key_pos = torch.cat([cache.valid, valid], 1), torch.cat([cache.positions, positions], 1)
        else:
            keys, values, key_valid, key_pos = k, v, valid, positions
        # the row's newest committed entry is where its next round starts
        last = torch.where(valid, positions, -1).argmax(dim=1)
        new_tail = self._outputs_at(x, feature, positions, last[:, None], keys, values, key_valid, key_pos)[:, 0]
        new_pos = positions.gather(1, last[:, None])[:, 0]
        has_new = valid.any(dim=1)
        cache.append([k], [v], valid, positions, packed=packed, counts=counts)
        if cache.tail is None:
            cache.tail = torch.where(has_new[:, None], new_tail, torch.zeros_like(new_tail))
            cache.tail_positions = torch.where(has_new, new_pos, torch.full_like(new_pos, -1))
        else:
            cache.tail = torch.where(has_new[:, None], new_tail, cache.tail)
            cache.tail_positions = torch.where(has_new, new_pos, cache.tail_positions)
        return cache

    @torch.no_grad()
    def draft_block(self, cache: DraftCache, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor, *,
                    num_tokens: int | None = None, do_sample: bool = False, logits_processor=None,
                    prefix_ids: torch.Tensor | None = None, generator=None,
                    confidence_threshold: float | None = None, greedy_rows=None, sequential_top_k: int | None = None,
                    early_exit: bool | None = None, context_precedes_anchors: bool = False) -> DraftBlock:
        """Draft up to γ tokens autoregressively (one single-token layer pass each); same contract as
        :meth:`DSparkDraftModel.draft_block`. ``confidence_threshold``, ``greedy_rows``, ``sequential_top_k`` and
        ``early_exit`` are ignored: there is no confidence or sequential head; so is ``context_precedes_anchors``
        (its context is the tail state, checked against the anchors)."""
        # NOTE: the consistency check reads a device value, so it runs where that is free (CPU tensors)
        if cache.tail is None or (anchor_positions.device.type == "cpu"
                                  and not bool((cache.tail_positions == anchor_positions - 1).all())):
            raise ValueError("Eagle3 drafter context is out of step: its last committed entry must be the position "
                             "just before each anchor (extend_context with next_ids after every round).")
        gamma = min(self.config.block_size if num_tokens is None else num_tokens, self.config.block_size)
        bsz = anchor_ids.shape[0]
        layer = self.layers[0]
        ctx_mask = (cache.valid & (cache.positions < anchor_positions[:, None]))[:, None, :]
        feature = cache.tail
        tokens = anchor_ids.new_zeros(bsz, gamma)
        hiddens, all_base, all_logits, all_probs, chain_k, chain_v = [], [], [], [], [], []
        for k in range(gamma):
            hidden = self.norm(feature)
            base = self.compute_draft_logits(hidden).float()
            logits, probs = draw_draft_token(self.to_target_vocab(base), tokens, k, logits_processor, prefix_ids,
                                             do_sample, generator)
            all_probs.append(probs)
            hiddens.append(hidden)
            all_base.append(base)
            all_logits.append(logits)
            if k == gamma - 1:
                break
            q, key, value = self._queries_keys_values(feature[:, None], tokens[:, k:k + 1],
                                                      (anchor_positions + k)[:, None])
            chain_k.append(key)
            chain_v.append(value)
            attended = _attend(q, cache.keys[0], cache.values[0], ctx_mask, torch.stack(chain_k, 3),
                               torch.stack(chain_v, 3))
            feature = layer.finish(feature[:, None], attended)[:, 0]
        return DraftBlock(tokens=tokens, num_drafts=torch.full((bsz,), gamma, dtype=torch.long, device=tokens.device),
                          draft_logits=torch.stack(all_logits, 1),
                          draft_probs=torch.stack(all_probs, 1) if do_sample else None,
                          base_logits=torch.stack(all_base, 1), hidden=torch.stack(hiddens, 1),
                          confidence=None, confidence_logits=None)

    # ---------------------------------------------------------------------------------------------------
    # Training: the chain unrolled for every sampled anchor at once
    # ---------------------------------------------------------------------------------------------------
    def training_hidden(self, features: torch.Tensor, positions: torch.Tensor, context_valid: torch.Tensor,
                        targets, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The unrolled chain for the sampled anchors: it reads the data's tokens (``targets.prev_ids`` and
        ``input_ids``) instead of mask-filled blocks."""
        if input_ids is None:
            raise ValueError("Training an Eagle3 drafter needs the cached input_ids.")
        return self(features, positions, context_valid, targets.anchor_positions, targets.prev_ids, input_ids)

    def forward(self, features: torch.Tensor, positions: torch.Tensor, context_valid: torch.Tensor,
                anchor_positions: torch.Tensor, prev_ids: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """features [N, T, m·d], positions [N, T], context_valid [N, T], anchor_positions [N, A] (≥ 1),
        prev_ids [N, A, γ] (the data's tokens x_{p+k}: slot k's entry is paired with them), input_ids [N, T].

        Returns final-normed h [N, A, γ, d]; slot k predicts the token at p + k + 1, as in the block drafter."""
        n, t = input_ids.shape
        gamma = prev_ids.shape[-1]
        layer = self.layers[0]
        # context entries: g_t with x_{t+1}; the last position has no next token and stays out
        next_ids = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)
        valid = context_valid & torch.cat([context_valid[:, 1:], context_valid.new_zeros(n, 1)], dim=1)
        feature = self.fuse_features(features)
        x = self._entry_inputs(feature, next_ids)
        k, v = self._keys_values(x, positions)
        last = (anchor_positions - 1).clamp(min=0)  # entry p − 1, paired with the anchor x_p
        state = self._outputs_at(x, feature, positions, last, k, v, valid, positions)  # [N, A, d]
        ctx_mask = valid[:, None, :] & (positions[:, None, :] <= positions.gather(1, last)[..., None])
        hiddens, chain_k, chain_v = [self.norm(state)], [], []
        for step in range(1, gamma):
            q, key, value = self._queries_keys_values(state, prev_ids[..., step], anchor_positions + step - 1)
            chain_k.append(key)
            chain_v.append(value)
            attended = _attend(q, k, v, ctx_mask, torch.stack(chain_k, 3), torch.stack(chain_v, 3))
            state = layer.finish(state, attended)
            hiddens.append(self.norm(state))
        return torch.stack(hiddens, dim=2)


register_drafter_architecture(DrafterArchitecture("eagle3", Eagle3DraftModel, servable=True,
                                                  exports_to_speculators=False, autoregressive=True, label="Eagle3",
                                                  baseline_loss=True))
