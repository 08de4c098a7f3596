"""Checkpoint dialects: our own format plus the published layouts (DeepSpec, speculators, SpecForge / z-lab,
transformers' own DFlash assistants).

A dialect maps a foreign ``config.json`` to a :class:`DSparkConfig` and its tensor names to ours; nothing here
needs ``trust_remote_code``. Every dialect goes through the same checks before a single weight is used: the
safetensors headers are validated (a truncated or corrupt file names the tensor it breaks), and the mapped
tensor names and shapes must equal the drafter's parameters exactly (missing, unexpected and mis-shaped
tensors are errors, never random initialisation). Tensors that belong to the target (``embed_tokens``,
``lm_head``, speculators' ``verifier_*``) are accepted and dropped: the drafter uses the bound target's own.

Conventions the dialects are normalised to (ours, SPEC §2):
- ``target_layer_ids`` are 0-based decoder-layer indices whose raw output is tapped, i.e.
  ``hidden_states[i + 1]`` of ``output_hidden_states``. DeepSpec, SpecForge, z-lab and transformers store
  exactly that; speculators stores the ``hidden_states`` index itself (its DFlash converter adds 1), so we
  subtract 1.
- Block convention: ``block_size`` counts the drafts per round and ``num_unpredicted_slots`` the leading block
  slots that predict nothing. DeepSpec, SpecForge's DSpark and speculators ``sample_from_anchor=true`` let the
  anchor slot predict (slot k of [anchor, MASK × (γ-1)] at position p+k drafts token p+k+1): 0 unpredicted
  slots. Upstream DFlash (z-lab, SpecForge's DFlash, transformers' DFlash assistants, speculators
  ``sample_from_anchor=false``) lets only the mask slots of [anchor, MASK × γ] predict, each the token at its own
  position: 1 unpredicted slot, and a stored block of 16 is 15 drafts.
- Reduced vocabularies: speculators, SpecForge and EAGLE-style checkpoints store ``d2t`` (long, one per draft
  token: the target id is ``draft index + d2t[index]``) and ``t2d`` (bool over the target vocabulary); the
  draft vocabulary is ``t2d``'s true entries in ascending order. We keep the target ids (``draft_to_target``)
  and the target LM head's rows for them; a stored draft ``lm_head`` must be those rows (``stored_vocabulary.py``
  reads the mapping, ``target_compatibility.py`` checks the head).
- Drafting is exactly the reference's: every foreign dialect gives ``sequential_top_k = 0`` (the sequential
  bias over the whole draft vocabulary), as DeepSpec, speculators and vLLM draft.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .checkpoint_files import CheckpointError, TensorInfo
from .configuration import DSparkConfig


# -------------------------------------------------------------------------------------------------------
# Dialect registry
# -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Dialect:
    """How one published layout maps onto ours.

    ``build_config(raw_config, target)`` returns our config (raising :class:`CheckpointError` for anything it
    cannot map exactly); ``rename(name)`` gives our parameter name for a stored tensor, or ``None`` to drop a
    target tensor; ``check_tensors(raw_config, tensors)`` refuses layouts only visible in the tensors.
    """

    name: str
    matches: Callable[[dict], bool]
    build_config: Callable[[dict, object], DSparkConfig]
    rename: Callable[[str], str | None] = lambda name: name
    check_tensors: Callable[[dict, dict[str, TensorInfo]], None] = lambda raw, tensors: None
    load_with_transformers: bool = False
    # the layout may carry a reduced draft vocabulary as d2t / t2d tensors (see the module docstring)
    vocab_mapping: bool = False
    # how the layout stores the taps, for hf_dspark.hub.describe_checkpoint
    tap_convention: str = "0-based decoder layers (hidden_states[i + 1])"


DIALECTS: dict[str, Dialect] = {}


def register_dialect(dialect: Dialect) -> None:
    """Add a checkpoint layout; dialects are tried in registration order."""
    if dialect.name in DIALECTS:
        raise ValueError(f"A dialect named {dialect.name!r} is already registered.")
    DIALECTS[dialect.name] = dialect


def detect_dialect(raw: dict, path: Path | str = "") -> Dialect:
    for dialect in DIALECTS.values():
        if dialect.matches(raw):
            return dialect
    raise CheckpointError(f"{path} is not a checkpoint format hf-dspark can read (model_type="
                          f"{raw.get('model_type')!r}, architectures={raw.get('architectures')}); known dialects: "
                          f"{', '.join(DIALECTS)}.")


# -------------------------------------------------------------------------------------------------------
# Shared mapping helpers
# -------------------------------------------------------------------------------------------------------
_MARKOV_HEAD_TYPES = {"vanilla": "markov", "markov": "markov", "gated": "gated", "rnn": "rnn"}
_TARGET_TENSORS = {"embed_tokens.weight", "lm_head.weight"}
# Keys of a foreign config that describe the drafter, not the target's text config.
_METHOD_KEYS = ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "num_anchors", "markov_rank",
                "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "confidence_head_alpha",
                "dflash_config", "layer_types", "max_window_layers", "_attn_implementation", "auto_map",
                "architectures", "target_model_name_or_path")

_FOREIGN_TOP_K = 0  # every foreign dialect drafts over the full (draft) vocabulary, as its reference does

#: Tensors that store a reduced draft vocabulary (read by :mod:`.stored_vocabulary`): never drafter parameters.
VOCAB_MAPPING_TENSORS = ("d2t", "t2d")


def _drafts_per_round(stored_block: int, unpredicted: int, what: str) -> int:
    drafts = int(stored_block) - unpredicted
    if drafts < 1:
        raise CheckpointError(f"{what}={stored_block} leaves no draft slot: with the upstream DFlash convention the "
                              "anchor slot predicts nothing, so a block needs at least 2 slots.")
    return drafts


def _sequential_head(markov_rank: int, head_type) -> str:
    if markov_rank == 0:
        return "none"
    try:
        return _MARKOV_HEAD_TYPES[str(head_type).lower()]
    except KeyError:
        raise CheckpointError(f"markov_head_type={head_type!r} is not one of {sorted(_MARKOV_HEAD_TYPES)}.") from None


def _use_confidence_head(enabled: bool, with_markov: bool, markov_rank: int) -> bool:
    if not enabled:
        return False
    if not with_markov or markov_rank == 0:
        raise CheckpointError("This checkpoint's confidence head reads h_k only (confidence_head_with_markov=false); "
                              "hf-dspark's confidence head reads [h_k ; W1[x_{k-1}]] as in the paper, so it cannot "
                              "be loaded exactly.")
    return True


def _target_text_config(raw: dict, num_target_layers: int | None) -> dict:
    """The target's text config inside a foreign drafter config (whose num_hidden_layers counts draft layers)."""
    layer_types = raw.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types):
        raise CheckpointError(f"The draft layers use {sorted(set(layer_types))} attention; hf-dspark drafters have "
                              "full (bidirectional-in-block) attention only.")
    config = {key: value for key, value in raw.items() if key not in _METHOD_KEYS}
    config.pop("num_hidden_layers", None)
    if num_target_layers is not None:
        config["num_hidden_layers"] = int(num_target_layers)
    return config


