"""Drafter architectures: what each one is and supports, in one registry instead of name checks across the code.

Each drafter class registers itself (``register_drafter_architecture``) with the facts other layers ask about:
whether the serving engine can run it, whether it exports to speculators' layout, whether it is autoregressive
(its context needs the token after every committed position), how it is named in reports, and whether it trains
with DSpark's three-term loss or with cross-entropy only (the baselines).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DrafterArchitecture:
    """``DSparkConfig.drafter_architecture`` -> the class and its capabilities."""

    name: str
    model_class: type
    servable: bool = True  # DSparkEngine can run it (the shared round)
    exports_to_speculators: bool = False  # hub.export can write speculators' layout for it
    autoregressive: bool = False  # one pass per draft; extend_context reads next_ids
    fuses_context: bool = False  # draft_block(new_context=) projects committed context in the drafting pass
    label: str | None = None  # name in reports; None = by head ("DSpark" with a sequential head, "DFlash" without)
    baseline_loss: bool = False  # trains with cross-entropy only, whatever its head


_ARCHITECTURES: dict[str, DrafterArchitecture] = {}


def register_drafter_architecture(architecture: DrafterArchitecture, *, overwrite: bool = False) -> None:
    if not architecture.name or not isinstance(architecture.name, str):
        raise ValueError(f"a drafter architecture needs a non-empty name, got {architecture.name!r}")
    if architecture.name in _ARCHITECTURES and not overwrite:
        raise ValueError(f"drafter architecture {architecture.name!r} is already registered")
    _ARCHITECTURES[architecture.name] = architecture


def available_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def architecture_of(config) -> DrafterArchitecture:
    """The registered architecture a drafter config names (ValueError naming the known ones otherwise)."""
    return architecture_named(getattr(config, "drafter_architecture", "block"))


def architecture_named(name: str) -> DrafterArchitecture:
    if name not in _ARCHITECTURES:
        raise ValueError(f"drafter_architecture={name!r} is not registered; known: {available_architectures()}")
    return _ARCHITECTURES[name]


def raise_if_built_by_another_class(model_class: type, config) -> None:
    """Refuse building ``config``'s drafter with a class registered for another architecture (e.g.
    ``DSparkDraftModel.from_target(target, drafter_architecture="eagle3")``): the layers would not be the ones the
    config names, and the saved checkpoint could not be loaded back."""
    registered = {architecture.model_class for architecture in _ARCHITECTURES.values()}
    own = next((cls for cls in model_class.__mro__ if cls in registered), None)
    wanted = architecture_of(config).model_class
    if own is not None and own is not wanted:
        raise ValueError(f"drafter_architecture={config.drafter_architecture!r} is built by {wanted.__name__}, not "
                         f"{model_class.__name__}: call {wanted.__name__}.from_target(...) (from_pretrained picks the "
                         "class itself).")


def has_sequential_head(config) -> bool:
    return getattr(config, "sequential_head", "none") != NO_SEQUENTIAL_HEAD


def method_label(config) -> str:
    """'DSpark', 'DFlash' (block drafter without a sequential head) or the architecture's own label (Eagle3)."""
    label = architecture_of(config).label
    if label is not None:
        return label
    return "DSpark" if has_sequential_head(config) else "DFlash"


def uses_baseline_loss(config) -> bool:
    """Cross-entropy only (the DFlash and Eagle3 baselines) instead of DSpark's CE + TV + confidence loss."""
    return architecture_of(config).baseline_loss or not has_sequential_head(config)


#: ``sequential_head`` value of a block drafter without a sequential head (the DFlash baseline)
NO_SEQUENTIAL_HEAD = "none"

__all__ = ["DrafterArchitecture", "NO_SEQUENTIAL_HEAD", "architecture_named", "architecture_of", "available_architectures",
           "has_sequential_head", "method_label", "raise_if_built_by_another_class", "register_drafter_architecture",
           "uses_baseline_loss"]
