"""Loading a drafter of any dialect: plan the load from the config and the safetensors headers alone (what
``hf-dspark convert --check`` reports), then read exactly the mapped tensors into an empty model and bind the
target. Missing, unexpected and mis-shaped tensors are errors, never random initialisation."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError

from .architectures import architecture_of
from .checkpoint_files import (
    CheckpointError,
    TensorInfo,
    load_tensors,
    read_checkpoint_index,
    read_config,
    resolve_checkpoint_dir,
)
from .configuration import DSparkConfig
from .dialects import Dialect, detect_dialect
from .stored_vocabulary import DraftVocabulary, resolve_draft_vocabulary
from .target_compatibility import (
    raise_if_dtype_conflicts,
    raise_if_stored_lm_head_is_not_the_targets,
    stored_embedding_signature,
)

logger = logging.getLogger(__name__)


def _is_floating(safetensors_dtype: str) -> bool:
    return safetensors_dtype.startswith(("F", "BF"))  # F64 / F32 / F16 / BF16 / F8_*


def _map_tensors(dialect: Dialect, tensors: dict[str, TensorInfo], expected: dict[str, tuple[int, ...]],
                 path: Path, floating: frozenset[str] = frozenset()) -> dict[str, str]:
    """our name -> stored name, after checking the mapped names and shapes equal the drafter's parameters (and that
    the ``floating`` ones are stored as floating point)."""
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
        if ours in floating and not _is_floating(tensors[stored].dtype):
            # loading would cast the integers to float silently: a quantized or damaged file, not these weights
            raise CheckpointError(f"{where}: tensor {stored!r} is stored as {tensors[stored].dtype} but the drafter's "
                                  "parameter is floating point (a quantized or damaged file?). Load a full-precision "
                                  "checkpoint (F32, F16 or BF16), e.g. one written by save_pretrained.")
    return mapping


def _empty_model(cls, config: DSparkConfig):
    """The drafter with parameters on the meta device (buffers real): shapes for free, filled by assignment."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return cls(config)


def _load_native(cls, path: Path, *args, **kwargs):
    """Our format through transformers, after our checks; refuse anything transformers had to initialise."""
    model, info = cls._from_pretrained_native(path, *args, output_loading_info=True, **kwargs)
    problems = {key: info.get(key) for key in ("missing_keys", "mismatched_keys", "unexpected_keys", "error_msgs")}
    problems = {key: sorted(map(str, value)) for key, value in problems.items() if value}
    if problems:
        raise CheckpointError(f"{path}: transformers reported {problems} while loading; refusing a partially "
                              "initialised drafter.")
    return model


def _raise_if_bad_draft_vocabulary(model, path: Path) -> None:
    """The stored draft vocabulary must be what ``set_draft_vocabulary`` writes: out-of-range ids crashed deep inside
    drafting with an IndexError, repeated ids would give one target token two rows of q."""
    ids = getattr(model, "draft_to_target", None)
    if ids is None or not ids.numel():
        return
    vocab = model.config.target_config["vocab_size"]
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or bool((ids[1:] <= ids[:-1]).any()):
        raise CheckpointError(f"{path}: draft_to_target must hold strictly ascending target token ids in [0, {vocab}) "
                              f"(got min {int(ids.min())}, max {int(ids.max())}); the file is damaged. Re-save the "
                              "drafter (set_draft_vocabulary checks the ids).")


# from_pretrained keywords a foreign checkpoint (filled by assignment, not by transformers) honours ...
_FOREIGN_OPTIONS = frozenset({"dtype", "torch_dtype", "device_map", "subfolder", "revision", "cache_dir",
                              "local_files_only", "token", "force_download"})
# ... and those that have nothing to change there: no remote code runs, nothing is initialised lazily or randomly,
# only safetensors are read, and the drafter's own attention runs whatever the implementation asked for
_FOREIGN_NO_OPS = frozenset({"trust_remote_code", "low_cpu_mem_usage", "use_safetensors", "attn_implementation"})


def _raise_if_foreign_options_ignored(dialect: Dialect, args: tuple, kwargs: dict) -> None:
    """transformers applies other keywords (config overrides, quantization, ...) to our own format; a foreign one
    would drop them silently, so they are refused by name (a typo too, as transformers' TypeError does)."""
    unknown = sorted(set(kwargs) - _FOREIGN_OPTIONS - _FOREIGN_NO_OPS)
    if args or unknown:
        what = f"positional arguments {args!r}" if args else f"keyword argument(s) {unknown}"
        raise TypeError(f"from_pretrained() got {what}, which a {dialect.name}-format drafter does not take (it "
                        f"accepts {sorted(_FOREIGN_OPTIONS)}). Config fields of a foreign checkpoint come from its "
                        "config.json: convert it (hf-dspark convert SRC DST --to native) to override them.")


def _resolve_dtype(dtype) -> torch.dtype | None:
    """transformers' ``dtype`` / ``torch_dtype`` values: a torch dtype, its name, or "auto" / None (as stored)."""
    if dtype is None or dtype == "auto":
        return None
    resolved = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"dtype={dtype!r} is not a torch dtype: pass e.g. torch.bfloat16, 'bfloat16' or 'auto'.")
    return resolved


def _resolve_device(device_map, dialect: Dialect) -> torch.device | None:
    """The one device a foreign drafter is put on: a device (name or index), ``{"": device}``, or "auto" (the first
    GPU when there is one). A drafter is small and runs beside its target, so it is never split."""
    if device_map is None:
        return None
    if isinstance(device_map, dict) and set(device_map) == {""}:
        device_map = device_map[""]
    if device_map == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if isinstance(device_map, (str, int, torch.device)) and not isinstance(device_map, bool):
        try:
            return torch.device(device_map)
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"device_map={device_map!r} is not a device: {err}") from err
    raise ValueError(f"device_map={device_map!r}: a {dialect.name}-format drafter loads on one device; pass a "
                     "device ('cuda:0', 'cpu'), {'': device} or 'auto' (it moves to its target's device when bound).")


