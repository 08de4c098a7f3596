"""What a checkpoint is, before anything is loaded: ``describe_checkpoint(path)`` (CLI: ``hf-dspark convert --check``).

Runs exactly the checks ``DSparkDraftModel.from_pretrained`` runs (dialect detection, config mapping, safetensors
headers, d2t / t2d, tensor names and shapes) without reading a weight, and reports the dialect, architecture,
heads, vocabulary mapping, taps, block convention and drafting mode, what each stored tensor became, whether
the drafter can be exported to speculators / vLLM, and what is refused and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..modeling.architectures import architecture_of, has_sequential_head, method_label
from ..modeling.checkpoint_files import CheckpointError, read_config, resolve_checkpoint_dir
from ..modeling.checkpoint_loading import LoadPlan, plan_load
from ..modeling.dialects import detect_dialect
from ..modeling.modeling import DSparkDraftModel
from .export import speculators_export_problems


@dataclass
class CheckpointReport:
    """``describe_checkpoint``'s findings; ``str(report)`` is the printed report."""

    path: str
    loads: bool
    dialect: str | None = None
    facts: list[tuple[str, str]] = field(default_factory=list)  # (label, value), in print order
    refused: str | None = None  # why it cannot be loaded exactly (None when it loads)
    export: list[str] = field(default_factory=list)  # why it cannot be exported to speculators for vLLM (empty: it can)
    export_speculators_only: list[str] = field(default_factory=list)  # ... nor for the speculators library
    export_needs: list[str] = field(default_factory=list)  # what an export will ask for (--verifier, --target)

    def __str__(self) -> str:
        lines = [f"Checkpoint: {self.path}"]
        width = max([len(label) for label, _ in self.facts] + [len("loads")])
        lines += [f"  {label:<{width}}  {value}" for label, value in self.facts]
        if self.loads:
            lines.append(f"  {'loads':<{width}}  yes: DSparkDraftModel.from_pretrained(path, target=...) loads it "
                         "exactly")
            needs = f" with {' and '.join(self.export_needs)}" if self.export_needs else ""
            if not self.export:
                lines.append(f"  {'exports':<{width}}  to speculators / vLLM (hf-dspark convert SRC DST --to "
                             f"speculators{needs})")
            elif not self.export_speculators_only:
                lines.append(f"  {'exports':<{width}}  to the speculators library only (--no-vllm-check{needs}): "
                             + " ".join(self.export))
            else:
                lines.append(f"  {'exports':<{width}}  not to speculators: " + " ".join(self.export_speculators_only))
        else:
            lines.append(f"  {'loads':<{width}}  REFUSED: {self.refused}")
        return "\n".join(lines)


def _block_convention(config) -> str:
    lead = getattr(config, "num_unpredicted_slots", 0)
    if lead == 0:
        return (f"DeepSpec (the anchor slot predicts): block [anchor, MASK × {config.block_size - 1}], "
                f"{config.block_size} drafts per round")
    what = "the anchor slot predicts nothing" if lead == 1 else f"the first {lead} slots predict nothing"
    return (f"upstream DFlash ({what}; each mask slot drafts the token at its own position): block "
            f"[anchor, MASK × {config.block_slots - 1}] of {config.block_slots} slots, {config.block_size} drafts "
            "per round")


def _vocabulary(plan: LoadPlan) -> str:
    config = plan.config
    vocab = config.target_config.get("vocab_size")
    if config.draft_vocab_size is None:
        return f"the target's full vocabulary ({vocab} tokens)"
    if plan.vocabulary is not None:
        order = " (stored in another order: draft rows permuted on load)" if plan.vocabulary.order is not None else ""
        return (f"reduced: {config.draft_vocab_size} of {vocab} target tokens, read from {plan.vocabulary.source} "
                f"(target id = index + d2t[index]){order}")
    return f"reduced: {config.draft_vocab_size} of {vocab} target tokens (draft_to_target buffer)"


