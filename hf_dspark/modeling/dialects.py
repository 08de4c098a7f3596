"""Checkpoint dialects: our own format plus the published layouts (DeepSpec, speculators, SpecForge / z-lab).

A dialect maps a foreign ``config.json`` to a :class:`DSparkConfig` and its tensor names to ours; nothing here
needs ``trust_remote_code``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def _resolve_dir(name_or_path, **kwargs) -> Path:
    path = Path(name_or_path)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(name_or_path), revision=kwargs.get("revision"),
                                  cache_dir=kwargs.get("cache_dir"), local_files_only=kwargs.get("local_files_only", False),
                                  allow_patterns=["*.json", "*.safetensors", "*.md"]))


def load_drafter(cls, name_or_path, *args, target=None, **kwargs):
    path = _resolve_dir(name_or_path, **kwargs)
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") == cls.config_class.model_type:
        model = cls._from_pretrained_native(path, *args, **kwargs)
    else:
        raise ValueError(f"{path} is not a checkpoint format hf-dspark can read (model_type="
                         f"{config.get('model_type')!r}, architectures={config.get('architectures')}).")
    if target is not None:
        param = next(target.parameters())
        model = model.to(device=param.device, dtype=param.dtype).bind_target(target)
    return model
