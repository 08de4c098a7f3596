"""Whether a drafter fits a target: every check between the two, at construction, binding, generate and loading.

A drafter computes with its target's frozen embedding and LM head, so it fits exactly one target. Why one module:
binding (``DSparkDraftModel.bind_target``), transformers' ``generate`` on a target never bound
(``generation/unbound_targets.py``) and loading (``checkpoint_loading.py``) must refuse the same targets with the
same messages, and the embedding signature stamped at construction must be computed the same way from a live target
and from a checkpoint's stored copy of the embedding.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from .checkpoint_files import CheckpointError, TensorInfo, load_rows
from .configuration import DSparkConfig
from .stored_vocabulary import DraftVocabulary

logger = logging.getLogger(__name__)


# -------------------------------------------------------------------------------------------------------
# Target identity: the embedding signature
# -------------------------------------------------------------------------------------------------------
_SIGNATURE_ROWS = 8
# Relative tolerance of a signature match: loose enough for the same embedding stored in another dtype (bf16
# rounding), tight enough for independently trained embeddings of the same shape.
_SIGNATURE_TOLERANCE = 2e-2


def _signature_rows(vocab_size: int) -> list[int]:
    """The embedding rows a signature reads: a few fixed rows spread over the vocabulary."""
    return torch.linspace(0, vocab_size - 1, _SIGNATURE_ROWS).long().tolist()


def _signature_of(rows: torch.Tensor) -> list[float]:
    """Rounded norms: a live embedding and a stored copy in another dtype give the same numbers."""
    return [round(float(x), 4) for x in rows.float().norm(dim=-1)]


def embedding_signature(target) -> list[float]:
    """Norms of a few fixed rows of the target's input embedding: cheap, dtype-robust target identity."""
    weight = target.get_input_embeddings().weight.detach()
    return _signature_of(weight[_signature_rows(weight.shape[0])])


def stored_embedding_signature(tensors: dict[str, TensorInfo], vocab_size: int | None) -> list[float] | None:
    """:func:`embedding_signature` of a checkpoint's stored copy of the target embedding (foreign dialects store
    one), read without loading the whole embedding; ``None`` without a full-vocabulary copy."""
    info = tensors.get("embed_tokens.weight")
    if info is None or len(info.shape) != 2 or info.shape[0] != vocab_size:
        return None
    return _signature_of(load_rows("embed_tokens.weight", info, _signature_rows(info.shape[0])))


# -------------------------------------------------------------------------------------------------------
# Binding (and transformers' generate on an unbound target)
# -------------------------------------------------------------------------------------------------------
def target_compute_dtype(target) -> torch.dtype:
    """The dtype a drafter must compute in for ``target``: its input embedding's (a quantized target keeps the
    embedding in floating point; its first parameter need not be)."""
    dtype = target.get_input_embeddings().weight.dtype
    if not dtype.is_floating_point:
        raise ValueError(f"The target's input embedding is {dtype}, not floating point: hf-dspark cannot tell which "
                         "dtype the drafter should compute in. Load the target with a floating-point embedding.")
    return dtype


def _describe_target(config: DSparkConfig) -> str:
    """The target a drafter was built for, for messages: its name, else its shapes (never "None")."""
    if config.target_name_or_path:
        return repr(config.target_name_or_path)
    tcfg = config.target_config
    return (f"an unnamed {tcfg.get('model_type', 'unknown')} target (hidden_size={tcfg.get('hidden_size')}, "
            f"{config.num_target_layers} layers, vocab_size={tcfg.get('vocab_size')})")


def raise_if_target_mismatch(config: DSparkConfig, target) -> None:
    """Refuse a target other than the one ``config``'s drafter was built for: its shapes, then (same shapes) its
    embedding signature. The messages name the target the drafter was built for."""
    tcfg = target.config.get_text_config()
    expected = config.target_config
    checks = [("model_type", tcfg.model_type, expected.get("model_type")),
              ("hidden_size", tcfg.hidden_size, expected.get("hidden_size")),
              ("num_hidden_layers", tcfg.num_hidden_layers, config.num_target_layers),
              ("vocab_size", target.get_input_embeddings().weight.shape[0], expected.get("vocab_size"))]
    for name, got, want in checks:
        if want is not None and got != want:
            raise ValueError(f"This drafter was built for a target with {name}={want}, but the given target has "
                             f"{name}={got}. Load the drafter that matches this target "
                             f"(this one was built for {_describe_target(config)}).")
    lm_rows = target.get_output_embeddings().weight.shape[0] if target.get_output_embeddings() is not None else None
    if lm_rows is not None and lm_rows != expected.get("vocab_size", lm_rows):
        raise ValueError(f"Target LM head has {lm_rows} rows but the drafter expects vocab_size="
                         f"{expected.get('vocab_size')}.")
    if config.target_embedding_signature:
        got_sig = embedding_signature(target)
        want_sig = config.target_embedding_signature
        if len(got_sig) == len(want_sig) and any(
                abs(a - b) > _SIGNATURE_TOLERANCE * max(abs(b), 1e-3) for a, b in zip(got_sig, want_sig)):
            raise ValueError(f"The target's embedding does not match the one this drafter was trained with "
                             f"({_describe_target(config)}): same shapes, different weights. "
                             "A drafter only fits the exact target it was trained for.")


def warn_if_logits_depend_on_chunking(target) -> None:
    """LLM.int8 with an outlier threshold picks fp16 outlier columns from all tokens of a forward call, so the
    8-bit target's logits for a token depend on how many tokens share its call. Verification runs γ+1 tokens
    per call where plain decoding runs one: near-ties can then resolve differently from plain 8-bit decoding.
    ``llm_int8_threshold=0`` quantizes every token on its own and makes both agree (tested)."""
    qcfg = getattr(target.config, "quantization_config", None)
    if qcfg is None:
        return
    get = qcfg.get if isinstance(qcfg, dict) else (lambda key, default=None: getattr(qcfg, key, default))
    threshold = get("llm_int8_threshold", 0.0) or 0.0
    if get("load_in_8bit", False) and threshold > 0:
        logger.warning(
            "This 8-bit bitsandbytes target uses llm_int8_threshold=%s: its outlier columns depend on the number "
            "of tokens per forward call, so speculative output can differ from plain 8-bit decoding at near-ties. "
            "Load it with BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0) for token-identical output.",
            threshold)


# -------------------------------------------------------------------------------------------------------
# Loading (DSparkDraftModel.from_pretrained(..., target=target))
# -------------------------------------------------------------------------------------------------------
def raise_if_dtype_conflicts(kwargs: dict, target) -> None:
    """An explicit ``dtype=`` / ``torch_dtype=`` that the target's dtype would override is refused, not ignored:
    a drafter computes with the target's embedding and LM head, so it always runs in the target's dtype."""
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


_LM_HEAD_CHECK_ROWS = 8


def raise_if_stored_lm_head_is_not_the_targets(model, tensors: dict[str, TensorInfo],
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
