"""Checkpoint dialects: our own format plus the published layouts (DeepSpec, speculators, SpecForge / z-lab).

A dialect maps a foreign ``config.json`` to a :class:`DSparkConfig` and its tensor names to ours; nothing here
needs ``trust_remote_code``. Every dialect goes through the same checks before a single weight is used: the
safetensors headers are validated (a truncated or corrupt file names the tensor it breaks), and the mapped
tensor names and shapes must equal the drafter's parameters exactly (missing, unexpected and mis-shaped
tensors are errors, never random initialisation). Tensors that belong to the target (``embed_tokens``,
``lm_head``, speculators' ``verifier_*``) are accepted and dropped: the drafter uses the bound target's own.

Conventions the dialects are normalised to (ours, SPEC §2):
- ``target_layer_ids`` are 0-based decoder-layer indices whose raw output is tapped, i.e.
  ``hidden_states[i + 1]`` of ``output_hidden_states``. DeepSpec, SpecForge and z-lab store exactly that;
  speculators stores the ``hidden_states`` index itself (its DFlash converter adds 1), so we subtract 1.
- The anchor slot predicts: slot k of the block [anchor, MASK × (γ-1)] at position p+k predicts token p+k+1
  (DeepSpec; SpecForge's DSpark; speculators ``sample_from_anchor=True``). Upstream DFlash (z-lab,
  SpecForge's DFlash, speculators ``sample_from_anchor=False``) lets only the mask slots predict, each the
  token at its own position; that cannot be mapped onto our block without changing outputs, so it is refused.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .architectures import architecture_of
from .configuration import DSparkConfig

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
                "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}


class CheckpointError(ValueError):
    """A checkpoint hf-dspark cannot load exactly: the message says which file, tensor or field, and why."""


# -------------------------------------------------------------------------------------------------------
# Locating and validating safetensors files
# -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]


def _resolve_dir(name_or_path, **kwargs) -> Path:
    """A local directory as is; otherwise a Hub id through the HF cache (cache only when offline)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.is_absolute() or str(name_or_path).startswith((".", "~")) or path.exists():
        raise FileNotFoundError(f"{name_or_path} is not a checkpoint directory.")
    from huggingface_hub import snapshot_download

    offline = any(os.environ.get(var, "").lower() in ("1", "true", "yes", "on")
                  for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    local_only = bool(kwargs.get("local_files_only", False)) or offline
    try:
        return Path(snapshot_download(str(name_or_path), revision=kwargs.get("revision"),
                                      cache_dir=kwargs.get("cache_dir"), local_files_only=local_only,
                                      token=kwargs.get("token"), allow_patterns=["*.json", "*.safetensors", "*.md"]))
    except Exception as err:  # huggingface_hub raises several unrelated types for "not available"
        where = "the local Hugging Face cache (offline mode)" if local_only else "the Hugging Face Hub"
        raise FileNotFoundError(f"Could not get drafter {name_or_path!r} from {where}: {err}") from err


def _read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors header and check every tensor's byte range lies inside the file."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{file} is truncated or not a safetensors file ({size} bytes).")
        header_len = int.from_bytes(prefix, "little")
        if header_len > size - 8:
            raise CheckpointError(f"{file} is truncated or corrupt: its header claims {header_len} bytes but the "
                                  f"file holds {size}. Re-download or re-save it.")
        try:
            header = json.loads(handle.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{file} is corrupt: its safetensors header is not valid JSON ({err}).") from err
    data_bytes = size - 8 - header_len
    tensors = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            (begin, end), shape = meta["data_offsets"], tuple(int(x) for x in meta["shape"])
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{file} is corrupt: the header entry of tensor {name!r} is malformed.") from err
        if end > data_bytes:
            raise CheckpointError(f"{file} is truncated: tensor {name!r} needs bytes {begin}..{end} of the data "
                                  f"section but the file holds only {data_bytes}. Re-download or re-save it.")
        expected = math.prod(shape) * _DTYPE_BYTES.get(meta["dtype"], 0)
        if meta["dtype"] in _DTYPE_BYTES and end - begin != expected:
            raise CheckpointError(f"{file} is corrupt: tensor {name!r} ({meta['dtype']}, shape {shape}) should "
                                  f"take {expected} bytes but its header gives {end - begin}.")
        tensors[name] = TensorInfo(file, meta["dtype"], shape)
    return tensors


def read_checkpoint_index(path: Path) -> dict[str, TensorInfo]:
    """Every tensor of a safetensors checkpoint (single file or sharded with an index), validated."""
    if (path / SINGLE_FILE).is_file():
        return _read_header(path / SINGLE_FILE)
    if (path / INDEX_FILE).is_file():
        return _read_sharded(path)
    files = sorted(path.glob("*.safetensors"))
    if files:
        tensors: dict[str, TensorInfo] = {}
        for file in files:
            tensors.update(_read_header(file))
        return tensors
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    found = f"it has only {', '.join(pickles)}" if pickles else "it has no weight files"
    raise CheckpointError(f"{path} has no safetensors weights ({found}). hf-dspark loads safetensors only (pickled "
                          "weights can run code on load): re-save the drafter with save_pretrained(..., "
                          "safe_serialization=True) or convert it with safetensors.torch.save_file.")


def _read_sharded(path: Path) -> dict[str, TensorInfo]:
    try:
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError) as err:
        raise CheckpointError(f"{path / INDEX_FILE} is corrupt (no valid 'weight_map'): {err}") from err
    headers = {}
    for shard in sorted(set(weight_map.values())):
        if not (path / shard).is_file():
            tensor = next(name for name, file in weight_map.items() if file == shard)
            raise CheckpointError(f"{path}: shard {shard} (holding tensor {tensor!r}) listed in {INDEX_FILE} is "
                                  "missing.")
        headers[shard] = _read_header(path / shard)
    tensors: dict[str, TensorInfo] = {}
    for name, shard in weight_map.items():
        if name not in headers[shard]:
            raise CheckpointError(f"{path}: {INDEX_FILE} puts tensor {name!r} in {shard}, which does not contain it.")
        tensors[name] = headers[shard][name]
    return tensors


def _load_tensors(mapping: dict[str, str], tensors: dict[str, TensorInfo]) -> dict[str, torch.Tensor]:
    """our name -> tensor, reading each file once."""
    from safetensors import safe_open

    by_file: dict[Path, list[tuple[str, str]]] = {}
    for ours, stored in mapping.items():
        by_file.setdefault(tensors[stored].file, []).append((ours, stored))
    state = {}
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as handle:
            for ours, stored in names:
                try:
                    state[ours] = handle.get_tensor(stored)
                except Exception as err:  # safetensors raises its own error type
                    raise CheckpointError(f"Could not read tensor {stored!r} from {file}: {err}") from err
    return state


def _load_rows(name: str, info: TensorInfo, rows: list[int]) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(info.file), framework="pt") as handle:
        view = handle.get_slice(name)
        return torch.stack([view[row:row + 1][0] for row in rows])


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