def _heads(config) -> str:
    if architecture_of(config).autoregressive:
        return f"none (autoregressive {method_label(config)}-style baseline)"
    if not has_sequential_head(config):
        head = "none (DFlash: every draft from its own slot's logits)"
    else:
        head = f"{config.sequential_head} (rank {config.markov_rank})"
    confidence = "confidence head [h_k ; W1[x_{k-1}]]" if config.use_confidence_head else "no confidence head"
    temps, _ = config.calibration_for(False)
    calibrated = ", STS-calibrated" if temps is not None else ""
    return f"sequential {head}; {confidence}{calibrated}"


def _drafting(config) -> str:
    if not has_sequential_head(config) or architecture_of(config).autoregressive:
        return "each draft from its own logits (no sequential head)"
    if not config.sequential_top_k:
        return "sequential bias over the full (draft) vocabulary, as the reference drafts"
    return (f"sequential bias on the base top-{config.sequential_top_k} only (a CPU speed option this checkpoint "
            "records; config.sequential_top_k = 0 drafts over the full vocabulary)")


def describe_plan(plan: LoadPlan) -> list[tuple[str, str]]:
    config, raw, tcfg = plan.config, plan.raw, plan.config.target_config
    stored = raw.get("speculators_model_type") or raw.get("model_type")
    arch = ", ".join(raw.get("architectures") or []) or "-"
    dropped = sorted(name for name in plan.tensors if plan.dialect.rename(name) is None)
    facts = [
        ("dialect", f"{plan.dialect.name} (config: {stored!r}, architectures: {arch})"),
        ("architecture", f"{config.drafter_architecture}: {config.num_hidden_layers} draft layer(s), "
                         f"{_layer_style(config)}, hidden {tcfg.get('hidden_size')}, "
                         f"{tcfg.get('num_attention_heads')} heads / {tcfg.get('num_key_value_heads')} kv heads"),
        ("heads", _heads(config)),
        ("vocabulary", _vocabulary(plan)),
        ("taps", f"decoder layers {config.target_layer_ids} of {config.num_target_layers} (hidden_states[i + 1]); "
                 f"stored as {plan.dialect.tap_convention}"),
        ("block", _block_convention(config)),
        ("drafting", _drafting(config)),
        ("target", f"{config.target_name_or_path or 'not recorded'}"),
        ("tensors", f"{len(plan.mapping)} drafter tensors"
                    + (f"; dropped (the target's, or the vocabulary mapping): {', '.join(dropped)}"
                       if dropped else "")),
    ]
    return facts


def _layer_style(config) -> str:
    """Which layer the drafter builds: its own Qwen3-style layer (what speculators / vLLM build) or its target's."""
    if config.draft_layer_style == "target":
        return f"{config.target_family}-style (the target family's layer)"
    return f"{config.draft_layer_style}-style (q/k norms) for a {config.target_family} target"


def describe_checkpoint(path, target=None, **kwargs) -> CheckpointReport:
    """Report on a drafter checkpoint (a directory or Hub id) without loading its weights; see the module docstring.

    ``target`` is needed only for formats that do not record the target's shape (transformers' DFlash assistants)
    or its layer count (some DeepSpec configs); the report says so when it is missing.
    """
    try:
        plan = plan_load(DSparkDraftModel, path, target=target, **kwargs)
    except (CheckpointError, FileNotFoundError, ValueError) as err:
        dialect = None
        try:
            dialect = detect_dialect(read_config(resolve_checkpoint_dir(path, **kwargs)), path).name
        except Exception:  # the report names the first problem either way
            pass
        facts = [("dialect", dialect)] if dialect else []
        return CheckpointReport(str(path), loads=False, dialect=dialect, facts=facts, refused=str(err))
    needs = []
    if not plan.config.target_name_or_path and not getattr(target, "name_or_path", None):
        needs.append("--verifier ORG/TARGET (no target name recorded)")
    if plan.config.draft_vocab_size is not None:
        needs.append("--target (a reduced vocabulary exports the target LM head's rows)")
    return CheckpointReport(str(path), loads=True, dialect=plan.dialect.name, facts=describe_plan(plan),
                            export=speculators_export_problems(plan.config),
                            export_speculators_only=speculators_export_problems(plan.config, vllm_servable=False),
                            export_needs=needs)
