"""Make the stock ``target.generate(..., assistant_model=draft)`` (and pipelines) use hf-dspark.

transformers chooses its assisted-generation path from generation-config flags, never from the assistant, and
that path refuses batch > 1. Binding a drafter to a target therefore installs one small, instance-scoped
wrapper around ``target.generate``: when the assistant is a DSpark drafter the call is forwarded to the stock
``generate`` with ``custom_generate=dspark_decode`` (a public transformers API), so all of transformers' input,
processor, stopping-criteria and cache preparation still runs; any other call goes to the original method
untouched. ``disable(target)`` removes the wrapper.
"""

from __future__ import annotations

import functools

from ..modeling.modeling import TARGET_BIND_HOOKS
from .generate import dspark_decode

_MARKER = "_hf_dspark_original_generate"


def is_dspark_drafter(obj) -> bool:
    # duck typing: a drafter loaded through remote code is a different class object than ours
    return obj is not None and callable(getattr(obj, "draft_block", None)) and hasattr(obj, "extend_context")


def enable(target) -> None:
    """Install the generate wrapper on this target instance (idempotent)."""
    if _MARKER in target.__dict__:
        return
    original = target.generate

    @functools.wraps(original)
    def generate(*args, assistant_model=None, streamer=None, generator=None, dspark_recorder=None, **kwargs):
        if not is_dspark_drafter(assistant_model):
            if dspark_recorder is not None:
                raise ValueError("dspark_recorder= records speculative rounds; it needs a DSpark assistant_model.")
            extra = {"generator": generator} if generator is not None else {}
            return original(*args, assistant_model=assistant_model, streamer=streamer, **extra, **kwargs)
        if kwargs.get("custom_generate") is not None:
            raise ValueError("custom_generate cannot be combined with a DSpark assistant_model.")
        # Streamer and generator travel under our own names: transformers drops a custom_generate callable's
        # arguments that its own _sample also takes (streamer), see _extract_generation_mode_kwargs.
        return original(*args, custom_generate=dspark_decode, dspark_drafter=assistant_model,
                        dspark_streamer=streamer, dspark_generator=generator, dspark_recorder=dspark_recorder,
                        **kwargs)

    target.__dict__[_MARKER] = original
    target.generate = generate


def disable(target) -> None:
    """Remove the wrapper installed by :func:`enable`."""
    if _MARKER in target.__dict__:
        del target.__dict__["generate"]
        del target.__dict__[_MARKER]


TARGET_BIND_HOOKS.append(enable)
