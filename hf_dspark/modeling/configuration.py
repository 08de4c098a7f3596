"""DSparkConfig: everything needed to rebuild a drafter and to check that it fits a target."""

from __future__ import annotations

import logging
import math
from typing import Any

from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

# Keys of a target's text config that a drafter never needs (big, or meaningless for a drafter).
_DROPPED_TARGET_KEYS = ("architectures", "auto_map", "quantization_config", "transformers_version", "_name_or_path",
                        "id2label", "label2id", "task_specific_params", "torch_dtype", "dtype", "output_attentions",
                        "output_hidden_states", "return_dict", "chunk_size_feed_forward", "problem_type")


def default_target_layer_ids(num_target_layers: int, num_taps: int = 5) -> list[int]:
    """A spread of decoder layers from layer 1 to L-3, like DeepSpec's [1, 9, 17, 25, 33] for 36 layers.

    The last layer is never tapped: transformers returns it after the final norm, not raw.
    """
    if num_target_layers < 2:
        return [0]
    low, high = 1, max(1, num_target_layers - 3)
    num_taps = max(1, min(num_taps, high - low + 1))
    if num_taps == 1:
        return [low]
    return sorted({round(low + i * (high - low) / (num_taps - 1)) for i in range(num_taps)})


# Target-config keys every drafter reads (layers, embedding width, vocabulary); without one the model cannot be built.
_REQUIRED_TARGET_KEYS = ("model_type", "hidden_size", "num_attention_heads", "vocab_size")
# Integer fields (None allowed for the optional ones): a "7" or 7.5 from a hand-edited config.json must not reach
# the model, where it fails deep inside (or, for a float, drafts with a fractional block).
_INT_FIELDS = ("num_hidden_layers", "block_size", "markov_rank", "sequential_top_k", "num_unpredicted_slots")
_OPTIONAL_INT_FIELDS = ("mask_token_id", "draft_vocab_size", "num_target_layers")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# Per-position float lists (None allowed), and whether their entries must be > 0 (temperatures divide).
_FLOAT_LIST_FIELDS = (("confidence_temperatures", True), ("confidence_offsets", False),
                      ("greedy_confidence_temperatures", True), ("greedy_confidence_offsets", False),
                      ("target_embedding_signature", False))


def _version() -> str:
    from ..version import __version__

    return __version__