def _raise_if_embedding_tap(ids: list[int], convention: str) -> None:
    if any(i < 0 for i in ids):
        raise CheckpointError(f"target_layer_ids {ids} ({convention}) tap the target's embedding output; hf-dspark "
                              "taps decoder-layer outputs only.")


def _num_layers(target) -> int | None:
    return target.config.get_text_config().num_hidden_layers if target is not None else None


# -------------------------------------------------------------------------------------------------------
# Native
# -------------------------------------------------------------------------------------------------------
# Fields every hf-dspark version has saved. A missing one is damage, not an old format: a default would build a
# different drafter than the one trained (block_size 7 instead of 5, other taps or mask token) without a word.
_NATIVE_REQUIRED = ("target_config", "num_hidden_layers", "target_layer_ids", "block_size", "mask_token_id",
                    "sequential_head", "markov_rank", "use_confidence_head")


def _is_native(raw: dict) -> bool:
    # target_config is ours alone: a damaged model_type must not send our config to another dialect's reader
    return raw.get("model_type") == DSparkConfig.model_type or "target_config" in raw


def _native_config(raw: dict, target) -> DSparkConfig:
    if raw.get("model_type") != DSparkConfig.model_type:
        raise CheckpointError(f"model_type={raw.get('model_type')!r} on an hf-dspark drafter config (it has "
                              f"target_config): it must be {DSparkConfig.model_type!r}.")
    missing = [key for key in _NATIVE_REQUIRED if key not in raw]
    if missing:
        raise CheckpointError(f"it has no {missing}, which every hf-dspark drafter saves; defaults would build a "
                              "different drafter than the one trained.")
    if not isinstance(raw["target_config"], dict) or not raw["target_config"]:
        # an empty target_config would also skip DSparkConfig's validation
        raise CheckpointError(f"target_config={raw['target_config']!r} must be the target's text config (a "
                              "non-empty object).")
    return DSparkConfig.from_dict(raw)


