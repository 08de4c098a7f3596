"""Targets no drafter was ever bound to: refuse a drafter built for another target before transformers misreads it.

Such a target has no hf-dspark wrapper on its ``generate`` (integration.py installs one per target, at binding), so
transformers' own assisted generation runs, and it compares vocabulary sizes before it asks the drafter anything: a
drafter built for another vocabulary was reported as a model with another tokenizer ("provide `tokenizer` and
`assistant_tokenizer`"), which points at mixed-tokenizer decoding instead of at the drafter. One guard on
``GenerationMixin.generate`` runs the check ``bind_target`` runs (``raise_if_target_mismatch``: the drafter's target
and this one, and what to load instead) first. A drafter that fits passes through unchanged: transformers then asks
it for ``generation_config`` and it says to bind it (``DSparkDraftModel.generation_config``). Calls on wrapped
targets, and calls without a DSpark drafter, are not checked here.
"""

from __future__ import annotations

import functools
import inspect

from transformers import GenerationMixin

from ..modeling.configuration import DSparkConfig
from ..modeling.target_compatibility import raise_if_target_mismatch
from .integration import _MARKER, is_dspark_drafter

_GUARD_MARKER = "_hf_dspark_unbound_target_guard"


def guard_unbound_targets() -> None:
    """Install the guard on ``GenerationMixin.generate`` (idempotent)."""
    generate = GenerationMixin.generate
    if getattr(generate, _GUARD_MARKER, False):
        return
    # generate(self, inputs, generation_config, ..., assistant_model, ...): where assistant_model sits in *args
    names = list(inspect.signature(generate).parameters)
    position = names.index("assistant_model") - 1 if "assistant_model" in names else len(names)

    @functools.wraps(generate)
    def guarded(self, *args, **kwargs):
        drafter = kwargs.get("assistant_model", args[position] if len(args) > position else None)
        # a remote-code drafter's config is another class: it keeps transformers' own path, as before
        if is_dspark_drafter(drafter) and _MARKER not in self.__dict__ and isinstance(drafter.config, DSparkConfig):
            raise_if_target_mismatch(drafter.config, self)
        return generate(self, *args, **kwargs)

    setattr(guarded, _GUARD_MARKER, True)
    GenerationMixin.generate = guarded


guard_unbound_targets()