def _load_foreign(model, path: Path, dialect: Dialect, tensors, mapping, dtype,
                  vocabulary: DraftVocabulary | None = None, device: torch.device | None = None):
    """Fill the empty drafter by assignment from the mapped tensors (no random initialisation anywhere)."""
    signature = stored_embedding_signature(tensors, model.config.target_config.get("vocab_size"))
    if signature is not None:
        model.config.target_embedding_signature = signature
    state = load_tensors(mapping, tensors)
    if vocabulary is not None:
        state["draft_to_target"] = vocabulary.ids.clone()
        if vocabulary.order is not None and "markov_head.markov_w2.weight" in state:
            # stored draft index order[j] is our (ascending) index j: permute the draft-vocabulary rows alike
            state["markov_head.markov_w2.weight"] = state["markov_head.markov_w2.weight"][vocabulary.order]
    model.load_state_dict(state, strict=True, assign=True)
    if dtype is not None or device is not None:
        model = model._cast_to(dtype, device)
    model.config._name_or_path = str(path)
    logger.info("Loaded a %s-format drafter from %s (%d tensors, target tensors dropped).", dialect.name, path,
                len(mapping))
    return model.eval()


def _build_config(dialect: Dialect, raw: dict, target, path: Path) -> DSparkConfig:
    """The dialect's config, or one :class:`CheckpointError` naming the file: a missing or wrongly typed field
    must not surface as a bare KeyError / TypeError from deep inside a dialect or transformers."""
    try:
        return dialect.build_config(raw, target)
    except (ValueError, KeyError, TypeError, AttributeError, StrictDataclassError) as err:
        # StrictDataclassError: transformers' config validators (a mistyped key of a stored layer config)
        reason = f"it has no field {err.args[0]!r}" if type(err) is KeyError else " ".join(str(err).split())
        reason = reason if reason.endswith((".", "!", "?")) else reason + "."
        raise CheckpointError(f"{path / 'config.json'} ({dialect.name} format) is not a valid drafter config: "
                              f"{reason} Fix that field, or re-save the drafter from its original checkpoint."
                              ) from err


@dataclass
class LoadPlan:
    """Everything known about a checkpoint before its weights are read (``describe_checkpoint`` reports it)."""

    path: Path
    raw: dict
    dialect: Dialect
    config: DSparkConfig
    tensors: dict[str, TensorInfo]
    vocabulary: DraftVocabulary | None
    mapping: dict[str, str]
    cls: type


def plan_load(cls, name_or_path, target=None, **kwargs) -> LoadPlan:
    """Resolve, read and check a checkpoint's config and tensor layout; raises :class:`CheckpointError`."""
    path = resolve_checkpoint_dir(name_or_path, **kwargs)
    raw = read_config(path)
    dialect = detect_dialect(raw, path)
    config = _build_config(dialect, raw, target, path)
    architecture_class = architecture_of(config).model_class
    cls = cls if issubclass(cls, architecture_class) else architecture_class
    tensors = read_checkpoint_index(path)
    dialect.check_tensors(raw, tensors)
    vocabulary = None
    if not dialect.load_with_transformers:
        vocabulary = resolve_draft_vocabulary(dialect, raw, config, tensors)
        if vocabulary is not None:
            config.draft_vocab_size = int(vocabulary.ids.shape[0])
    model = _empty_model(cls, config)
    state = model.state_dict()
    expected = {name: tuple(t.shape) for name, t in state.items()}
    floating = frozenset(name for name, t in state.items() if t.is_floating_point())
    if vocabulary is not None:
        expected.pop("draft_to_target")  # built from d2t / t2d, not a stored tensor of that name
    mapping = _map_tensors(dialect, tensors, expected, path, floating)
    return LoadPlan(path, raw, dialect, config, tensors, vocabulary, mapping, cls)


def from_pretrained_any_dialect(cls, name_or_path, *args, target=None, **kwargs):
    """``DSparkDraftModel.from_pretrained``: load a drafter checkpoint in any registered dialect (ours through
    transformers, the others by assignment) and bind ``target``."""
    output_loading_info = bool(kwargs.pop("output_loading_info", False))
    if target is not None:
        raise_if_dtype_conflicts(kwargs, target)
    plan = plan_load(cls, name_or_path, target=target, **kwargs)
    kwargs.pop("subfolder", None)  # plan.path already is the subfolder: transformers must not append it again
    if plan.dialect.load_with_transformers:
        model = _load_native(plan.cls, plan.path, *args, **kwargs)
    else:
        _raise_if_foreign_options_ignored(plan.dialect, args, kwargs)
        dtype = _resolve_dtype(kwargs.get("dtype", kwargs.get("torch_dtype")))
        device = _resolve_device(kwargs.get("device_map"), plan.dialect)
        model = _load_foreign(_empty_model(plan.cls, plan.config), plan.path, plan.dialect, plan.tensors,
                              plan.mapping, dtype, plan.vocabulary, device)
    _raise_if_bad_draft_vocabulary(model, plan.path)
    if target is not None:
        model = model.bind_target(target)  # casts to the target's dtype and device
        if not plan.dialect.load_with_transformers:
            raise_if_stored_lm_head_is_not_the_targets(model, plan.tensors, plan.vocabulary, plan.path)
    if output_loading_info:
        # transformers' (model, info) contract; every load here is strict, so nothing is missing or mismatched
        return model, {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    return model