_ANCHOR_CONVENTION_HELP = (
    "it uses the upstream DFlash block convention (anchor + masks, only the mask slots predict, each the token at "
    "its own position), while hf-dspark drafters follow DeepSpec (the anchor slot predicts too: slot k predicts "
    "position p+k+1). The two cannot be mapped onto each other without changing the drafts, so it is not loaded. "
    "DeepSpec DFlash checkpoints (dflash_*, markov_rank 0), SpecForge DSpark and speculators checkpoints with "
    "sample_from_anchor=true load.")


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
register_dialect(Dialect(
    name="native",
    matches=lambda raw: raw.get("model_type") == DSparkConfig.model_type,
    build_config=lambda raw, target: DSparkConfig.from_dict(raw),
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


def _qwen_style_config(raw: dict, target) -> DSparkConfig:
    """DeepSpec and SpecForge both store a copy of the target config plus method keys (top level or nested)."""
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
        block_size=int(_method_field(raw, "block_size")), mask_token_id=int(_method_field(raw, "mask_token_id")),
        sequential_head=_sequential_head(rank, _method_field(raw, "markov_head_type", "vanilla")),
        markov_rank=rank, use_confidence_head=use_confidence,
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


def _specforge_config(raw: dict, target) -> DSparkConfig:
    nested = raw.get("dflash_config") or {}
    default = "dspark" if "DSparkDraftModel" in (raw.get("architectures") or ()) else "dflash"
    projector = str(nested.get("projector_type") or default).lower()
    if projector == "dflash":
        raise CheckpointError(f"This is a z-lab / SpecForge DFlash checkpoint: {_ANCHOR_CONVENTION_HELP}")
    if projector != "dspark":
        raise CheckpointError(f"dflash_config.projector_type={projector!r} is not a DSpark drafter (only 'dspark' "
                              "maps onto hf-dspark's model).")
    return _qwen_style_config(raw, target)


# Early SpecForge DSpark checkpoints kept the heads under a ``logit_head`` container.
_SPECFORGE_PREFIXES = (("logit_head.markov_head.", "markov_head."), ("logit_head.confidence_head.", "confidence_head."))


def _specforge_rename(name: str) -> str | None:
    if name in _TARGET_TENSORS or name in ("d2t", "t2d"):
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
    check_tensors=lambda raw, tensors: _raise_if_reduced_vocab(raw.get("vocab_size"), tensors),
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


def _speculators_config(raw: dict, target) -> DSparkConfig:
    kind = raw["speculators_model_type"]
    if kind not in ("dspark", "dflash"):
        raise CheckpointError(f"speculators_model_type={kind!r} is not a DSpark/DFlash drafter; hf-dspark loads "
                              "'dspark' and 'dflash' speculators.")
    if not raw.get("sample_from_anchor", kind == "dspark"):
        raise CheckpointError(f"This speculators checkpoint has sample_from_anchor=false: {_ANCHOR_CONVENTION_HELP}")
    layer = _layer_config(raw)
    vocab = layer["vocab_size"]
    _raise_if_reduced_vocab(vocab, {}, raw.get("draft_vocab_size", vocab))
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
    use_confidence = _use_confidence_head(bool(raw.get("enable_confidence_head", kind == "dspark")),
                                          bool(raw.get("confidence_head_with_markov", True)), rank)
    verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
    extras = _hf_dspark_fields(raw)
    stored_num_target_layers = extras.pop("num_target_layers", None)
    num_target_layers = _num_layers(target) or stored_num_target_layers
    return DSparkConfig(
        target_config=_target_text_config(layer, num_target_layers), num_hidden_layers=int(layer["num_hidden_layers"]),
        target_layer_ids=layer_ids, num_target_layers=num_target_layers, block_size=int(raw.get("block_size", 8)),
        mask_token_id=int(raw["mask_token_id"]),
        sequential_head=_sequential_head(rank, raw.get("markov_head_type", "vanilla")), markov_rank=rank,
        use_confidence_head=use_confidence, target_name_or_path=verifier.get("name_or_path"), **extras)


# Settings speculators has no field for, stored by hf_dspark.hub.export under "hf_dspark" (vLLM ignores the block).
_HF_DSPARK_FIELDS = ("num_target_layers", "target_embedding_signature", "confidence_temperatures",
                     "confidence_offsets", "greedy_confidence_temperatures", "greedy_confidence_offsets",
                     "confidence_threshold", "sequential_top_k")


def _hf_dspark_fields(raw: dict) -> dict:
    block = raw.get("hf_dspark") or {}
    return {key: block[key] for key in _HF_DSPARK_FIELDS if block.get(key) is not None}


def _raise_if_reduced_vocab(vocab: int | None, tensors: dict[str, TensorInfo], draft_vocab: int | None = None) -> None:
    if draft_vocab is None and "d2t" in tensors:
        draft_vocab = tensors["d2t"].shape[0]
    if vocab is not None and draft_vocab is not None and draft_vocab < vocab:
        raise CheckpointError(f"This drafter predicts a reduced draft vocabulary (draft_vocab_size={draft_vocab} < "
                              f"vocab_size={vocab}, mapped with d2t/t2d). hf-dspark drafters use the target's full "
                              "vocabulary and LM head, so reduced-vocabulary drafters are not supported yet.")


_SPECULATORS_DROPPED = _TARGET_TENSORS | {"verifier_lm_head.weight", "verifier_norm.weight", "t2d", "d2t"}


def _speculators_check_tensors(raw: dict, tensors: dict[str, TensorInfo]) -> None:
    _raise_if_reduced_vocab((raw.get("transformer_layer_config") or {}).get("vocab_size"), tensors)


register_dialect(Dialect(
    name="speculators",
    matches=lambda raw: "speculators_model_type" in raw,
    build_config=_speculators_config,
    rename=lambda name: None if name in _SPECULATORS_DROPPED else name,
    check_tensors=_speculators_check_tensors,
))


# -------------------------------------------------------------------------------------------------------
# Loading
# -------------------------------------------------------------------------------------------------------
def _read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path} has no config.json.")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{file} is not valid JSON: {err}") from err


