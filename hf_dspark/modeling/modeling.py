"""DSparkDraftModel: a parallel block drafter with KV injection of target features + a sequential head.

Data flow of one drafting round (SPEC §2):

    target taps [B, n, m·d] --fc--> RMSNorm --> H_ctx --k/v_proj per layer--> DraftCache (context K/V only)
    block = [anchor, MASK × (γ-1)] at positions p..p+γ-1 --embed (target's, frozen)--> backbone layers
        (queries: block only; keys: cached context at positions < p, plus the whole block, bidirectional)
    --> RMSNorm --> target's LM head --> base logits U_k
    sequential head, left to right: logits_k = U_k + W2·u_k(x_{k-1}, h_k);  x_k ~ q_k = softmax(processed)
    confidence head: c_k = σ(w·[h_k ; W1[x_{k-1}]] + b)

The target's embedding and LM head are used by reference (never registered as our parameters, never saved in
our checkpoints, never given gradients); :meth:`DSparkDraftModel.bind_target` attaches them.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, PreTrainedModel

from ..cpu_kernels import SKINNY_KERNEL, linear_kernel, skinny_linear
from .architectures import (
    NO_SEQUENTIAL_HEAD,
    DrafterArchitecture,
    has_sequential_head,
    raise_if_built_by_another_class,
    register_drafter_architecture,
)
from .checkpoint_files import remove_stale_weights
from .checkpoint_loading import from_pretrained_any_dialect
from .configuration import DSparkConfig
from .draft_cache import ContextUpdate, DraftCache
from .drafting import DraftBlock, calibrated_confidence, draft_block
from .families import PORTABLE_LAYER_STYLE, get_target_family, layer_family, soft_cap_logits
from .heads import SEQUENTIAL_HEAD_CLASSES, ConfidenceHead
from .layers import DraftDecoderLayer, RMSNorm
from .publishing import hub_uploader
from .target_compatibility import (
    embedding_signature,
    raise_if_target_mismatch,
    target_compute_dtype,
    warn_if_logits_depend_on_chunking,
)

logger = logging.getLogger(__name__)


# save_pretrained keywords that only matter with push_to_hub=True (hub.push_to_hub's upload options)
_PUSH_ONLY_OPTIONS = ("commit_message", "commit_description", "private", "create_pr", "revision", "tags")

# Callables run with the target whenever a drafter is bound to it (layers above modeling register here, so
# modeling never imports them).
TARGET_BIND_HOOKS: list = []


class DSparkDraftModel(PreTrainedModel):
    """DSpark drafter (``sequential_head="none"`` gives the DFlash baseline). See the module docstring."""

    config_class = DSparkConfig
    base_model_prefix = "dspark"
    main_input_name = "anchor_ids"
    _no_split_modules = ["DraftDecoderLayer"]
    _supports_sdpa = True

    def __init__(self, config: DSparkConfig):
        raise_if_built_by_another_class(type(self), config)
        super().__init__(config)
        self.family = get_target_family(config.target_family)
        self.layer_family = layer_family(getattr(config, "draft_layer_style", "target"), self.family)
        tcfg = self.target_text_config = AutoConfig.for_model(**config.target_config)
        d = config.target_hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, tcfg.rms_norm_eps)
        self.layers = self._build_layers(tcfg)
        self.norm = RMSNorm(d, tcfg.rms_norm_eps)
        self.rotary_emb = self.family.rotary_embedding(tcfg)
        vocab = tcfg.vocab_size
        self.markov_head = (SEQUENTIAL_HEAD_CLASSES[config.sequential_head](d, vocab, config.markov_rank,
                                                                           config.num_draft_tokens)
                            if has_sequential_head(config) else None)
        if config.draft_vocab_size is not None:
            # draft index -> target token id (ascending); saved with the drafter. set_draft_vocabulary fills it.
            self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size), persistent=True)
        else:
            self.draft_to_target = None
        self._draft_head_cache: tuple | None = None
        self.confidence_head = ConfidenceHead(d + config.markov_rank) if config.use_confidence_head else None
        self._bound_target: list[nn.Module] = []  # a list, so the target is not registered as a submodule
        self.post_init()

    def _build_layers(self, tcfg) -> nn.ModuleList:
        return nn.ModuleList(DraftDecoderLayer(tcfg, self.layer_family)
                             for _ in range(self.config.num_hidden_layers))

    def _init_weights(self, module: nn.Module) -> None:
        std = 0.02
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif module is self and getattr(self, "draft_to_target", None) is not None:
            with torch.no_grad():  # placeholder ids; set_draft_vocabulary or the checkpoint provides the real ones
                self.draft_to_target.copy_(torch.arange(self.config.draft_vocab_size))
            super()._init_weights(module)
        else:
            # NOTE: transformers builds models on the meta device and restores non-persistent buffers here; without
            # this the rotary inv_freq of a from_pretrained drafter is uninitialised memory.
            super()._init_weights(module)

    # ---------------------------------------------------------------------------------------------------
    # Binding to a target
    # ---------------------------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target, num_layers: int = 1, block_size: int = 7, head: str = "markov",
                    markov_rank: int = 256, target_layer_ids: list[int] | None = None,
                    mask_token_id: int | None = None, use_confidence_head: bool | None = None,
                    draft_vocab: Sequence[int] | torch.Tensor | None = None,
                    draft_layer_style: str = PORTABLE_LAYER_STYLE,
                    **config_kwargs) -> "DSparkDraftModel":
        """A new, randomly initialised drafter shaped for ``target`` and bound to it.

        ``draft_layer_style``: Qwen3-style layers by default, for any target, so the drafter exports to
        speculators / vLLM; ``"target"`` copies the target family's layer instead (see ``DSparkConfig``).

        ``draft_vocab``: target token ids the drafter may propose (see ``DSparkConfig.draft_vocab_size``);
        ``None`` = all of them. :func:`hf_dspark.training.draft_vocabulary.most_frequent_tokens` picks them.
        """
        if draft_vocab is not None:
            config_kwargs["draft_vocab_size"] = len(draft_vocab)
        tcfg = target.config.get_text_config()
        config = DSparkConfig(
            target_config=tcfg.to_dict(), num_hidden_layers=num_layers, block_size=block_size,
            sequential_head=head, markov_rank=markov_rank, target_layer_ids=target_layer_ids,
            mask_token_id=mask_token_id,
            use_confidence_head=(head != NO_SEQUENTIAL_HEAD) if use_confidence_head is None else use_confidence_head,
            target_name_or_path=getattr(target, "name_or_path", None) or tcfg.name_or_path or None,
            target_embedding_signature=embedding_signature(target), draft_layer_style=draft_layer_style,
            **config_kwargs)
        param = next(target.parameters())
        model = cls(config)._cast_to(param.dtype, param.device)
        model._init_final_norm_from(target)
        if draft_vocab is not None:
            model.set_draft_vocabulary(draft_vocab)
        return model.bind_target(target)

    @torch.no_grad()
    def set_draft_vocabulary(self, token_ids: Sequence[int] | torch.Tensor) -> None:
        """Set the target ids of the draft vocabulary (unique, within the target vocabulary; stored sorted)."""
        if self.draft_to_target is None:
            raise ValueError("This drafter predicts the full target vocabulary (draft_vocab_size=None).")
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().sort().values
        vocab = self.config.target_config["vocab_size"]
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"Got {ids.numel()} draft token ids for draft_vocab_size={self.config.draft_vocab_size}.")
        if ids.numel() and (ids[0] < 0 or ids[-1] >= vocab or bool((ids[1:] == ids[:-1]).any())):
            raise ValueError(f"Draft token ids must be unique and within [0, {vocab}).")
        self.draft_to_target.copy_(ids.to(self.draft_to_target.device))
        self._draft_head_cache = None

    @torch.no_grad()
    def grow_layers(self, num_layers: int) -> "DSparkDraftModel":
        """Deepen a trained drafter to ``num_layers`` without changing what it computes.

        Each new layer is a copy of the current last layer whose output projections (attention ``o_proj`` and MLP
        ``down_proj``) are zeroed, so its residual contribution starts at exactly zero: the grown drafter proposes
        what the trained one did and training continues from there instead of from scratch. Gradients reach the
        zeroed projections at once (their inputs are the copied layer's activations) and the rest of the new
        layer as soon as those move. Why: on a CPU budget a deeper drafter trained from scratch cannot catch up
        with a shallow one that has already seen thousands of steps.
        """
        current = len(self.layers)
        if num_layers < current:
            raise ValueError(f"Cannot shrink a drafter from {current} to {num_layers} layers.")
        for _ in range(num_layers - current):
            layer = copy.deepcopy(self.layers[-1])
            for projection in (layer.self_attn.o_proj, layer.mlp.down_proj):
                projection.weight.zero_()
                if projection.bias is not None:
                    projection.bias.zero_()
            self.layers.append(layer)
        self.config.num_hidden_layers = num_layers
        return self

    @torch.no_grad()
    def _init_final_norm_from(self, target) -> None:
        """Start the final norm from the target's: h then reaches the frozen LM head at the scale it was trained
        for, so short (CPU) training runs do not spend their first steps rediscovering that scale."""
        target_norm = getattr(target.get_decoder(), "norm", None) if hasattr(target, "get_decoder") else None
        weight = getattr(target_norm, "weight", None)
        if weight is not None and weight.shape == self.norm.weight.shape:
            self.norm.weight.copy_(weight.detach().to(self.norm.weight.dtype))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, target=None, **kwargs):
        """Load our format or any published dialect (DeepSpec, speculators, SpecForge / z-lab) and bind ``target``."""
        return from_pretrained_any_dialect(cls, pretrained_model_name_or_path, *args, target=target, **kwargs)

    @classmethod
    def _from_pretrained_native(cls, path, *args, **kwargs) -> "DSparkDraftModel":
        return super().from_pretrained(path, *args, **kwargs)

    def save_pretrained(self, save_directory, *args, push_to_hub: bool = False, **kwargs) -> None:
        """transformers' ``save_pretrained``, minus the weights of an earlier save in the other layout (single file /
        sharded) that it leaves in the folder: :meth:`from_pretrained` refuses such a folder as ambiguous, and
        transformers' own loader would read the older single file.

        ``push_to_hub=True`` (with ``repo_id``, default the folder's name, and the upload options) uploads through
        :meth:`push_to_hub`, with the generated model card, not through transformers' upload and generic card.
        """
        upload = {key: kwargs.pop(key) for key in _PUSH_ONLY_OPTIONS if push_to_hub and key in kwargs}
        repo_id = kwargs.pop("repo_id", None) if push_to_hub else None
        upload.update({key: kwargs[key] for key in ("max_shard_size", "token") if push_to_hub and key in kwargs})
        super().save_pretrained(save_directory, *args, **kwargs)
        is_main_process = args[0] if args else kwargs.get("is_main_process", True)
        if is_main_process and Path(save_directory).is_dir():
            remove_stale_weights(Path(save_directory))
        if push_to_hub and is_main_process:
            self.push_to_hub(repo_id or Path(save_directory).name, **upload)

    def push_to_hub(self, repo_id: str, **kwargs):
        """Upload config, safetensors and a generated model card (README.md); see ``hf_dspark.hub.push_to_hub``.

        Replaces transformers' version, which would write a generic card over ours. The uploader is the one
        ``hf_dspark.hub`` registers (``modeling/publishing.py`` says why it is not imported here).
        """
        return hub_uploader()(self, repo_id, **kwargs)

    def bind_target(self, target) -> "DSparkDraftModel":
        """Use ``target``'s embedding and LM head (by reference, frozen); refuse a target we do not fit.

        The drafter is cast (in place, one INFO line) to the dtype and device of the target's embedding: it
        multiplies its states with the target's embedding and LM head, so any other dtype fails inside a matmul.
        Also runs the registered bind hooks; ``hf_dspark.generation`` registers one that makes the stock
        ``target.generate(..., assistant_model=draft)`` use speculative decoding.
        """
        raise_if_target_mismatch(self.config, target)
        warn_if_logits_depend_on_chunking(target)
        # transformers' pipeline compares these with the target's to decide whether the assistant shares its
        # tokenizer (it always does): ids saved from the training target's config refused a drafter bound to the
        # same weights under another config ("pass the assistant tokenizer").
        text_config = target.config.get_text_config()
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            setattr(self.config, key, getattr(text_config, key, None))
        dtype, device = target_compute_dtype(target), target.get_input_embeddings().weight.device
        current = {(p.dtype, p.device) for p in self.parameters() if p.is_floating_point()}
        cast = ""
        if current and current != {(dtype, device)}:
            cast = "; cast from " + ", ".join(sorted(f"{d} on {dev}" for d, dev in current))
            self._cast_to(dtype, device)
            self._draft_head_cache = None
        elif any(buffer.dtype != torch.float32 for buffer in self.rotary_emb.buffers()):
            self._cast_to(dtype, device)  # cast by hand (draft.to(torch.bfloat16)): RoPE back to float32
        logger.info("Drafter bound to %s target %s (%s on %s%s).", type(target).__name__,
                    getattr(target, "name_or_path", "") or "(unnamed)", dtype, device, cast)
        self._bound_target[:] = [target]
        for hook in TARGET_BIND_HOOKS:
            hook(target)
        return self

    def _cast_to(self, dtype: torch.dtype, device: torch.device | str | None = None) -> "DSparkDraftModel":
        """``self.to(device, dtype)`` with RoPE's inverse frequencies kept in float32, as transformers'
        ``from_pretrained(dtype=)`` keeps them (and DeepSpec and vLLM compute them).

        Why: ``nn.Module.to(dtype)`` rounds the rotary ``inv_freq`` buffers too; in bf16 that moves a context row's
        RoPE phase by ~2 rad at position 2048 (Qwen3's 128-dim heads), so the drafter would attend to its context
        unlike the drafter it was trained as. The rotary module is rebuilt from the config, so an earlier
        rounding is undone as well.
        """
        self.to(device=device, dtype=dtype)
        self.rotary_emb = self.family.rotary_embedding(self.target_text_config).to(device=self.fc.weight.device)
        return self

    @property
    def generation_config(self):
        """Refuse transformers' classic-assistant path with the fix, instead of its AttributeError.

        transformers reads ``assistant_model.generation_config`` only when it is about to run a drafter as a
        small autoregressive LM, which a DSpark drafter is not: it needs the target's hidden states, so it
        runs only through the generate hook that binding installs on the target.
        """
        bound = "not bound to a target" if not self._bound_target else (
            "bound to a target whose generate() does not route to hf-dspark (another model, or after "
            "hf_dspark.disable(target))")
        raise ValueError(f"This DSpark drafter is {bound}. Call draft.bind_target(target) (or load it with "
                         "DSparkDraftModel.from_pretrained(path, target=target)) before "
                         "target.generate(..., assistant_model=draft).")

    @property
    def target(self):
        if not self._bound_target:
            raise RuntimeError("This drafter is not bound to a target: use DSparkDraftModel.from_pretrained(path, "
                               "target=target) or draft.bind_target(target).")
        return self._bound_target[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        weight = self.target.get_input_embeddings().weight.detach()
        scale = self.family.embed_scale(self.target_text_config)
        embedded = F.embedding(ids, weight)
        return embedded if scale == 1.0 else embedded * scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's frozen LM head (and logit soft-cap, for families that have one): full-vocabulary logits."""
        return self._soft_cap(self._linear(hidden, self.target.get_output_embeddings().weight.detach()))

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [..., V'] (the LM head's rows ``draft_to_target``; all rows if full)."""
        if self.draft_to_target is None:
            return self.compute_logits(hidden)
        return self._soft_cap(self._linear(hidden, self._draft_lm_head()))

    def _linear(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The shared head's product with the kernel the target's linears run with right now (inside hf-dspark's
        loop on a CPU fp32 target: ``cpu_kernels.skinny_linear``; elsewhere ``F.linear``)."""
        if linear_kernel(self.target).startswith(SKINNY_KERNEL):
            return skinny_linear(hidden, weight)
        return F.linear(hidden, weight)

    def to_target_vocab(self, draft_logits: torch.Tensor, draft_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Draft-space logits [..., K] -> target-vocabulary logits [..., V], -inf where the drafter has no mass.

        ``draft_ids`` [..., K] names the draft indices of the last dim (default: the whole draft vocabulary).
        Identity for a full-vocabulary drafter called without ``draft_ids``.
        """
        if self.draft_to_target is None and draft_ids is None:
            return draft_logits
        vocab = self.config.target_config["vocab_size"]
        if draft_ids is None:
            target_ids = self.draft_to_target.expand(*draft_logits.shape[:-1], -1)
        else:
            target_ids = draft_ids if self.draft_to_target is None else self.draft_to_target[draft_ids]
        full = draft_logits.new_full((*draft_logits.shape[:-1], vocab), float("-inf"))
        return full.scatter(-1, target_ids, draft_logits)

    def target_to_draft_ids(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids -> draft indices (-1 for tokens outside the draft vocabulary)."""
        if self.draft_to_target is None:
            return token_ids
        vocab = self.config.target_config["vocab_size"]
        lookup = torch.full((vocab,), -1, dtype=torch.long, device=token_ids.device)
        lookup[self.draft_to_target.to(token_ids.device)] = torch.arange(self.config.draft_vocab_size,
                                                                          device=token_ids.device)
        return lookup[token_ids]

    def _draft_lm_head(self) -> torch.Tensor:
        """The LM head's draft rows, sliced once per (target weight, dtype, device) rather than per call."""
        weight = self.target.get_output_embeddings().weight.detach()
        key = (weight.data_ptr(), weight.dtype, weight.device, weight._version, self.draft_to_target._version,
               self.draft_to_target.device)
        if self._draft_head_cache is None or self._draft_head_cache[0] != key:
            self._draft_head_cache = (key, weight.index_select(0, self.draft_to_target.to(weight.device)))
        return self._draft_head_cache[1]

    def _soft_cap(self, logits: torch.Tensor) -> torch.Tensor:
        return soft_cap_logits(logits, self.family.logit_softcap(self.target_text_config))

    # ---------------------------------------------------------------------------------------------------
    # Backbone
    # ---------------------------------------------------------------------------------------------------
    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated raw target-layer outputs [.., m·d] -> H_ctx [.., d]."""
        return self.hidden_norm(self.fc(features))

    def extend_context(self, cache: DraftCache, features: torch.Tensor, positions: torch.Tensor,
                       valid: torch.Tensor | None = None, next_ids: torch.Tensor | None = None, *,
                       packed: bool = False, counts: Sequence[int] | None = None) -> DraftCache:
        """Append committed positions to the drafter cache.

        features [B, n, m·d] (raw taps, ascending layer order), positions [B, n] absolute positions,
        valid [B, n] (False for padding / rejected slots). ``next_ids`` [B, n] (the committed token after each
        position) is what an autoregressive drafter pairs each position with; the block drafter does not need it.
        ``packed`` / ``counts``: see :meth:`DraftCache.append` (the speculative round packs: no holes).
        """
        if valid is None:
            valid = torch.ones(positions.shape, dtype=torch.bool, device=positions.device)
        if features.shape[1] == 0:
            return cache
        ctx = self.fuse_features(features)
        cos, sin = self.rotary_emb(ctx, positions)
        kv = [layer.self_attn.project_kv(ctx, cos, sin) for layer in self.layers]
        cache.append([k for k, _ in kv], [v for _, v in kv], valid, positions, packed=packed, counts=counts)
        return cache

    def _run_layers(self, x, cos, sin, ctx_keys, ctx_values, mask, new_context=None, new_kv=None) -> torch.Tensor:
        for layer, ctx_k, ctx_v in zip(self.layers, ctx_keys, ctx_values):
            x = layer(x, cos, sin, ctx_k, ctx_v, mask, new_context, new_kv)
        return self.norm(x)

    def forward_block(self, cache: DraftCache, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor, *,
                      context_precedes_anchors: bool = False,
                      new_context: ContextUpdate | None = None) -> torch.Tensor:
        """Final-normed hidden states [B, block_size, d] of the predicting slots of the block [anchor, MASK, ...].

        The backbone runs ``block_size + num_unpredicted_slots`` slots at positions p, p+1, ...; the leading
        ``num_unpredicted_slots`` (upstream DFlash: the anchor slot) are dropped, so row k is always the state
        that drafts token p+k+1. ``context_precedes_anchors``: the caller guarantees every cached position lies
        before its row's anchor (the speculative round's cache holds exactly the committed context); with a
        dense cache the attention mask is then all-True and is not built (SDPA's unmasked path).

        ``new_context``: committed positions (before the anchors) that are not cached yet. They are projected
        in this pass, each layer's keys/values of [context ; block] in one projection (DFlash's reference does
        the same), attended like cached context, and appended to ``cache`` (packed) afterwards: the same
        states as :meth:`extend_context` followed by this method, in about half the ops."""
        lead = getattr(self.config, "num_unpredicted_slots", 0)
        bsz, gamma = anchor_ids.shape[0], self.config.block_size + lead
        block_ids = anchor_ids.new_full((bsz, gamma), self.config.mask_token_id)
        block_ids[:, 0] = anchor_ids
        positions = anchor_positions[:, None] + torch.arange(gamma, device=anchor_ids.device)
        x = self.embed(block_ids)
        fresh = new_context is not None and new_context.num_slots > 0
        ctx = self.fuse_features(new_context.features) if fresh else None
        cos, sin = self.rotary_emb(x, torch.cat([new_context.positions, positions], dim=1) if fresh else positions)
        if cache.num_slots:
            keys, values = cache.keys, cache.values
        else:
            empty = x.new_zeros(bsz, self.layers[0].self_attn.num_kv_heads, 0, self.config.head_dim)
            keys = values = [empty] * len(self.layers)
        mask = None  # every key visible to every query: the block is bidirectional, the context all before it
        cached_unmasked = not cache.num_slots or (context_precedes_anchors and cache.is_dense)
        if not cached_unmasked or (fresh and not new_context.all_valid):
            # strictly before the anchor: the anchor's own target state does not exist yet
            parts = [cache.valid & (cache.positions < anchor_positions[:, None])] if cache.num_slots else []
            if fresh:
                parts.append(new_context.valid & (new_context.positions < anchor_positions[:, None]))
            ctx_mask = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
            block_mask = torch.ones(bsz, gamma, gamma, dtype=torch.bool, device=x.device)
            mask = torch.cat([ctx_mask[:, None, :].expand(bsz, gamma, -1), block_mask], dim=-1)[:, None]
        new_kv: list = []
        hidden = self._run_layers(x, cos, sin, keys, values, mask, ctx, new_kv if fresh else None)
        if fresh:
            cache.append([k for k, _ in new_kv], [v for _, v in new_kv], new_context.valid, new_context.positions,
                         packed=True, counts=new_context.counts)
        return hidden[:, lead:]

    def training_hidden(self, features: torch.Tensor, positions: torch.Tensor, context_valid: torch.Tensor,
                        targets, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """h [N, A, γ, d] of the sampled blocks (``targets``: training.anchors.BlockTargets); each drafter
        architecture reads what it needs from them (this one: the anchor + mask-filled block ids)."""
        return self(features, positions, context_valid, targets.anchor_positions, targets.block_ids)

    def forward(self, features: torch.Tensor, positions: torch.Tensor, context_valid: torch.Tensor,
                anchor_positions: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """Training forward: many blocks per sequence in one pass.

        features [N, T, m·d], positions [N, T], context_valid [N, T] bool, anchor_positions [N, A],
        block_ids [N, A, γ] (anchor then mask ids). Block a sees context rows at positions < its anchor and
        its own γ slots (bidirectional), never other blocks. Returns h [N, A, γ, d]. With
        ``num_unpredicted_slots`` (upstream DFlash), that many mask slots are inserted after each anchor and their
        outputs dropped, as in :meth:`forward_block`.
        """
        lead = getattr(self.config, "num_unpredicted_slots", 0)
        if lead:
            masks = block_ids.new_full((*block_ids.shape[:2], lead), self.config.mask_token_id)
            block_ids = torch.cat([block_ids[..., :1], masks, block_ids[..., 1:]], dim=-1)
        n, num_blocks, gamma = block_ids.shape
        ctx = self.fuse_features(features)
        cos_c, sin_c = self.rotary_emb(ctx, positions)
        block_pos = (anchor_positions[..., None] + torch.arange(gamma, device=block_ids.device)).view(n, -1)
        x = self.embed(block_ids.view(n, -1))
        cos_b, sin_b = self.rotary_emb(x, block_pos)
        ctx_mask = context_valid[:, None, :] & (positions[:, None, :] < anchor_positions.repeat_interleave(gamma, 1)[..., None])
        block_of = torch.arange(num_blocks, device=x.device).repeat_interleave(gamma)
        block_mask = (block_of[:, None] == block_of[None, :]).expand(n, -1, -1)
        mask = torch.cat([ctx_mask, block_mask], dim=-1)[:, None]
        keys, values = zip(*(layer.self_attn.project_kv(ctx, cos_c, sin_c) for layer in self.layers))
        h = self._run_layers(x, cos_b, sin_b, keys, values, mask)
        return h.view(n, num_blocks, gamma, -1)[:, :, lead:]

    # ---------------------------------------------------------------------------------------------------
    # Sequential sampling: the drafting primitive shared by generate, the engine, training eval and evaluation
    # ---------------------------------------------------------------------------------------------------
    def confidence_from_logits(self, logits: torch.Tensor, first_position: int = 0,
                               greedy: bool | torch.Tensor = False) -> torch.Tensor:
        """Calibrated c_k = σ(z_k / T_k + b_k) (T_k, b_k from STS; 1 and 0 when uncalibrated). logits [..., n] hold
        positions ``first_position`` .. ``first_position + n - 1``. ``greedy`` picks the greedy fit
        (``DSparkConfig.calibration_for``): a bool for all rows, or a bool tensor over the leading (row) dim."""
        return calibrated_confidence(self, logits, first_position, greedy)

    def draft_block(self, cache: DraftCache, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor, *,
                    num_tokens: int | None = None, do_sample: bool = False, logits_processor=None,
                    prefix_ids: torch.Tensor | None = None,
                    generator: torch.Generator | Sequence[torch.Generator] | None = None,
                    confidence_threshold: float | None = None, greedy_rows: torch.Tensor | Sequence[bool] | None = None,
                    sequential_top_k: int | None = None, early_exit: bool | None = None,
                    context_precedes_anchors: bool = False, new_context: ContextUpdate | None = None) -> DraftBlock:
        """Draft one block for every row: the primitive behind generate, the engine and the evaluation.

        anchor_ids [B] (last committed token), anchor_positions [B]; the cache must already hold the context
        (committed positions < anchor). ``logits_processor`` (transformers' list, incl. temperature/top-k/top-p
        warpers when sampling) is applied to slot k's logits with input ids ``prefix_ids + drafts[:k]``, exactly
        as the target's logits are processed at verification, so p and q see the same processors.
        ``generator`` may be a sequence with one generator per row (the serving engine's per-request streams).
        ``greedy_rows`` [B] says which rows decode greedily (their confidences use the greedy calibration);
        default: every row when ``do_sample`` is False, none otherwise. ``confidence_threshold`` (default: the
        config's) lets drafting stop at each row's first slot with a calibrated confidence below it
        (``early_exit``: default on CPU only, see ``modeling/drafting.py``). ``sequential_top_k`` overrides the
        config's support restriction of the sequential bias (0 = full vocabulary, the reference behaviour).
        ``context_precedes_anchors`` and ``new_context`` (committed context projected in the same pass and
        appended to ``cache``): see :meth:`forward_block` (the speculative round sets both).
        """
        return draft_block(self, cache, anchor_ids, anchor_positions, num_tokens=num_tokens, do_sample=do_sample,
                           logits_processor=logits_processor, prefix_ids=prefix_ids, generator=generator,
                           confidence_threshold=confidence_threshold, greedy_rows=greedy_rows,
                           sequential_top_k=sequential_top_k, early_exit=early_exit,
                           context_precedes_anchors=context_precedes_anchors, new_context=new_context)


register_drafter_architecture(DrafterArchitecture("block", DSparkDraftModel, servable=True,
                                                  exports_to_speculators=True, fuses_context=True))