class DSparkConfig(PretrainedConfig):
    r"""Configuration of a DSpark (or DFlash, with ``sequential_head="none"``) block drafter.

    Args:
        target_config (`dict`, defaults to `None`):
            The target's text config as a dict. The backbone layers copy its shapes (hidden size, heads, head
            dim, MLP width, RoPE, norms) and its family (`target_config["model_type"]`).
        num_hidden_layers (`int`, defaults to 1): parallel backbone layers (published: 5; 1–2 on CPU).
        target_layer_ids (`list[int]`, defaults to a spread): 0-based target decoder layers whose raw outputs
            are fused into the context features.
        block_size (`int`, defaults to 7): draft tokens per round γ (verify width γ+1).
        mask_token_id (`int`, defaults to `vocab_size - 1`): token filling the γ-1 non-anchor block slots.
        sequential_head (`str`, defaults to `"markov"`): `"markov"`, `"gated"`, `"rnn"` or `"none"` (DFlash).
        markov_rank (`int`, defaults to 256): rank r of the W1 (V×r) / W2 (r×V) factorisation.
        use_confidence_head (`bool`, defaults to `True`): predict c_k = P(slot k accepted | slots < k accepted).
        confidence_temperatures (`list[float]`, defaults to `None`): per-position STS temperatures; `None` = 1.
        confidence_offsets (`list[float]`, defaults to `None`): per-position offsets b_k added after the
            temperature, c_k = σ(z_k / T_k + b_k) (our STS extension, see `training.calibration`); `None` = 0.
        greedy_confidence_temperatures (`list[float]`, defaults to `None`): STS temperatures fitted on *greedy*
            rounds, used when decoding greedily; `None` = use `confidence_temperatures` (and offsets) there too.
            Why separate: greedy matching accepts a draft iff it is the target's argmax, rejection sampling at
            T = 1 with probability min(1, p/q); the two acceptance rates differ, so one fit cannot be calibrated
            for both.
            `confidence_temperatures` / `confidence_offsets` are then the sampling fit.
        greedy_confidence_offsets (`list[float]`, defaults to `None`): offsets of the greedy fit.
        confidence_threshold (`float`, defaults to 0.0): static threshold: drafts stop at the first slot whose
            calibrated confidence is below it (0 = always draft the whole block).
        sequential_top_k (`int`, defaults to 0): `0` (the default) evaluates the sequential bias B_k over the
            whole (draft) vocabulary, exactly as DeepSpec, speculators and vLLM draft and as every drafter is
            trained: a published drafter proposes from the q its authors evaluated. `k > 0` is an explicit CPU
            speed option: B_k is evaluated only on the top-k tokens of the base logits U_k and q_k is defined on
            that support (the rest gets probability 0). Still lossless (q is what drafts are sampled from and
            what verification uses) and ~V/k times cheaper than the full V×r product, but it is a different
            proposal distribution: at T = 1 it drops the mass the bias would have lifted from outside the base
            top-k, and at T = 0 the argmax can differ whenever the bias lifts a token from outside it, so τ can
            change. Every foreign-format loader gives 0; our own checkpoints keep the value they record.
        num_unpredicted_slots (`int`, defaults to 0): leading slots of the backbone block whose outputs are not
            drafts. `0` is the DeepSpec / DSpark convention: the block is [anchor, MASK × (γ-1)] and every slot
            predicts (slot k, at position p+k, drafts token p+k+1). `1` is upstream DFlash (z-lab, SpecForge's
            DFlash, transformers' DFlash assistants, speculators `sample_from_anchor=false`): the block is
            [anchor, MASK × γ] and only the mask slots predict, each the token at its own position. Either
            way `block_size` counts the drafts per round; the backbone runs `block_size + num_unpredicted_slots`
            slots.
        draft_vocab_size (`int`, defaults to `None`): the drafter proposes only this many target tokens (the
            most frequent ones in its training data; ids in the `draft_to_target` buffer). The drafter's LM head
            (a row slice of the target's) and W2 shrink V/V' times, which dominates drafting and training cost on
            CPU. Lossless: q is 0 outside the draft vocabulary and verification handles that. `None` = the full
            target vocabulary.
        target_name_or_path (`str`): the target this drafter was built for (informational; checked softly).
        target_embedding_signature (`list[float]`): norms of a few target embedding rows, used to refuse a
            different target with identical shapes.
        draft_layer_style (`str`, defaults to `"target"`): which layer the backbone builds with the target's
            shapes. `"qwen3"` (what `DSparkDraftModel.from_target` gives new drafters): per-head q/k RMSNorm,
            one `attention_bias` for q/k/v/o, no MLP bias, the layer speculators and vLLM build for every DSpark /
            DFlash drafter, so the drafter exports whatever its target's family. `"target"`: the target family's
            own layer (drafters saved before this field existed; their configs load with it).
        drafter_architecture (`str`, defaults to `"block"`): `"block"` (DSpark / DFlash) or `"eagle3"`, the
            Eagle3-style baseline: one autoregressive layer over [fc(target features) ; next-token embedding]
            that drafts one token per pass (`Eagle3DraftModel`; no sequential or confidence head, 1 layer).
    """

    model_type = "dspark_drafter"

    def __init__(
        self,
        target_config: dict[str, Any] | None = None,
        num_hidden_layers: int = 1,
        target_layer_ids: list[int] | None = None,
        num_target_layers: int | None = None,
        block_size: int = 7,
        mask_token_id: int | None = None,
        sequential_head: str = "markov",
        markov_rank: int = 256,
        use_confidence_head: bool = True,
        confidence_temperatures: list[float] | None = None,
        confidence_offsets: list[float] | None = None,
        greedy_confidence_temperatures: list[float] | None = None,
        greedy_confidence_offsets: list[float] | None = None,
        confidence_threshold: float = 0.0,
        sequential_top_k: int = 0,
        num_unpredicted_slots: int = 0,
        draft_vocab_size: int | None = None,
        target_name_or_path: str | None = None,
        target_embedding_signature: list[float] | None = None,
        hf_dspark_version: str | None = None,
        drafter_architecture: str = "block",
        draft_layer_style: str = "target",
        **kwargs,
    ):
        target_config = dict(target_config or {})
        for key in _DROPPED_TARGET_KEYS:
            target_config.pop(key, None)
        self.target_config = target_config
        self.num_hidden_layers = num_hidden_layers
        self.num_target_layers = num_target_layers if num_target_layers is not None else target_config.get(
            "num_hidden_layers")
        if target_layer_ids is None and self.num_target_layers:
            target_layer_ids = default_target_layer_ids(self.num_target_layers)
        # a list stays a list; anything else (a hand-edited "1") is kept for _raise_if_wrong_types to name
        self.target_layer_ids = list(target_layer_ids) if isinstance(target_layer_ids, (list, tuple)) else (
            target_layer_ids if target_layer_ids is not None else [])
        self.block_size = block_size
        vocab_size = target_config.get("vocab_size")
        self.mask_token_id = mask_token_id if mask_token_id is not None else (
            vocab_size - 1 if vocab_size else None)
        self.sequential_head = sequential_head
        self.markov_rank = markov_rank
        self.use_confidence_head = use_confidence_head
        self.confidence_temperatures = list(confidence_temperatures) if confidence_temperatures else None
        self.confidence_offsets = list(confidence_offsets) if confidence_offsets else None
        self.greedy_confidence_temperatures = (list(greedy_confidence_temperatures) if greedy_confidence_temperatures
                                               else None)
        self.greedy_confidence_offsets = list(greedy_confidence_offsets) if greedy_confidence_offsets else None
        self.confidence_threshold = confidence_threshold
        self.sequential_top_k = sequential_top_k
        self.num_unpredicted_slots = num_unpredicted_slots
        self.draft_vocab_size = draft_vocab_size
        self.target_name_or_path = target_name_or_path
        self.target_embedding_signature = target_embedding_signature
        self.hf_dspark_version = hf_dspark_version or _version()
        self.drafter_architecture = drafter_architecture
        self.draft_layer_style = draft_layer_style
        # transformers' pipeline / assisted-generation checks read these off the assistant's config.
        for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_size"):
            kwargs.setdefault(key, target_config.get(key))
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
        if target_config:
            self._raise_if_invalid()

    # -- validation ---------------------------------------------------------------------------------------
    def _raise_if_invalid(self) -> None:
        from .architectures import NO_SEQUENTIAL_HEAD, architecture_of
        from .heads import SEQUENTIAL_HEAD_CLASSES

        self._raise_if_wrong_types()
        heads = sorted(SEQUENTIAL_HEAD_CLASSES) + [NO_SEQUENTIAL_HEAD]
        if self.sequential_head not in heads:
            raise ValueError(f"sequential_head={self.sequential_head!r} is not one of {heads} (add one with "
                             "hf_dspark.modeling.heads.register_sequential_head).")
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be >= 1 (published drafters use 7).")
        architecture = architecture_of(self)  # raises for an unknown name
        if architecture.autoregressive and (
                self.sequential_head != NO_SEQUENTIAL_HEAD or self.use_confidence_head or self.num_hidden_layers != 1):
            raise ValueError(f"An {architecture.label or architecture.name} drafter has one layer and no sequential or "
                             "confidence head: use sequential_head='none', use_confidence_head=False, "
                             "num_hidden_layers=1.")
        if self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers={self.num_hidden_layers} must be >= 1.")
        if self.sequential_head != NO_SEQUENTIAL_HEAD and self.markov_rank < 1:
            raise ValueError(f"markov_rank={self.markov_rank} must be >= 1 with sequential_head="
                             f"{self.sequential_head!r}; use sequential_head='none' for DFlash.")
        if self.use_confidence_head and self.sequential_head == NO_SEQUENTIAL_HEAD:
            # The confidence head reads W1[x_{k-1}], which only exists with a sequential head.
            raise ValueError("use_confidence_head=True needs a sequential head (its input is [h_k ; W1[x_{k-1}]]); "
                             "set use_confidence_head=False for a DFlash drafter.")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty: name the target decoder layers to tap.")
        for key, what in (("hidden_size", "hidden size"), ("vocab_size", "vocabulary")):
            top, inner = getattr(self, key, None), self.target_config.get(key)
            if top is not None and inner is not None and top != inner:
                # The layers are built from target_config, but transformers and the step-cost profiler read the
                # top-level copy: a different value was ignored, or (vocab_size) drew token ids out of range.
                raise ValueError(f"{key}={top} disagrees with target_config[{key!r}]={inner}: a drafter has its "
                                 f"target's {what} and its layers are built from target_config. Remove the "
                                 f"top-level {key} (or set it to the target's).")
        if self.num_target_layers is not None:
            bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
            if bad:
                raise ValueError(f"target_layer_ids {bad} are outside the target's {self.num_target_layers} layers.")
            if self.num_target_layers - 1 in self.target_layer_ids and self.num_target_layers > 1:
                raise ValueError(f"target_layer_ids must not contain the last layer ({self.num_target_layers - 1}): "
                                 "transformers returns it after the final norm, not as a raw layer output.")
        if list(self.target_layer_ids) != sorted(set(self.target_layer_ids)):
            raise ValueError(f"target_layer_ids={self.target_layer_ids} must be strictly ascending.")
        vocab = self.target_config.get("vocab_size")
        if vocab is not None and self.mask_token_id is not None and not 0 <= self.mask_token_id < vocab:
            raise ValueError(f"mask_token_id={self.mask_token_id} is outside the target vocabulary (size {vocab}).")
        for name in ("confidence_temperatures", "confidence_offsets", "greedy_confidence_temperatures",
                     "greedy_confidence_offsets"):
            values = getattr(self, name, None)
            if values is not None and len(values) != self.block_size:
                raise ValueError(f"{name} has {len(values)} entries; it needs one per draft position "
                                 f"(block_size={self.block_size}).")
        if self.greedy_confidence_offsets is not None and self.greedy_confidence_temperatures is None:
            raise ValueError("greedy_confidence_offsets needs greedy_confidence_temperatures (a greedy fit is the pair).")
        if self.draft_vocab_size is not None and not (
                1 <= self.draft_vocab_size <= (vocab if vocab is not None else self.draft_vocab_size)):
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be in [1, vocab_size={vocab}].")
        if self.num_unpredicted_slots < 0:
            raise ValueError(f"num_unpredicted_slots={self.num_unpredicted_slots} must be >= 0.")
        if self.num_unpredicted_slots and architecture.autoregressive:
            raise ValueError("num_unpredicted_slots applies to block drafters only.")
        from .families import TARGET_FAMILIES, TARGET_LAYER_STYLE

        styles = [TARGET_LAYER_STYLE, *sorted(TARGET_FAMILIES)]
        if self.draft_layer_style not in styles:
            raise ValueError(f"draft_layer_style={self.draft_layer_style!r} is not one of {styles}.")
        if self.sequential_top_k < 0:
            raise ValueError(f"sequential_top_k={self.sequential_top_k} must be >= 0 (0 = full vocabulary).")

    def _raise_if_wrong_types(self) -> None:
        """Missing target keys and wrongly typed fields, checked before any comparison could raise a TypeError."""
        missing = [key for key in _REQUIRED_TARGET_KEYS if self.target_config.get(key) is None]
        if missing:
            raise ValueError(f"target_config has no {missing}: a drafter's layers and vocabulary are built from its "
                             "target's config. Rebuild the drafter with DSparkDraftModel.from_target(target) or copy "
                             "the keys from the target's config.json.")
        for name in _INT_FIELDS + _OPTIONAL_INT_FIELDS:
            value = getattr(self, name, None)
            if not _is_int(value) and not (value is None and name in _OPTIONAL_INT_FIELDS):
                raise ValueError(f"{name}={value!r} must be an integer{' or null' * (name in _OPTIONAL_INT_FIELDS)}.")
        if not isinstance(self.use_confidence_head, bool):
            raise ValueError(f"use_confidence_head={self.use_confidence_head!r} must be true or false.")
        if not isinstance(self.target_layer_ids, list) or not all(_is_int(i) for i in self.target_layer_ids):
            raise ValueError(f"target_layer_ids={self.target_layer_ids!r} must be a list of integers (0-based target "
                             "decoder layers).")
        # drafting compares, divides and indexes with these: a "0.5" from a hand-edited config.json failed deep
        # inside the first generate call, and a mistyped signature skipped the wrong-target check silently
        if not _is_finite_number(self.confidence_threshold) or self.confidence_threshold < 0:
            raise ValueError(f"confidence_threshold={self.confidence_threshold!r} must be a finite number >= 0 (0 = "
                             "always draft the whole block).")
        for name, positive in _FLOAT_LIST_FIELDS:
            values = getattr(self, name, None)
            if values is not None and (not isinstance(values, list) or not all(
                    _is_finite_number(v) and (v > 0 or not positive) for v in values)):
                raise ValueError(f"{name}={values!r} must be a list of finite numbers{' > 0' * positive} or null "
                                 "(hf-dspark calibrate and from_target write them).")
        for key in ("hidden_size", "num_attention_heads", "vocab_size"):
            if not _is_int(self.target_config[key]):
                raise ValueError(f"target_config[{key!r}]={self.target_config[key]!r} must be an integer (the "
                                 f"target's {key}).")
        self._raise_if_target_config_invalid()

    def _raise_if_target_config_invalid(self) -> None:
        """The layers are built from ``AutoConfig.for_model(**target_config)``: check it builds here, so a mistyped
        field is named now instead of raising transformers' StrictDataclassError from inside the model."""
        from huggingface_hub.errors import StrictDataclassError
        from transformers import AutoConfig

        from .families import TARGET_FAMILIES

        model_type = self.target_config["model_type"]
        if model_type not in TARGET_FAMILIES:
            return  # the model names the supported families and how to add one
        try:
            AutoConfig.for_model(**self.target_config)
        except (StrictDataclassError, ValueError, TypeError) as err:
            reason = " ".join(str(err).split())
            raise ValueError(f"target_config is not a valid {model_type!r} config: {reason} (it is the target's "
                             "text config: copy the field from the target's config.json).") from err

    # -- derived ------------------------------------------------------------------------------------------
    def calibration_for(self, greedy: bool) -> tuple[list[float] | None, list[float] | None]:
        """(temperatures, offsets) for greedy or sampled decoding: the greedy fit when there is one for greedy
        decoding, else the general one (None entries mean T = 1 / b = 0)."""
        if greedy and getattr(self, "greedy_confidence_temperatures", None) is not None:
            return self.greedy_confidence_temperatures, self.greedy_confidence_offsets
        return self.confidence_temperatures, self.confidence_offsets

    @property
    def block_slots(self) -> int:
        """Slots of the backbone block: the drafts plus the leading slots that predict nothing."""
        return self.block_size + getattr(self, "num_unpredicted_slots", 0)

    @property
    def num_draft_tokens(self) -> int:
        """Rows of the drafter's output distribution (the draft vocabulary)."""
        return self.draft_vocab_size or self.target_config["vocab_size"]

    @property
    def target_family(self) -> str:
        return self.target_config.get("model_type", "llama")

    @property
    def target_hidden_size(self) -> int:
        return self.target_config["hidden_size"]

    @property
    def head_dim(self) -> int:
        cfg = self.target_config
        return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