def _map_tensors(dialect: Dialect, tensors: dict[str, TensorInfo], expected: dict[str, tuple[int, ...]],
                 path: Path) -> dict[str, str]:
    """our name -> stored name, after checking the mapped names and shapes equal the drafter's parameters."""
    mapping: dict[str, str] = {}
    for stored in tensors:
        ours = dialect.rename(stored)
        if ours is None:
            continue
        if ours in mapping:
            raise CheckpointError(f"{path}: tensors {mapping[ours]!r} and {stored!r} both map to {ours!r}.")
        mapping[ours] = stored
    where = f"{path} ({dialect.name} format)"
    missing = sorted(set(expected) - set(mapping))
    if missing:
        raise CheckpointError(f"{where} is missing tensor(s) {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                              "that this drafter's config requires.")
    unexpected = sorted(set(mapping) - set(expected))
    if unexpected:
        raise CheckpointError(f"{where} has tensor(s) {[mapping[n] for n in unexpected[:8]]} that this drafter has no "
                              "parameter for (its config builds no such module, e.g. q/k norms on a family without "
                              "them), so it cannot be loaded exactly.")
    for ours, stored in sorted(mapping.items()):
        got = tensors[stored].shape
        if tuple(got) != tuple(expected[ours]):
            raise CheckpointError(f"{where}: tensor {stored!r} has shape {tuple(got)} but the drafter's config "
                                  f"expects {tuple(expected[ours])}.")
    return mapping


def _signature_from_checkpoint(tensors: dict[str, TensorInfo], vocab_size: int | None) -> list[float] | None:
    """The target-embedding signature (see ``embedding_signature``) from a stored copy of the embedding."""
    from .modeling import _SIGNATURE_ROWS

    info = tensors.get("embed_tokens.weight")
    if info is None or len(info.shape) != 2 or info.shape[0] != vocab_size:
        return None
    rows = torch.linspace(0, info.shape[0] - 1, _SIGNATURE_ROWS).long().tolist()
    weight = _load_rows("embed_tokens.weight", info, rows)
    return [round(float(x), 4) for x in weight.float().norm(dim=-1)]


def _empty_model(cls, config: DSparkConfig):
    """The drafter with parameters on the meta device (buffers real): shapes for free, filled by assignment."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return cls(config)


def _load_native(cls, path: Path, *args, **kwargs):
    """Our format through transformers, after our checks; refuse anything transformers had to initialise."""
    kwargs.pop("output_loading_info", None)
    model, info = cls._from_pretrained_native(path, *args, output_loading_info=True, **kwargs)
    problems = {key: info.get(key) for key in ("missing_keys", "mismatched_keys", "unexpected_keys", "error_msgs")}
    problems = {key: sorted(map(str, value)) for key, value in problems.items() if value}
    if problems:
        raise CheckpointError(f"{path}: transformers reported {problems} while loading; refusing a partially "
                              "initialised drafter.")
    return model


def _load_foreign(model, path: Path, dialect: Dialect, tensors, mapping, dtype):
    """Fill the empty drafter by assignment from the mapped tensors (no random initialisation anywhere)."""
    signature = _signature_from_checkpoint(tensors, model.config.target_config.get("vocab_size"))
    if signature is not None:
        model.config.target_embedding_signature = signature
    model.load_state_dict(_load_tensors(mapping, tensors), strict=True, assign=True)
    if dtype is not None and dtype != "auto":
        model = model.to(dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    model.config._name_or_path = str(path)
    logger.info("Loaded a %s-format drafter from %s (%d tensors, target tensors dropped).", dialect.name, path,
                len(mapping))
    return model.eval()


def load_drafter(cls, name_or_path, *args, target=None, **kwargs):
    """Load a drafter in any registered dialect and bind ``target`` (see ``DSparkDraftModel.from_pretrained``)."""
    if target is not None:
        _raise_if_dtype_conflicts(kwargs, target)
    path = _resolve_dir(name_or_path, **kwargs)
    raw = _read_config(path)
    dialect = detect_dialect(raw, path)
    config = dialect.build_config(raw, target)
    architecture_class = architecture_of(config).model_class
    cls = cls if issubclass(cls, architecture_class) else architecture_class
    tensors = read_checkpoint_index(path)
    dialect.check_tensors(raw, tensors)
    model = _empty_model(cls, config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    mapping = _map_tensors(dialect, tensors, expected, path)
    if dialect.load_with_transformers:
        model = _load_native(cls, path, *args, **kwargs)
    else:
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        model = _load_foreign(model, path, dialect, tensors, mapping, dtype)
    if target is not None:
        model = model.bind_target(target)  # casts to the target's dtype and device
    return model


def _raise_if_dtype_conflicts(kwargs: dict, target) -> None:
    """An explicit ``dtype=`` / ``torch_dtype=`` that the target's dtype would override is refused, not ignored:
    a drafter computes with the target's embedding and LM head, so it always runs in the target's dtype."""
    from .modeling import target_compute_dtype

    for name in ("dtype", "torch_dtype"):
        asked = kwargs.get(name)
        if asked is None or asked == "auto":
            continue
        if isinstance(asked, str):
            asked = getattr(torch, asked.removeprefix("torch."), asked)
        want = target_compute_dtype(target)
        if asked != want:
            raise ValueError(f"{name}={kwargs[name]!r} conflicts with the target's {want}: a drafter computes with "
                             "the target's embedding and LM head, so it runs in the target's dtype. Drop "
                             f"{name}= (the drafter follows the target), or load the target in {kwargs[name]}.")