register_dialect(Dialect(
    name="native",
    matches=_is_native,
    build_config=_native_config,
    load_with_transformers=True,
))


# -------------------------------------------------------------------------------------------------------
# DeepSpec (Qwen3DSparkModel) and SpecForge / z-lab (nested dflash_config)
# -------------------------------------------------------------------------------------------------------
_REQUIRED = object()


def _method_field(raw: dict, key: str, default=_REQUIRED):
    """A method key at the top level (DeepSpec) or inside ``dflash_config`` (SpecForge / z-lab)."""
    nested = raw.get("dflash_config") or {}
    if key in raw:
        return raw[key]
    if key in nested:
        return nested[key]
    if default is _REQUIRED:
        raise CheckpointError(f"config.json has no {key!r} (looked at the top level and in dflash_config).")
    return default


def _specforge_default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """SpecForge's fallback when dflash_config has no target_layer_ids: one tap per draft layer, 1..L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _qwen_style_config(raw: dict, target, unpredicted: int = 0) -> DSparkConfig:
    """DeepSpec and SpecForge / z-lab all store a copy of the (draft) Qwen3 config plus method keys (top level or
    nested in ``dflash_config``); ``unpredicted`` is 1 for the upstream DFlash block convention."""
    num_target_layers = _method_field(raw, "num_target_layers", None) or _num_layers(target)
    if num_target_layers is None:
        raise CheckpointError("config.json has no 'num_target_layers'; pass target=... so the target's layer count "
                              "is known.")
    if "num_hidden_layers" not in raw:
        raise CheckpointError("config.json has no 'num_hidden_layers' (the number of draft layers).")
    num_draft_layers = int(raw["num_hidden_layers"])
    layer_ids = _method_field(raw, "target_layer_ids", None)
    if layer_ids is None:
        layer_ids = _specforge_default_layer_ids(int(num_target_layers), num_draft_layers)
    layer_ids = [int(i) for i in layer_ids]
    _raise_if_embedding_tap(layer_ids, "0-based decoder layers")
    rank = int(_method_field(raw, "markov_rank", 0) or 0)
    alpha = float(_method_field(raw, "confidence_head_alpha", 0.0) or 0.0)
    use_confidence = _use_confidence_head(bool(_method_field(raw, "enable_confidence_head", alpha > 0)),
                                          bool(_method_field(raw, "confidence_head_with_markov", False)), rank)
    return DSparkConfig(
        target_config=_target_text_config(raw, num_target_layers), num_hidden_layers=num_draft_layers,
        target_layer_ids=layer_ids, num_target_layers=int(num_target_layers),
        block_size=_drafts_per_round(_method_field(raw, "block_size"), unpredicted, "block_size"),
        num_unpredicted_slots=unpredicted, mask_token_id=int(_method_field(raw, "mask_token_id")),
        sequential_head=_sequential_head(rank, _method_field(raw, "markov_head_type", "vanilla")),
        markov_rank=rank, use_confidence_head=use_confidence, sequential_top_k=_FOREIGN_TOP_K,
        target_name_or_path=raw.get("target_model_name_or_path") or raw.get("_name_or_path") or None)


def _drop_target_tensors(name: str) -> str | None:
    return None if name in _TARGET_TENSORS else name


def _is_deepspec(raw: dict) -> bool:
    """DeepSpec names its drafters <Family>DSparkModel (Qwen3DSparkModel, Gemma4DSparkModel; Qwen2 forks too)."""
    return any(str(arch).endswith("DSparkModel") for arch in raw.get("architectures") or ())


register_dialect(Dialect(
    name="deepspec",
    matches=_is_deepspec,
    build_config=_qwen_style_config,
    rename=_drop_target_tensors,
))


def _specforge_projector(raw: dict) -> str:
    nested = raw.get("dflash_config") or {}
    default = "dspark" if "DSparkDraftModel" in (raw.get("architectures") or ()) else "dflash"
    return str(nested.get("projector_type") or default).lower()


def _specforge_config(raw: dict, target) -> DSparkConfig:
    """SpecForge's DSpark trains the DeepSpec convention (labels anchor+1 .. anchor+γ); its DFlash and z-lab's
    DFlash train the upstream one (the anchor slot is masked out of the loss, slot k predicts anchor+k)."""
    projector = _specforge_projector(raw)
    if projector == "dspark":
        return _qwen_style_config(raw, target)
    if projector == "dflash":
        if int(_method_field(raw, "markov_rank", 0) or 0):
            raise CheckpointError("This DFlash checkpoint (projector_type 'dflash') has a Markov head; only DSpark "
                                  "checkpoints (projector_type 'dspark') have one in SpecForge's layouts.")
        return _qwen_style_config(raw, target, unpredicted=1)
    raise CheckpointError(f"dflash_config.projector_type={projector!r} is not a DSpark or DFlash drafter (only "
                          "'dspark' and 'dflash' map onto hf-dspark's model).")


# Early SpecForge DSpark checkpoints kept the heads under a ``logit_head`` container.
_SPECFORGE_PREFIXES = (("logit_head.markov_head.", "markov_head."), ("logit_head.confidence_head.", "confidence_head."))


def _specforge_rename(name: str) -> str | None:
    if name in _TARGET_TENSORS or name in VOCAB_MAPPING_TENSORS:
        return None
    for old, new in _SPECFORGE_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


_SPECFORGE_ARCHITECTURES = {"DSparkDraftModel", "DFlashDraftModel"}

register_dialect(Dialect(
    name="specforge",
    matches=lambda raw: "dflash_config" in raw or bool(_SPECFORGE_ARCHITECTURES & set(raw.get("architectures") or ())),
    build_config=_specforge_config,
    rename=_specforge_rename,
    vocab_mapping=True,
))


# -------------------------------------------------------------------------------------------------------
# speculators (vLLM's format)
# -------------------------------------------------------------------------------------------------------
def _layer_config(raw: dict) -> dict:
    """transformer_layer_config is stored as a diff against its class defaults: fill the defaults back in."""
    from transformers import AutoConfig

    layer = dict(raw.get("transformer_layer_config") or {})
    model_type = layer.pop("model_type", "qwen3")
    layer.pop("transformers_version", None)
    return AutoConfig.for_model(model_type, **layer).to_dict()


def _speculators_sample_from_anchor(raw: dict) -> bool:
    return bool(raw.get("sample_from_anchor", raw.get("speculators_model_type") == "dspark"))


def _speculators_config(raw: dict, target) -> DSparkConfig:
    kind = raw["speculators_model_type"]
    if kind not in ("dspark", "dflash"):
        raise CheckpointError(f"speculators_model_type={kind!r} is not a DSpark/DFlash drafter; hf-dspark loads "
                              "'dspark' and 'dflash' speculators.")
    # sample_from_anchor=false: the anchor is the bonus token and only the mask slots predict (block_size - 1 drafts)
    unpredicted = 0 if _speculators_sample_from_anchor(raw) else 1
    layer = _layer_config(raw)
    target_hidden = raw.get("target_hidden_size")
    if target_hidden not in (None, layer["hidden_size"]):
        raise CheckpointError(f"target_hidden_size={target_hidden} differs from the draft hidden size "
                              f"{layer['hidden_size']}; hf-dspark drafters share the target's hidden size.")
    if raw.get("mask_token_id") is None:
        raise CheckpointError("config.json has no 'mask_token_id' (speculators needs it too).")
    aux_ids = [int(i) for i in raw.get("aux_hidden_state_layer_ids") or ()]
    if not aux_ids:
        raise CheckpointError("config.json has no 'aux_hidden_state_layer_ids'.")
    layer_ids = [i - 1 for i in aux_ids]  # speculators: hidden_states index; ours: decoder layer = index - 1
    _raise_if_embedding_tap(layer_ids, f"from speculators' hidden_states indices {aux_ids}")
    rank = int(raw.get("markov_rank", 256 if kind == "dspark" else 0) or 0)
    head = _sequential_head(rank, raw.get("markov_head_type", "vanilla"))
    if head == "rnn" and unpredicted:
        raise CheckpointError("This speculators DSpark checkpoint has an rnn head and sample_from_anchor=false: "
                              "speculators runs the RNN state through the unpredicted anchor slot as well, while "
                              "hf-dspark's RNN state starts at the first draft, so it cannot be loaded exactly.")
    use_confidence = _use_confidence_head(bool(raw.get("enable_confidence_head", kind == "dspark")),
                                          bool(raw.get("confidence_head_with_markov", True)), rank)
    verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
    extras = _hf_dspark_fields(raw)  # our own export: restore what it recorded (top-k included)
    extras.setdefault("sequential_top_k", _FOREIGN_TOP_K)
    # the count our export recorded wins over the given target's, so binding refuses a target of another depth
    num_target_layers = extras.pop("num_target_layers", None) or _num_layers(target)
    target_config = _target_text_config(layer, num_target_layers)
    # speculators builds every draft layer as a Qwen3 layer, whatever its verifier: the layers keep that style and
    # the target's family (the given target's, else the one our own export recorded) is what binding checks.
    recorded = raw.get("hf_dspark") or {}
    layer_model_type = target_config.get("model_type", "qwen3")
    target_model_type = (target.config.get_text_config().model_type if target is not None
                         else recorded.get("target_model_type")) or layer_model_type
    target_config["model_type"] = target_model_type
    extras["draft_layer_style"] = recorded.get("draft_layer_style") or (
        "target" if layer_model_type == target_model_type else layer_model_type)
    return DSparkConfig(
        target_config=target_config, num_hidden_layers=int(layer["num_hidden_layers"]),
        target_layer_ids=layer_ids, num_target_layers=num_target_layers,
        block_size=_drafts_per_round(raw.get("block_size", 8), unpredicted, "block_size"),
        num_unpredicted_slots=unpredicted, mask_token_id=int(raw["mask_token_id"]),
        sequential_head=head, markov_rank=rank, use_confidence_head=use_confidence,
        target_name_or_path=verifier.get("name_or_path"), **extras)


# Settings speculators has no field for, stored by hf_dspark.hub.export under "hf_dspark" (vLLM ignores the block).
_HF_DSPARK_FIELDS = ("num_target_layers", "target_embedding_signature", "confidence_temperatures",
                     "confidence_offsets", "greedy_confidence_temperatures", "greedy_confidence_offsets",
                     "confidence_threshold", "sequential_top_k")


def _hf_dspark_fields(raw: dict) -> dict:
    block = raw.get("hf_dspark") or {}
    return {key: block[key] for key in _HF_DSPARK_FIELDS if block.get(key) is not None}


_SPECULATORS_DROPPED = _TARGET_TENSORS | {"verifier_lm_head.weight", "verifier_norm.weight", *VOCAB_MAPPING_TENSORS}

register_dialect(Dialect(
    name="speculators",
    matches=lambda raw: "speculators_model_type" in raw,
    build_config=_speculators_config,
    rename=lambda name: None if name in _SPECULATORS_DROPPED else name,
    vocab_mapping=True,
    tap_convention="hidden_states indices (aux_hidden_state_layer_ids = decoder layer + 1)",
))


# -------------------------------------------------------------------------------------------------------
# transformers' own DFlash assistants (MuseGlimmerAssistantModel, speculation_type="dflash")
# -------------------------------------------------------------------------------------------------------
TRANSFORMERS_DFLASH_MODEL_TYPES = ("muse_glimmer_assistant",)


def _transformers_dflash_config(raw: dict, target) -> DSparkConfig:
    """transformers 5.24's DFlash assistant: Qwen3-style layers (q/k RMSNorm, no biases), a context projection
    ``encoder.{fc, output_norm_enc}``, the upstream block convention ([anchor, MASK × (block_size-1)], only the
    masks predict) and 0-based ``target_layer_ids`` read as ``hidden_states[i + 1]``. Its config records neither
    the target's vocabulary nor its layer count, so the target is needed."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(**raw)  # transformers' own defaults (block 16, rope, layer types)
    layer_types = list(config.layer_types or [])
    if any(kind != "full_attention" for kind in layer_types):
        raise CheckpointError(f"The draft layers use {sorted(set(layer_types))} (window {config.sliding_window}); "
                              "hf-dspark drafters have full (bidirectional-in-block) attention only, so a "
                              "sliding-window DFlash assistant would draft differently once the context is longer "
                              "than its window.")
    if target is None:
        raise CheckpointError("transformers' DFlash assistant configs record neither the target's vocabulary nor its "
                              "layer count: pass target=... to load one.")
    target_text = target.config.get_text_config()
    if target_text.model_type != "qwen3":
        raise CheckpointError(f"This DFlash assistant has Qwen3-style layers (q/k RMSNorm) but the target is "
                              f"{target_text.model_type!r}; hf-dspark builds a drafter's layers from its target's "
                              "family, so transformers' DFlash assistants load for Qwen3-family targets only.")
    target_config = {
        "model_type": "qwen3", "vocab_size": target.get_input_embeddings().weight.shape[0],
        "num_hidden_layers": target_text.num_hidden_layers, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps, "rope_parameters": dict(config.rope_parameters),
        "max_position_embeddings": config.max_position_embeddings, "hidden_act": config.hidden_act,
        "attention_bias": False, "bos_token_id": target_text.bos_token_id, "eos_token_id": target_text.eos_token_id,
        "pad_token_id": target_text.pad_token_id, "tie_word_embeddings": False}
    layer_ids = [int(i) for i in config.target_layer_ids]
    _raise_if_embedding_tap(layer_ids, "0-based decoder layers")
    return DSparkConfig(
        target_config=target_config, num_hidden_layers=int(config.num_hidden_layers), target_layer_ids=layer_ids,
        num_target_layers=target_text.num_hidden_layers,
        block_size=_drafts_per_round(config.block_size, 1, "block_size"), num_unpredicted_slots=1,
        mask_token_id=int(config.mask_token_id), sequential_head="none", use_confidence_head=False,
        sequential_top_k=_FOREIGN_TOP_K, target_name_or_path=getattr(target, "name_or_path", None) or None)


_TRANSFORMERS_DFLASH_NAMES = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}


def _transformers_dflash_rename(name: str) -> str | None:
    name = name.removeprefix("model.")
    if name.startswith("rotary_emb."):
        return None
    return _TRANSFORMERS_DFLASH_NAMES.get(name, name)


register_dialect(Dialect(
    name="transformers-dflash",
    matches=lambda raw: raw.get("model_type") in TRANSFORMERS_DFLASH_MODEL_TYPES,
    build_config=_transformers_dflash_config,
    rename=_transformers_dflash_rename,
))
