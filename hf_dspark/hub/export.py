"""Export a drafter to the speculators format (what vLLM's DSpark / DFlash methods load) and convert between formats.

This is the way past one machine: train and evaluate with hf-dspark, serve at scale with vLLM. What is written
(speculators ``DSparkSpeculatorConfig`` / ``DFlashSpeculatorConfig``; vLLM reads it through its speculators config
loader):

- ``config.json``: ``speculators_model_type`` (``"dspark"``, or ``"dflash"`` for a drafter without a sequential
  head), ``speculators_config`` (algorithm, one greedy proposal method with ``speculative_tokens`` = drafts per
  round, the verifier), ``transformer_layer_config`` (the target's text config with ``num_hidden_layers`` = draft
  layers, all full attention), ``draft_vocab_size``, ``block_size`` (backbone slots: drafts + unpredicted
  slots), ``target_hidden_size``, ``aux_hidden_state_layer_ids``, ``mask_token_id``, ``sample_from_anchor``,
  ``markov_rank``, ``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov: true``; plus an
  ``hf_dspark`` block (calibration, top-k, target identity) that speculators and vLLM ignore and our reader
  restores, so a round trip loses nothing.
- ``model.safetensors``: our tensor names, which are speculators' names. The target's embedding and LM head are
  left out by default (vLLM shares the target's own when they are absent). A reduced draft vocabulary
  (``draft_vocab_size`` < vocabulary) is written as speculators and vLLM read it: ``d2t`` (int64, one per draft
  token, target id = index + ``d2t[index]``), ``t2d`` (bool over the target vocabulary) and ``lm_head.weight``
  (the target LM head's rows for the draft vocabulary, which vLLM requires for a reduced vocabulary), so the
  drafter must be bound to its target to be exported.

Conventions (SPEC §6, ``modeling/dialects.py``): speculators stores ``hidden_states`` indices, so
``aux_hidden_state_layer_ids`` = our 0-based decoder-layer ids + 1; ``sample_from_anchor: true`` is the DeepSpec
block convention (slot k of [anchor, MASK × (γ-1)] drafts position p+k+1, ``num_unpredicted_slots = 0``) and
``sample_from_anchor: false`` the upstream DFlash one (``num_unpredicted_slots = 1``).

The verifier (``speculators_config.verifier.name_or_path``, how ``vllm serve`` pairs the drafter with its target)
is required: ``verifier_name_or_path=`` (CLI ``--verifier``), else the target the drafter records
(``config.target_name_or_path``), else the bound target's ``name_or_path``; an export with none of them is refused.

What the format or vLLM cannot express exactly is refused with :class:`SpeculatorsExportError` rather than written
for vLLM to misread: speculators and vLLM build every draft layer as a Qwen3 layer (per-head q/k RMSNorm, one
``attention_bias`` for q/k/v/o, bias-free MLP), so only drafters with Qwen3-style layers export (every new drafter
has them, ``DSparkConfig.draft_layer_style``; older ones of non-Qwen3 targets do not); a DFlash drafter
with the DeepSpec convention (the anchor slot predicts) is not what vLLM's ``dflash`` method runs
(``sample_from_anchor=false``); and vLLM's DSpark runtime implements only the vanilla Markov head drafting from
the anchor slot (gated / rnn heads, and DSpark with the upstream convention, need ``vllm_servable=False``).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch

from ..modeling.architectures import architecture_of, has_sequential_head
from ..modeling.configuration import DSparkConfig
from ..modeling.families import PORTABLE_LAYER_STYLE, TARGET_LAYER_STYLE
from ..modeling.modeling import DSparkDraftModel

logger = logging.getLogger(__name__)

SPECULATORS_MODEL_TYPE = "dspark"
# The speculators release whose DSpark / DFlash configs this layout follows and that loads it in
# scripts/check_speculators_interop.py (vllm-project/speculators on PyPI).
SPECULATORS_VERSION = "0.9.0"
HF_DSPARK_KEY = "hf_dspark"
_HEAD_TYPES = {"markov": "vanilla", "gated": "gated", "rnn": "rnn"}
_VLLM_HEAD_TYPES = ("vanilla",)
DFLASH_MODEL_TYPE = "dflash"
# Every tensor name speculators' DSpark model (Qwen3 DFlash backbone + heads) defines, minus the target's and the
# vocabulary mapping (our draft_to_target buffer, written as d2t / t2d).
_SPECULATORS_TENSORS = re.compile(
    r"(fc|hidden_norm|norm)\.weight"
    r"|layers\.\d+\.(self_attn\.[qkvo]_proj\.(weight|bias)|self_attn\.[qk]_norm\.weight"
    r"|mlp\.(gate|up|down)_proj\.weight|(input|post_attention)_layernorm\.weight)"
    r"|markov_head\.(markov_w1|markov_w2)\.weight|markov_head\.(gate_proj|joint_proj)\.(weight|bias)"
    r"|confidence_head\.proj\.(weight|bias)")


class SpeculatorsExportError(ValueError):
    """The drafter cannot be written in the speculators format without changing what vLLM would compute."""


# -------------------------------------------------------------------------------------------------------
# What can be exported
# -------------------------------------------------------------------------------------------------------
def _layer_family_problem(config: DSparkConfig, vllm_servable: bool) -> str | None:
    if draft_layer_family(config) == PORTABLE_LAYER_STYLE:
        return None
    return (f"its draft layers follow its {config.target_family!r} target (draft_layer_style='target': no per-head "
            "q/k RMSNorm), but speculators and vLLM build every DSpark draft layer as a Qwen3 layer with q/k norms, "
            "so vLLM would run different layers than the ones trained. Drafters built with Qwen3-style layers "
            "(DSparkDraftModel.from_target's default, draft_layer_style='qwen3') export for any target; serve this "
            "one with hf-dspark (target.generate(..., assistant_model=draft)).")


def draft_layer_family(config: DSparkConfig) -> str:
    """The family whose layer the drafter's backbone builds (its style, or its target's family)."""
    style = getattr(config, "draft_layer_style", TARGET_LAYER_STYLE)
    return config.target_family if style == TARGET_LAYER_STYLE else style


def _head_problem(config: DSparkConfig, vllm_servable: bool) -> str | None:
    unpredicted = getattr(config, "num_unpredicted_slots", 0)
    if not has_sequential_head(config):
        if unpredicted == 1 or not vllm_servable:
            return None
        return ("it is a DFlash drafter (sequential_head='none') using the DeepSpec convention (the anchor slot "
                "predicts too); vLLM's 'dflash' method expects sample_from_anchor=false and its 'dspark' method needs "
                "a Markov head, so no vLLM method would read it exactly. Pass vllm_servable=False (CLI: "
                "--no-vllm-check) to write it for the speculators library (dflash, sample_from_anchor=true).")
    if unpredicted not in (0, 1):
        return f"it has {unpredicted} unpredicted block slots; speculators expresses 0 or 1 (sample_from_anchor)."
    if unpredicted and config.sequential_head == "rnn":
        return ("its rnn head starts its state at the first draft, while speculators (sample_from_anchor=false) runs "
                "it through the unpredicted anchor slot too, so speculators would compute a different bias.")
    if vllm_servable and _HEAD_TYPES[config.sequential_head] not in _VLLM_HEAD_TYPES:
        return (f"its sequential head is {config.sequential_head!r}, and vLLM's DSpark runtime implements only the "
                "vanilla Markov head (sequential_head='markov'). Pass vllm_servable=False (CLI: --no-vllm-check) to "
                "write it anyway for the speculators library.")
    if vllm_servable and unpredicted:
        return ("it is a DSpark drafter with the upstream DFlash block convention (the anchor slot predicts nothing), "
                "and vLLM's DSpark runtime drafts from the anchor slot (sample_from_anchor=true). Pass "
                "vllm_servable=False (CLI: --no-vllm-check) to write it for the speculators library.")
    return None


def _architecture_problem(config: DSparkConfig, vllm_servable: bool) -> str | None:
    if architecture_of(config).exports_to_speculators:
        return None
    return (f"it is hf-dspark's {config.drafter_architecture!r} baseline, whose layer and tensor layout are ours, not "
            "speculators' Eagle3 checkpoint layout; it is a baseline for comparisons, served with "
            "target.generate(..., assistant_model=draft).")


# Each check returns a reason (completing "cannot be exported: ...") or None; add new limits here.
EXPORT_CHECKS: list[Callable[[DSparkConfig, bool], str | None]] = [_architecture_problem, _layer_family_problem,
                                                                    _head_problem]


def speculators_export_problems(config: DSparkConfig, vllm_servable: bool = True) -> list[str]:
    """Why ``config``'s drafter cannot be exported exactly (empty when it can)."""
    return [reason for check in EXPORT_CHECKS if (reason := check(config, vllm_servable)) is not None]


