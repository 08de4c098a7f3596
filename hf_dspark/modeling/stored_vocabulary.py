"""A checkpoint's stored reduced vocabulary (d2t / t2d) normalised to ours, before any weight is read.

Speculators, SpecForge and EAGLE-style checkpoints store ``d2t`` (long, one per draft token: the target id is
``draft index + d2t[index]``) and ``t2d`` (bool over the target vocabulary); the draft vocabulary is ``t2d``'s true
entries in ascending order. We keep those target ids as ``draft_to_target``. Apart from the dialects because the
mapping is read from the tensors, not the config, and only for dialects that define it (``Dialect.vocab_mapping``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checkpoint_files import CheckpointError, TensorInfo
from .configuration import DSparkConfig
from .dialects import VOCAB_MAPPING_TENSORS, Dialect


@dataclass(frozen=True)
class DraftVocabulary:
    """A stored d2t / t2d mapping normalised to ours: ``ids`` are the target ids of the draft vocabulary in
    ascending order (our ``draft_to_target``; ``None`` when the mapping is the full vocabulary) and ``order``
    the stored draft index of each of them (identity unless the checkpoint's ids were not ascending)."""

    ids: torch.Tensor | None
    order: torch.Tensor | None
    source: str  # which tensors it was read from, for describe_checkpoint


def _read_small(name: str, info: TensorInfo) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(info.file), framework="pt") as handle:
        return handle.get_tensor(name)


def resolve_draft_vocabulary(dialect: Dialect, raw: dict, config: DSparkConfig,
                             tensors: dict[str, TensorInfo]) -> DraftVocabulary | None:
    """Read and check a foreign checkpoint's reduced vocabulary; ``None`` when it predicts the full one."""
    vocab = config.target_config.get("vocab_size")
    present = [name for name in VOCAB_MAPPING_TENSORS if name in tensors]
    declared = raw.get("draft_vocab_size")
    if present and not dialect.vocab_mapping:
        raise CheckpointError(f"This {dialect.name} checkpoint stores {present}, which its format does not define.")
    if not present:
        if declared is not None and vocab is not None and int(declared) < vocab:
            raise CheckpointError(f"config.json declares draft_vocab_size={declared} < vocab_size={vocab} but the "
                                  "checkpoint stores no d2t / t2d mapping, so the draft tokens' target ids are "
                                  "unknown.")
        return None
    for name in present:
        if tensors[name].dtype not in ("I64", "I32", "I16", "U8", "BOOL", "I8"):
            raise CheckpointError(f"Tensor {name!r} has dtype {tensors[name].dtype}; d2t / t2d are integer / bool.")
    t2d = _read_small("t2d", tensors["t2d"]).bool() if "t2d" in tensors else None
    if t2d is not None and (t2d.dim() != 1 or (vocab is not None and t2d.shape[0] != vocab)):
        raise CheckpointError(f"t2d has shape {tuple(t2d.shape)}; it must be one flag per target token ({vocab}).")
    if "d2t" in tensors:
        d2t = _read_small("d2t", tensors["d2t"]).long()
        if d2t.dim() != 1:
            raise CheckpointError(f"d2t has shape {tuple(d2t.shape)}; it must be one offset per draft token.")
        stored_ids = torch.arange(d2t.shape[0]) + d2t  # EAGLE / speculators / vLLM: target id = index + d2t[index]
    else:  # t2d alone: the draft vocabulary is its true entries, ascending (how every producer builds d2t)
        stored_ids = t2d.nonzero().flatten()
    size = stored_ids.shape[0]
    if declared is not None and int(declared) != size:
        raise CheckpointError(f"config.json declares draft_vocab_size={declared} but d2t/t2d hold {size} tokens.")
    ids, order = stored_ids.sort()
    if size == 0 or (vocab is not None and (ids[0] < 0 or ids[-1] >= vocab)) or bool((ids[1:] == ids[:-1]).any()):
        raise CheckpointError(f"d2t maps draft tokens to invalid or repeated target ids (must be unique, in [0, "
                              f"{vocab})).")
    if t2d is not None and not torch.equal(t2d.nonzero().flatten(), ids):
        raise CheckpointError("d2t and t2d disagree: the target ids d2t maps to are not exactly t2d's true entries.")
    source = "+".join(present)
    if vocab is not None and size == vocab:  # a full-vocabulary mapping (speculators accepts and ignores these)
        if not torch.equal(order, torch.arange(size)):
            raise CheckpointError("d2t permutes the full vocabulary; only identity full-vocabulary mappings load.")
        return None
    return DraftVocabulary(ids=ids, order=None if torch.equal(order, torch.arange(size)) else order, source=source)
