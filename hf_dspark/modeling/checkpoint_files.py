"""Reading drafter checkpoints safely: locating them, validating safetensors headers before any weight is read, and
loading exactly the tensors (or rows) asked for. Pickle checkpoints are refused (they can execute code)."""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

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


def is_local_path(name_or_path) -> bool:
    """Whether ``name_or_path`` names a local path rather than a Hub id: it exists, or it cannot be a Hub id
    (absolute, starting with ``.`` or ``~``, two ``/`` or more, characters a repo id never has)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    path = Path(name_or_path).expanduser()
    if path.exists() or path.is_absolute() or str(name_or_path).startswith((".", "~")):
        return True
    try:
        validate_repo_id(str(name_or_path))
    except HFValidationError:
        return True
    return False


def resolve_checkpoint_dir(name_or_path, **kwargs) -> Path:
    """A local directory as is; otherwise a Hub id through the HF cache (cache only when offline). ``subfolder``
    (as in transformers' ``from_pretrained``) names the drafter's folder inside either."""
    subfolder = str(kwargs.get("subfolder") or "").strip("/")
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not subfolder:
            return path
        if not (path / subfolder).is_dir():
            raise FileNotFoundError(f"{name_or_path} has no subfolder {subfolder!r}.")
        return path / subfolder
    if is_local_path(name_or_path):
        raise FileNotFoundError(f"{name_or_path} is not a checkpoint directory.")
    from huggingface_hub import snapshot_download

    offline = any(os.environ.get(var, "").lower() in ("1", "true", "yes", "on")
                  for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    local_only = bool(kwargs.get("local_files_only", False)) or offline
    prefix = f"{subfolder}/" if subfolder else ""
    try:
        root = Path(snapshot_download(str(name_or_path), revision=kwargs.get("revision"),
                                      cache_dir=kwargs.get("cache_dir"), local_files_only=local_only,
                                      token=kwargs.get("token"), force_download=bool(kwargs.get("force_download")),
                                      allow_patterns=[prefix + pattern for pattern in ("*.json", "*.safetensors",
                                                                                        "*.md")]))
    except Exception as err:  # huggingface_hub raises several unrelated types for "not available"
        where = "the local Hugging Face cache (offline mode)" if local_only else "the Hugging Face Hub"
        raise FileNotFoundError(f"Could not get drafter {name_or_path!r} from {where}: {err}") from err
    if subfolder and not (root / subfolder).is_dir():
        raise FileNotFoundError(f"Drafter repo {name_or_path!r} has no subfolder {subfolder!r}.")
    return root / subfolder if subfolder else root


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
    if not isinstance(header, dict):
        raise CheckpointError(f"{file} is corrupt: its safetensors header is not a JSON object.")
    data_bytes = size - 8 - header_len
    tensors = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if not _is_tensor_entry(meta):
            raise CheckpointError(f"{file} is corrupt: the header entry of tensor {name!r} is malformed ({meta!r}).")
        (begin, end), shape = meta["data_offsets"], tuple(meta["shape"])
        if end > data_bytes:
            raise CheckpointError(f"{file} is truncated: tensor {name!r} needs bytes {begin}..{end} of the data "
                                  f"section but the file holds only {data_bytes}. Re-download or re-save it.")
        expected = math.prod(shape) * _DTYPE_BYTES.get(meta["dtype"], 0)
        if meta["dtype"] in _DTYPE_BYTES and end - begin != expected:
            raise CheckpointError(f"{file} is corrupt: tensor {name!r} ({meta['dtype']}, shape {shape}) should "
                                  f"take {expected} bytes but its header gives {end - begin}.")
        tensors[name] = TensorInfo(file, meta["dtype"], shape)
    return tensors


def _is_tensor_entry(meta) -> bool:
    """safetensors' layout of one header entry: a dtype name, a shape of sizes and two ordered byte offsets."""
    def sizes(values, count=None) -> bool:
        return (isinstance(values, list) and (count is None or len(values) == count)
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in values))

    return (isinstance(meta, dict) and isinstance(meta.get("dtype"), str) and sizes(meta.get("shape"))
            and sizes(meta.get("data_offsets"), 2) and meta["data_offsets"][0] <= meta["data_offsets"][1])