def _raise_if_not_exportable(draft, vllm_servable: bool) -> None:
    problems = speculators_export_problems(draft.config, vllm_servable)
    if problems:
        raise SpeculatorsExportError("This drafter cannot be exported to the speculators format: "
                                     + " Also, ".join(problems))
    unknown = sorted(name for name in draft.state_dict()
                     if name != "draft_to_target" and not _SPECULATORS_TENSORS.fullmatch(name))
    if unknown:
        raise SpeculatorsExportError(f"This drafter has tensors {unknown[:8]} that speculators' DSpark model has no "
                                     "parameter for; it cannot be exported exactly.")


# -------------------------------------------------------------------------------------------------------
# Config
# -------------------------------------------------------------------------------------------------------
def _transformer_layer_config(config: DSparkConfig, dtype: torch.dtype) -> dict:
    """The target's text config reshaped into speculators' draft-layer config (num_hidden_layers = draft layers)."""
    layer = dict(config.target_config)
    layer.update(model_type=draft_layer_family(config), num_hidden_layers=config.num_hidden_layers,
                 layer_types=["full_attention"] * config.num_hidden_layers, use_sliding_window=False,
                 max_window_layers=config.num_hidden_layers, dtype=str(dtype).removeprefix("torch."))
    return layer


def _hf_dspark_block(config: DSparkConfig) -> dict:
    """Our settings speculators has no field for; ``dialects.py`` reads them back (vLLM ignores them)."""
    from ..version import __version__

    return {"hf_dspark_version": __version__, "num_target_layers": config.num_target_layers,
            "target_model_type": config.target_family,
            "draft_layer_style": getattr(config, "draft_layer_style", TARGET_LAYER_STYLE),
            "target_name_or_path": config.target_name_or_path,
            "target_embedding_signature": config.target_embedding_signature,
            "confidence_temperatures": config.confidence_temperatures,
            "confidence_offsets": config.confidence_offsets,
            "greedy_confidence_temperatures": getattr(config, "greedy_confidence_temperatures", None),
            "greedy_confidence_offsets": getattr(config, "greedy_confidence_offsets", None),
            "confidence_threshold": config.confidence_threshold, "sequential_top_k": config.sequential_top_k}


