"""Loading a drafter of any dialect: plan the load from the config and the safetensors headers alone (what
``hf-dspark convert --check`` reports), then read exactly the mapped tensors into an empty model and bind the
target. Missing, unexpected and mis-shaped tensors are errors, never random initialisation."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .architectures import architecture_of
from .checkpoint_files import (
    CheckpointError,
    TensorInfo,
    load_rows,
    load_tensors,
    read_checkpoint_index,
    read_config,
    resolve_checkpoint_dir,
)
from .configuration import DSparkConfig
from .dialects import Dialect, DraftVocabulary, detect_dialect, resolve_draft_vocabulary

logger = logging.getLogger(__name__)

# -------------------------------------------------------------------------------------------------------
# Loading
# -------------------------------------------------------------------------------------------------------
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
    weight = load_rows("embed_tokens.weight", info, rows)
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


def _load_foreign(model, path: Path, dialect: Dialect, tensors, mapping, dtype,
                  vocabulary: DraftVocabulary | None = None):
    """Fill the empty drafter by assignment from the mapped tensors (no random initialisation anywhere)."""
    signature = _signature_from_checkpoint(tensors, model.config.target_config.get("vocab_size"))
    if signature is not None:
        model.config.target_embedding_signature = signature
    state = load_tensors(mapping, tensors)
    if vocabulary is not None:
        state["draft_to_target"] = vocabulary.ids.clone()
        if vocabulary.order is not None and "markov_head.markov_w2.weight" in state:
            # stored draft index order[j] is our (ascending) index j: permute the draft-vocabulary rows alike
            state["markov_head.markov_w2.weight"] = state["markov_head.markov_w2.weight"][vocabulary.order]
    model.load_state_dict(state, strict=True, assign=True)
    if dtype is not None and dtype != "auto":
        model = model.to(dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    model.config._name_or_path = str(path)
    logger.info("Loaded a %s-format drafter from %s (%d tensors, target tensors dropped).", dialect.name, path,
                len(mapping))
    return model.eval()


_LM_HEAD_CHECK_ROWS = 8


def _raise_if_stored_lm_head_is_not_the_targets(model, tensors: dict[str, TensorInfo],
                                                vocabulary: DraftVocabulary | None, path: Path) -> None:
    """A stored (draft) LM head must be the target's rows for the draft vocabulary: hf-dspark uses the target's
    own, so a drafter that trained its own head would draft differently. Compares a few spread rows."""
    info = tensors.get("lm_head.weight")
    head = model.target.get_output_embeddings()
    if info is None or head is None or len(info.shape) != 2:
        return
    ids = vocabulary.ids if vocabulary is not None else None
    rows_expected = ids.shape[0] if ids is not None else head.weight.shape[0]
    if info.shape[0] != rows_expected or info.shape[1] != head.weight.shape[1]:
        raise CheckpointError(f"{path}: the stored lm_head.weight has shape {tuple(info.shape)} but the draft "
                              f"vocabulary needs ({rows_expected}, {head.weight.shape[1]}) rows of the target's LM "
                              "head.")
    picks = torch.linspace(0, rows_expected - 1, min(_LM_HEAD_CHECK_ROWS, rows_expected)).long()
    stored_rows = picks if vocabulary is None or vocabulary.order is None else vocabulary.order[picks]
    stored = load_rows("lm_head.weight", info, stored_rows.tolist()).float()
    target_rows = (ids[picks] if ids is not None else picks).to(head.weight.device)
    want = head.weight.detach()[target_rows].float().cpu()
    # both rounded to bf16: equal copies in different dtypes agree, a different (trained) head does not
    a, b = stored.to(torch.bfloat16).float(), want.to(torch.bfloat16).float()
    if not torch.allclose(a, b, rtol=1e-2, atol=1e-2 * float(b.abs().max().clamp(min=1e-6))):
        raise CheckpointError(f"{path}: the stored lm_head.weight is not the target's LM head (rows of target ids "
                              f"{target_rows.tolist()[:4]}... differ). hf-dspark drafters use the target's own LM "
                              "head, so a drafter trained with its own head cannot be loaded exactly (or this is not "
                              "the target it was trained for).")


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
    config = dialect.build_config(raw, target)
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
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if vocabulary is not None:
        expected.pop("draft_to_target")  # built from d2t / t2d, not a stored tensor of that name
    mapping = _map_tensors(dialect, tensors, expected, path)
    return LoadPlan(path, raw, dialect, config, tensors, vocabulary, mapping, cls)


def load_drafter(cls, name_or_path, *args, target=None, **kwargs):
    """Load a drafter in any registered dialect and bind ``target`` (see ``DSparkDraftModel.from_pretrained``)."""
    if target is not None:
        _raise_if_dtype_conflicts(kwargs, target)
    plan = plan_load(cls, name_or_path, target=target, **kwargs)
    if plan.dialect.load_with_transformers:
        model = _load_native(plan.cls, plan.path, *args, **kwargs)
    else:
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        model = _load_foreign(_empty_model(plan.cls, plan.config), plan.path, plan.dialect, plan.tensors,
                              plan.mapping, dtype, plan.vocabulary)
    if target is not None:
        model = model.bind_target(target)  # casts to the target's dtype and device
        if not plan.dialect.load_with_transformers:
            _raise_if_stored_lm_head_is_not_the_targets(model, plan.tensors, plan.vocabulary, plan.path)
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
