"""Prefilled target features kept on disk, so that a training run prefills each conversation once, not every epoch.

Why: in the continuous run the target's prefill (and the log-normaliser over its full vocabulary) costs more than
the drafter's own training step, and the run reads the same conversations epoch after epoch. The memo is a
folder of one small safetensors file per conversation, named by a hash of its tokens, so it needs no index, grows
as a regeneration adds conversations, survives a crash (files appear whole through an atomic rename) and can be
deleted at any time (it is rebuilt on demand). Its cost is disk: about 7 KB a token for a 576-wide target with five
tapped layers, so ``max_bytes`` caps it (past the cap, conversations are prefilled as before and not stored).

Entries live under a sub-folder named by everything that makes features differ (target weights, tapped layers,
the prefilling model's precision, storage dtype): a memo never hands features of one target or recipe to another.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

MEMO_FORMAT = 1
FEATURE_KEYS = ("target_hidden_states", "target_last_hidden_states", "target_logsumexp")


def memo_signature(target, feature_target, layer_ids: list[int], feature_dtype: torch.dtype,
                   logsumexp: bool) -> dict:
    """What the stored features depend on, beside the tokens themselves."""
    tcfg = target.config.get_text_config()
    return {"memo_format": MEMO_FORMAT, "target": getattr(target.config, "_name_or_path", "") or tcfg.model_type,
            "num_hidden_layers": tcfg.num_hidden_layers, "hidden_size": tcfg.hidden_size,
            "weights_fingerprint": weights_fingerprint(target),
            "prefill_dtype": str(next(feature_target.parameters()).dtype), "layer_ids": list(layer_ids),
            "feature_dtype": str(feature_dtype), "logsumexp": bool(logsumexp),
            "head_dtype": str(target.get_output_embeddings().weight.dtype)}


def weights_fingerprint(model) -> str:
    """A hash of every parameter tensor's norm: a fine-tune that changed one layer (or merged a LoRA) differs, and
    it costs one pass over the weights (tens of milliseconds for a 135M target) once per dataset."""
    with torch.no_grad():
        norms = [f"{name}:{float(p.detach().float().norm()):.6g}" for name, p in sorted(model.named_parameters())]
    return hashlib.sha1("\n".join(norms).encode()).hexdigest()[:16]


class FeatureMemo:
    """One conversation's prefilled tensors per file under ``root``/<signature hash>/ (see the module docstring)."""

    def __init__(self, root: str | os.PathLike, signature: dict, max_bytes: int | None = None):
        blob = json.dumps(signature, sort_keys=True)
        self.dir = Path(root) / hashlib.sha1(blob.encode()).hexdigest()[:12]
        self.dir.mkdir(parents=True, exist_ok=True)
        sig_file = self.dir / "signature.json"
        if not sig_file.is_file():
            sig_file.write_text(json.dumps(signature, indent=1, sort_keys=True) + "\n")
        self.max_bytes = max_bytes
        self.used_bytes = sum(p.stat().st_size for p in self.dir.glob("*/*.safetensors"))
        self.hits = self.misses = 0
        self._full_logged = False

    def _path(self, input_ids: list[int], loss_mask: list[int]) -> Path:
        key = hashlib.sha1(torch.tensor(input_ids, dtype=torch.int64).numpy().tobytes()
                           + torch.tensor(loss_mask, dtype=torch.int8).numpy().tobytes()).hexdigest()
        return self.dir / key[:2] / f"{key[2:]}.safetensors"

    def load(self, input_ids: list[int], loss_mask: list[int]) -> dict[str, torch.Tensor] | None:
        """The stored tensors for these tokens, or None (absent, or unreadable: then deleted and recomputed)."""
        path = self._path(input_ids, loss_mask)
        if not path.is_file():
            self.misses += 1
            return None
        try:
            tensors = load_file(path)
            if any(t.shape[0] != len(input_ids) for t in tensors.values()):
                raise ValueError("stored length differs from the tokens")
        except (SafetensorError, ValueError, OSError) as err:
            logger.warning("Feature memo entry %s is unreadable (%s): prefilling again", path, err)
            path.unlink(missing_ok=True)
            self.misses += 1
            return None
        self.hits += 1
        return tensors

    def store(self, input_ids: list[int], loss_mask: list[int], item: dict[str, torch.Tensor]) -> bool:
        """Keep ``item``'s feature tensors unless the memo is full; returns whether they were written."""
        tensors = {k: item[k].contiguous() for k in FEATURE_KEYS if k in item}
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.max_bytes is not None and self.used_bytes + size > self.max_bytes:
            if not self._full_logged:
                logger.warning("Feature memo %s reached its cap (%.1f GB): further conversations are prefilled "
                               "on every read", self.dir, self.max_bytes / 1e9)
                self._full_logged = True
            return False
        path = self._path(input_ids, loss_mask)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file(tensors, tmp)
        os.replace(tmp, path)  # whole or absent: a crash mid-write leaves only a stray .tmp
        self.used_bytes += path.stat().st_size
        return True


__all__ = ["FeatureMemo", "memo_signature", "weights_fingerprint"]