def speculators_model_type(config: DSparkConfig) -> str:
    """``"dspark"`` for drafters with a sequential head, ``"dflash"`` for those without."""
    return SPECULATORS_MODEL_TYPE if has_sequential_head(config) else DFLASH_MODEL_TYPE


def resolve_verifier(config: DSparkConfig, verifier_name_or_path: str | None = None, target=None) -> str:
    """The verifier name vLLM pairs the drafter with: explicit, else the recorded target, else the bound one."""
    bound = getattr(target, "name_or_path", None) if target is not None else None
    name = verifier_name_or_path or config.target_name_or_path or bound or None
    if not name:
        raise SpeculatorsExportError(
            "No verifier is known for this drafter (it records no target name and none was given): pass "
            "verifier_name_or_path= (CLI: --verifier ORG/TARGET), the target vLLM will verify with. speculators "
            "and `vllm serve` pair the drafter with its verifier through speculators_config.verifier.name_or_path.")
    return str(name)


def speculators_config(config: DSparkConfig, *, dtype: torch.dtype = torch.float32,
                       verifier_name_or_path: str | None = None,
                       verifier_architectures: list[str] | None = None) -> dict:
    """The speculators ``config.json`` for a drafter with ``config`` (see the module docstring)."""
    kind = speculators_model_type(config)
    unpredicted = getattr(config, "num_unpredicted_slots", 0)
    proposal = {"proposal_type": "greedy", "speculative_tokens": config.block_size, "verifier_accept_k": 1,
                "accept_tolerance": 0.0}
    verifier = {"name_or_path": resolve_verifier(config, verifier_name_or_path),
                "architectures": list(verifier_architectures or [])}
    out = {
        "architectures": ["DSparkSpeculator" if kind == SPECULATORS_MODEL_TYPE else "DFlashSpeculator"],
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {"algorithm": kind, "proposal_methods": [proposal],
                               "default_proposal_method": "greedy", "verifier": verifier},
        "transformer_layer_config": _transformer_layer_config(config, dtype),
        "draft_vocab_size": config.num_draft_tokens,
        "block_size": config.block_size + unpredicted,  # backbone slots; speculative tokens = block_size - unpredicted
        "target_hidden_size": config.target_hidden_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],  # hidden_states index = layer + 1
        "mask_token_id": config.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": unpredicted == 0,
    }
    if kind == SPECULATORS_MODEL_TYPE:
        out.update(markov_rank=config.markov_rank, markov_head_type=_HEAD_TYPES[config.sequential_head],
                   enable_confidence_head=bool(config.use_confidence_head), confidence_head_with_markov=True)
    out.update({"dtype": str(dtype).removeprefix("torch."), HF_DSPARK_KEY: _hf_dspark_block(config)})
    return out