def read_checkpoint_index(path: Path) -> dict[str, TensorInfo]:
    """Every tensor of a safetensors checkpoint (single file or sharded with an index), validated."""
    _raise_if_two_layouts(path)
    if (path / SINGLE_FILE).is_file():
        return _read_header(path / SINGLE_FILE)
    if (path / INDEX_FILE).is_file():
        return _read_sharded(path)
    files = sorted(path.glob("*.safetensors"))
    if files:
        tensors: dict[str, TensorInfo] = {}
        for file in files:
            for name, info in _read_header(file).items():
                if name in tensors:  # no index says which file is the checkpoint's: refuse rather than pick one
                    raise CheckpointError(f"{path}: tensor {name!r} is stored in both {tensors[name].file.name} and "
                                          f"{file.name}, and no {SINGLE_FILE} or {INDEX_FILE} says which is the "
                                          "drafter's. Keep only the drafter's weight files in the folder.")
                tensors[name] = info
        return tensors
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    found = f"it has only {', '.join(pickles)}" if pickles else "it has no weight files"
    raise CheckpointError(f"{path} has no safetensors weights ({found}). hf-dspark loads safetensors only (pickled "
                          "weights can run code on load): re-save the drafter with save_pretrained(..., "
                          "safe_serialization=True) or convert it with safetensors.torch.save_file.")


def _raise_if_two_layouts(path: Path) -> None:
    """A folder with both a single weight file and a sharded checkpoint holds two drafters (transformers would load
    the single file, whichever is newer): refuse instead of loading one of them silently."""
    single, index = path / SINGLE_FILE, path / INDEX_FILE
    if single.is_file() and index.is_file():
        newer = max((single, index), key=lambda file: file.stat().st_mtime).name
        raise CheckpointError(f"{path} holds two checkpoints: {SINGLE_FILE} and a sharded one ({INDEX_FILE} and its "
                              f"shards; {newer} is the newer), so which weights are the drafter's is ambiguous. "
                              "Delete the stale one (DSparkDraftModel.save_pretrained removes it when it re-saves "
                              "into a folder).")


def remove_stale_weights(path: Path) -> None:
    """After transformers' ``save_pretrained`` into ``path``, delete what is left of an earlier save in the other
    layout: it keeps an old single file beside new shards, and an old index whose shards it deleted."""
    single, index = path / SINGLE_FILE, path / INDEX_FILE
    if not (single.is_file() and index.is_file()):
        return
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        shards = set()  # transformers writes a valid index: a broken one is the stale one
    stale = single if shards and all((path / shard).is_file() for shard in shards) else index
    stale.unlink()
    logger.info("Removed %s, left in %s by an earlier save in the other layout.", stale.name, path)


def _read_sharded(path: Path) -> dict[str, TensorInfo]:
    try:
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError(f"weight_map must map tensor names to shard file names, got {weight_map!r:.80}")
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path / INDEX_FILE} is corrupt (no valid 'weight_map'): {err}") from err
    headers = {}
    for shard in sorted(set(weight_map.values())):
        if not (path / shard).resolve().is_relative_to(path.resolve()):
            raise CheckpointError(f"{path / INDEX_FILE} names a shard outside the checkpoint folder ({shard!r}); "
                                  "shards are files inside it.")
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


def load_tensors(mapping: dict[str, str], tensors: dict[str, TensorInfo]) -> dict[str, torch.Tensor]:
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


def load_rows(name: str, info: TensorInfo, rows: list[int]) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(info.file), framework="pt") as handle:
        view = handle.get_slice(name)
        return torch.stack([view[row:row + 1][0] for row in rows])


# -------------------------------------------------------------------------------------------------------


def read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path} has no config.json.")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{file} is not valid JSON: {err}") from err


__all__ = ["CheckpointError", "INDEX_FILE", "SINGLE_FILE", "TensorInfo", "is_local_path", "load_rows", "load_tensors",
           "read_checkpoint_index", "read_config", "remove_stale_weights", "resolve_checkpoint_dir"]