def vocabulary_tensors(draft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``d2t``, ``t2d`` and the draft ``lm_head.weight`` of a reduced-vocabulary drafter, as speculators and vLLM
    read them (empty for a full-vocabulary drafter)."""
    ids = getattr(draft, "draft_to_target", None)
    if ids is None:
        return {}
    if not draft._bound_target:
        raise SpeculatorsExportError(
            "This drafter proposes a reduced draft vocabulary, whose export carries the target LM head's rows for it "
            "(vLLM requires lm_head.weight for a reduced vocabulary): bind it to its target first "
            "(DSparkDraftModel.from_pretrained(path, target=target); CLI: --target).")
    ids = ids.detach().long().cpu()
    vocab = draft.config.target_config["vocab_size"]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    head = draft.target.get_output_embeddings().weight.detach()
    return {"d2t": (ids - torch.arange(ids.shape[0])).contiguous(), "t2d": t2d,
            "lm_head.weight": head[ids.to(head.device)].to(dtype).contiguous().cpu()}


# -------------------------------------------------------------------------------------------------------
# Writing
# -------------------------------------------------------------------------------------------------------
def _target_tensors(draft) -> dict[str, torch.Tensor]:
    target = draft.target  # raises a clear error when unbound
    embed = target.get_input_embeddings().weight.detach()
    head = target.get_output_embeddings().weight.detach()
    # safetensors refuses shared storage (tied embeddings): store two copies, as speculators does
    return {"embed_tokens.weight": embed.clone(), "lm_head.weight": head.clone()}


def save_as_speculators(draft, out_dir: str | os.PathLike, *, verifier_name_or_path: str | None = None,
                        include_target_weights: bool = False, vllm_servable: bool = True) -> Path:
    """Write ``draft`` as a speculators-format DSpark (or DFlash) checkpoint that vLLM loads (``vllm serve out_dir``).

    ``verifier_name_or_path``: the target vLLM verifies with; default the target the drafter records, else the
    bound target's name; one of them is required. ``include_target_weights`` also stores the target's embedding
    and LM head (self-contained, larger; a reduced vocabulary always stores the LM head's draft rows).
    ``vllm_servable=False`` allows layouts only the speculators library implements (gated / rnn heads, DFlash with
    the anchor slot predicting, DSpark with it not predicting).
    Raises :class:`SpeculatorsExportError` for drafters the format cannot express exactly.
    """
    from safetensors.torch import save_file

    _raise_if_not_exportable(draft, vllm_servable)
    dtype = next(draft.parameters()).dtype
    bound = draft._bound_target[0] if draft._bound_target else None
    architectures = list(getattr(bound.config, "architectures", None) or []) if bound is not None else []
    verifier = resolve_verifier(draft.config, verifier_name_or_path, bound)
    config = speculators_config(draft.config, dtype=dtype, verifier_name_or_path=verifier,
                                verifier_architectures=architectures)
    state = {name: tensor.detach().contiguous().cpu() for name, tensor in draft.state_dict().items()
             if name != "draft_to_target"}
    if include_target_weights:
        state.update({name: t.to(dtype).contiguous().cpu() for name, t in _target_tensors(draft).items()})
    state.update(vocabulary_tensors(draft, dtype))  # reduced vocabulary: d2t, t2d and the draft LM head rows
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=False) + "\n")
    logger.info("Wrote a speculators-format %s drafter (%d tensors) to %s", config["speculators_model_type"],
                len(state), out)
    return out


def _save_native(draft, out_dir: str | os.PathLike, **kwargs) -> Path:
    if kwargs:
        raise TypeError(f"Options {sorted(kwargs)} apply to the speculators format only.")
    draft.save_pretrained(out_dir)
    return Path(out_dir)


# Output formats of convert_checkpoint, by name.
CHECKPOINT_WRITERS: dict[str, Callable[..., Path]] = {"native": _save_native, "speculators": save_as_speculators}


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, to: str = "speculators", target=None,
                       **writer_kwargs) -> Path:
    """Read a drafter in any format hf-dspark loads (ours, DeepSpec, speculators, SpecForge / z-lab, transformers'
    DFlash assistants) and write it as ``to``.

    ``target`` is needed when the source does not record the target's shape or layer count (transformers' DFlash
    assistants, some DeepSpec configs), for a reduced-vocabulary export (its LM head rows are written) and for
    ``include_target_weights=True``; its name is also the verifier when neither ``verifier_name_or_path`` nor the
    drafter names one.
    """
    try:
        writer = CHECKPOINT_WRITERS[to]
    except KeyError:
        raise ValueError(f"to={to!r} is not one of {sorted(CHECKPOINT_WRITERS)}.") from None
    draft = DSparkDraftModel.from_pretrained(src, target=target)
    return writer(draft, dst, **writer_kwargs)
