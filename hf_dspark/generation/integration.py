"""Make the stock ``target.generate(..., assistant_model=draft)`` (and pipelines) use hf-dspark.

transformers chooses its assisted-generation path from generation-config flags, never from the assistant, and
that path refuses batch > 1. Binding a drafter to a target therefore installs one small, instance-scoped
wrapper around ``target.generate``: when the assistant is a DSpark drafter the call is forwarded to the stock
``generate`` with ``custom_generate=dspark_decode`` (a public transformers API), so all of transformers' input,
processor, stopping-criteria and cache preparation still runs; any other call goes to the original method
untouched. ``disable(target)`` removes the wrapper (and forgets what calls on the target shared).

A drafter bound to another target (or not at all) is bound to this one on first use, which casts it to the
target's dtype and device. A target without the wrapper reaches only the guard in ``unbound_targets.py``, which
refuses a drafter built for another target (naming both); a drafter that fits goes on to transformers, which asks
it for ``generation_config``, and the drafter answers with a ValueError that says to bind it.

DSpark-specific ``generate`` keywords (all optional):

* ``dspark_num_tokens`` (int >= 0): drafts proposed per round, at most the drafter's block size (default: the
  whole block). ``0`` = no drafting: the call decodes plainly (transformers' own loop, the same tokens as
  without ``assistant_model``; a ``dspark_recorder`` sees no rounds).
* ``dspark_confidence_threshold`` (finite float >= 0): a row's proposal stops at the first draft whose
  calibrated confidence is below it (default: the drafter config's ``confidence_threshold``); values above 1
  never draft.
* ``dspark_lookup`` (True / False / "only"); ``dspark_cache_salt`` (one string per user: calls on a target share
  their lookup history, scheduler and, at batch 1, their caches by default, so an agent's next turn prefills only
  its new tokens; calls with different salts share nothing); ``dspark_isolate`` (True: share nothing at all);
  ``dspark_prefix_cache`` (False: keep no caches): see ``generate.dspark_decode`` and ``speculation/shared_state.py``.
* ``dspark_cpu_linears`` (default None: where they measured faster than stock on this machine): on a CPU fp32
  target the loop runs its CPU kernels (``hf_dspark.cpu_kernels.loop_kernels``: skinny ``W @ xᵀ`` linears,
  GQA-folded attention); True always; False keeps stock ``F.linear`` and transformers' SDPA attention.
* ``generator`` (torch.Generator): seeds drafting and verification; ``dspark_recorder``: per-round records.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import numbers
import threading
import types
import warnings

import torch

from ..metrics import DSparkStats
from ..modeling.modeling import TARGET_BIND_HOOKS
from ..speculation.builder import raise_if_bad_lookup
from ..speculation.shared_state import forget
from .generate import SPENT_CACHE_MARK, dspark_decode, raise_if_bad_salt

logger = logging.getLogger(__name__)

_MARKER = "_hf_dspark_original_generate"
#: The DSpark keywords of ``generate`` (``dspark_decode``'s): plain decoding (``dspark_num_tokens=0``) has no use for
#: them, and transformers refuses a keyword its model does not take (a server passes its users' salts on every call).
_DSPARK_KWARGS = frozenset(name for name in inspect.signature(dspark_decode).parameters if name.startswith("dspark_"))
# Settings of transformers' own assisted generation, which a DSpark assistant replaces -> what to use instead
# (None: nothing; drop it). Ignored, they would change nothing the user asked for without saying so.
_ASSISTED_GENERATION_SETTINGS = {
    "num_assistant_tokens": "dspark_num_tokens (drafts per round)",
    "assistant_confidence_threshold": "dspark_confidence_threshold",
    "num_assistant_tokens_schedule": "dspark_policy (by default every round is planned on measured cost)",
    "prompt_lookup_num_tokens": "dspark_lookup (lookup proposals are on by default)",
    "max_matching_ngram_size": "dspark_lookup (lookup proposals are on by default)",
    "assistant_early_exit": None, "assistant_lookbehind": None, "target_lookbehind": None,
    "use_mtp": None,  # the target's multi-token-prediction heads as the assistant
}


def is_dspark_drafter(obj) -> bool:
    # duck typing: a drafter loaded through remote code is a different class object than ours
    return obj is not None and callable(getattr(obj, "draft_block", None)) and hasattr(obj, "extend_context")


#: Held while a wrapper is installed or removed. Why: two threads binding drafters to one target at once would both
#: find it unwrapped, and the second wrapper, saving the first as "the original", would recurse on every call (each
#: wrapper reads the original from the same slot of the target's __dict__).
_INSTALL_LOCK = threading.Lock()


def enable(target) -> None:
    """Install the generate wrapper on this target instance (idempotent, thread-safe)."""
    with _INSTALL_LOCK:
        if _MARKER not in target.__dict__:
            _install(target)


def _install(target) -> None:
    """The wrapper itself (see the module docstring); the caller holds ``_INSTALL_LOCK``."""
    # A method bound to the target, reading the original from the target's own __dict__, never a closure over
    # either: copy.deepcopy(target) rebinds both to the copy, where a closure kept generating with the weights of
    # the target it was copied from (plain calls too).
    @functools.wraps(type(target).generate)
    def generate(self, *args, assistant_model=None, streamer=None, generator=None, dspark_recorder=None, **kwargs):
        original = self.__dict__[_MARKER]
        if not is_dspark_drafter(assistant_model):
            if dspark_recorder is not None:
                raise ValueError("dspark_recorder= records speculative rounds; it needs a DSpark assistant_model.")
            _raise_if_spent_cache(kwargs)
            extra = {"generator": generator} if generator is not None else {}
            return original(*args, assistant_model=assistant_model, streamer=streamer, **extra, **kwargs)
        try:
            _raise_if_invalid_generate_kwargs(assistant_model, args, kwargs, streamer, generator)
            _raise_if_bad_settings(kwargs, generator, dspark_recorder)
            _bind_on_first_use(assistant_model, self)
            _warn_if_outputs_are_dropped(self, args, kwargs)
            if kwargs.get("dspark_num_tokens") == 0:  # no drafting: plain decoding, documented above
                raise_if_bad_salt(kwargs.get("dspark_cache_salt"), kwargs.get("dspark_isolate", False))
                raise_if_bad_lookup(kwargs.get("dspark_lookup", True))
                assistant_model.stats = DSparkStats.new(assistant_model.config.block_size)
                plain = {k: v for k, v in kwargs.items() if k not in _DSPARK_KWARGS}
                return original(*args, streamer=streamer, **plain)
            kwargs = _with_our_tokenizer(self, args, kwargs)
            # Streamer and generator travel under our own names: transformers drops a custom_generate callable's
            # arguments that its own _sample also takes (streamer), see _extract_generation_mode_kwargs.
            return original(*args, custom_generate=dspark_decode, dspark_drafter=assistant_model,
                            dspark_streamer=streamer, dspark_generator=generator, dspark_recorder=dspark_recorder,
                            dspark_callers_cache=_passed_cache(kwargs) is not None, **kwargs)
        except BaseException:
            # A consumer iterating a TextIteratorStreamer in another thread would otherwise block until its
            # timeout (or forever): end the stream, then let the error through.
            _end_stream(streamer)
            raise

    target.__dict__[_MARKER] = target.generate
    target.generate = types.MethodType(generate, target)


def disable(target) -> None:
    """Remove the wrapper installed by :func:`enable` and forget what calls on the target shared (prefix caches,
    lookup history, the schedulers' learning): a target handed back to plain ``generate`` keeps nothing of ours."""
    with _INSTALL_LOCK:
        if _MARKER in target.__dict__:
            del target.__dict__["generate"]
            del target.__dict__[_MARKER]
    forget(target)


def _raise_if_invalid_generate_kwargs(drafter, args: tuple, kwargs: dict, streamer, generator) -> None:
    """Refuse, before any decoding, what the speculative loop would crash on or silently misread."""
    if kwargs.get("custom_generate") is not None:
        raise ValueError("custom_generate cannot be combined with a DSpark assistant_model.")
    if kwargs.get("inputs_embeds") is not None:
        raise ValueError("inputs_embeds= is not supported with a DSpark assistant_model: the speculative loop prefills "
                         "the target from token ids, which the drafter and the lookup proposals read too (beside "
                         "input_ids the embeddings would be ignored). Pass input_ids, or drop assistant_model.")
    num_tokens = kwargs.get("dspark_num_tokens")
    block_size = drafter.config.block_size
    if num_tokens is not None:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, numbers.Integral) or not (
                0 <= num_tokens <= block_size):
            raise ValueError(f"dspark_num_tokens={num_tokens!r} must be an int in [0, {block_size}] (the drafter's "
                             "block_size): drafts proposed per round, 0 = no drafting (plain decoding).")
        if num_tokens == 0 and generator is not None:
            raise ValueError("generator= seeds DSpark's drafting and verification, but dspark_num_tokens=0 decodes "
                             "plainly through transformers, which samples from torch's global RNG: drop generator= "
                             "and call torch.manual_seed(...) instead.")
    threshold = kwargs.get("dspark_confidence_threshold")
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, numbers.Real)
                                  or not math.isfinite(threshold) or threshold < 0):
        raise ValueError(f"dspark_confidence_threshold={threshold!r} must be a finite number >= 0 (0 = always draft "
                         "the whole block; above 1 = never draft).")
    _raise_if_assisted_generation_settings(args, kwargs)
    _raise_if_other_positions(args, kwargs)
    _raise_if_spent_cache(kwargs)
    rows = _num_rows(args, kwargs)
    if streamer is not None and rows > 1:
        raise ValueError(f"streamer= supports batch size 1 only (as in transformers); got a batch of "
                         f"{rows}. Drop streamer= for batched generation.")


def _raise_if_bad_settings(kwargs: dict, generator, recorder) -> None:
    """The other keywords' types, named before decoding: inside the loop a wrong one crashed far from the call (a
    negative top-k, a recorder without ``observe_round``) or was read as true (``dspark_prefix_cache="no"``)."""
    from ..scheduling import SPSProfile, StepCostProfile

    top_k = kwargs.get("dspark_sequential_top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0):
        raise ValueError(f"dspark_sequential_top_k={top_k!r} must be an int >= 0 (0 = the whole draft vocabulary) "
                         "or None (the drafter config's).")
    linears = kwargs.get("dspark_cpu_linears")
    if linears is not None and not isinstance(linears, bool):
        raise ValueError(f"dspark_cpu_linears={linears!r} must be None, True or False.")
    prefix_cache = kwargs.get("dspark_prefix_cache", True)
    if not isinstance(prefix_cache, bool):
        raise ValueError(f"dspark_prefix_cache={prefix_cache!r} must be True or False.")
    cost = kwargs.get("dspark_step_cost")
    if cost is not None and not isinstance(cost, (StepCostProfile, SPSProfile)):
        raise ValueError(f"dspark_step_cost={cost!r} must be a StepCostProfile (hf_dspark.scheduling) or None "
                         "(measured on this machine).")
    if recorder is not None and not callable(getattr(recorder, "observe_round", None)):
        raise ValueError(f"dspark_recorder={recorder!r} has no observe_round(num_proposed, num_accepted, "
                         "num_committed, confidence_logits) method (e.g. hf_dspark.evaluation.RoundRecorder).")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator={generator!r} must be a torch.Generator (or None).")


def _num_rows(args: tuple, kwargs: dict) -> int:
    """The batch size of the call's input ids (1 when they are not a 2-D tensor: transformers will say why)."""
    inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    return inputs.shape[0] if isinstance(inputs, torch.Tensor) and inputs.dim() == 2 else 1


def _raise_if_other_positions(args: tuple, kwargs: dict) -> None:
    """``position_ids=`` other than those of the attention mask (each row's own tokens counted from 0). Why: plain
    generate prefills with the positions passed to it and counts on from their last one; the speculative loop
    derives every row's positions from its attention mask (prefill, drafter context, verification), so other
    positions were ignored and gave other tokens. Positions of masked (padding) slots are not read by either."""
    positions = kwargs.get("position_ids")
    inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if positions is None or not isinstance(inputs, torch.Tensor) or inputs.dim() != 2:
        return
    mask = kwargs.get("attention_mask")
    mask = torch.ones_like(inputs) if mask is None else mask.to(inputs.device).long()
    positions = torch.as_tensor(positions, device=inputs.device)
    same = positions.shape[-1] == mask.shape[-1] and positions.dim() <= 2 and positions.shape[:-1] in (
        (), (1,), mask.shape[:1])
    if same:
        same = bool(((positions == mask.cumsum(-1) - 1) | (mask == 0)).all())
    if not same:
        raise ValueError("position_ids= other than the attention mask's (each row's tokens at 0, 1, 2, ...) are not "
                         "supported with a DSpark assistant_model: the speculative loop derives positions from the "
                         "attention mask, so yours would be ignored. Drop position_ids (or assistant_model).")


def _passed_cache(kwargs: dict):
    """The cache the caller passed (``cache=`` or the older name ``past_key_values=``), if any."""
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


def _raise_if_spent_cache(kwargs: dict) -> None:
    """A cache that a batched DSpark call left behind (``generate._leave_callers_cache``), passed again: plain
    or speculative, the call would attend to rejected drafts' slots and miss the rows that finished early."""
    batch = getattr(_passed_cache(kwargs), SPENT_CACHE_MARK, None)
    if batch is not None:
        raise ValueError(f"This cache= (past_key_values=) was passed to a generate call with a DSpark "
                         f"assistant_model and a batch of {batch} rows, which leaves it holding rejected drafts' "
                         "slots and without the rows that finished early: it cannot continue a later call. Pass a "
                         "fresh cache (or none: the whole prompt is prefilled); at batch 1 a cache you pass in is "
                         "left as plain generate leaves it.")


def _raise_if_assisted_generation_settings(args: tuple, kwargs: dict) -> None:
    """Settings of transformers' assisted generation given to this call (keyword or ``generation_config=``; the
    target's own config is not this call's request), which the DSpark loop does not read."""
    config = _passed_config(args, kwargs)
    for name, instead in _ASSISTED_GENERATION_SETTINGS.items():
        value = kwargs[name] if name in kwargs else getattr(config, name, None)
        if value is not None and value is not False:  # use_mtp=False asks for nothing
            fix = f"use {instead} instead" if instead else "drop it"
            raise ValueError(f"{name}={value!r} tunes transformers' own assisted generation, which a DSpark "
                             f"assistant_model replaces (it would be ignored): {fix}.")


def _with_our_tokenizer(target, args: tuple, kwargs: dict) -> dict:
    """``tokenizer=`` under our own name, and stop strings as a stopping criterion built with it.

    Why: for a ``custom_generate`` callable transformers keeps only the keyword arguments ``_sample`` does not
    take, after it has already popped ``tokenizer`` (``_extract_generation_mode_kwargs``), so neither our loop
    nor its own ``StopStringCriteria`` would see the tokenizer, and stop strings would fail with "could not locate
    a tokenizer". The criterion built here is the one plain ``generate`` builds; transformers is told there are no
    stop strings left to build. Without a tokenizer nothing changes, and transformers raises its own error."""
    tokenizer = kwargs.get("tokenizer")
    if tokenizer is None:
        return kwargs
    kwargs = {k: v for k, v in kwargs.items() if k != "tokenizer"}
    kwargs["dspark_tokenizer"] = tokenizer
    stop_strings = _setting("stop_strings", target, args, kwargs)
    if stop_strings is not None:
        from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria

        criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
        criteria.append(StopStringCriteria(stop_strings=stop_strings, tokenizer=tokenizer))
        kwargs.update(stopping_criteria=criteria, stop_strings=None)
    return kwargs


def _bind_on_first_use(drafter, target) -> None:
    """A drafter bound elsewhere (or nowhere) serves this target once bound to it: shapes and embedding are
    checked and it is cast to the target's dtype/device (``bind_target`` logs that in one INFO line). So is a
    drafter moved or cast (``.to(...)``) after binding, which would otherwise fail inside a matmul."""
    weight, own = target.get_input_embeddings().weight, next(drafter.parameters(), None)
    moved = own is not None and (own.dtype, own.device) != (weight.dtype, weight.device)
    if moved or getattr(drafter, "_bound_target", [])[:1] != [target]:
        drafter.bind_target(target)


def _passed_config(args: tuple, kwargs: dict):
    """The GenerationConfig this call passed (keyword or generate's second positional argument), if any."""
    return kwargs.get("generation_config") or (args[1] if len(args) > 1 else None)


def _setting(name: str, target, args: tuple, kwargs: dict):
    """A generation setting as transformers will resolve it: keyword, then the passed config, then the target's."""
    if name in kwargs:
        return kwargs[name]
    config = _passed_config(args, kwargs) or target.generation_config
    return getattr(config, name, None)


def _warn_if_outputs_are_dropped(target, args: tuple, kwargs: dict) -> None:
    """Requested outputs the speculative loop does not produce: say so instead of returning ``None``."""
    as_dict = bool(_setting("return_dict_in_generate", target, args, kwargs))
    dropped = [name for name in ("output_hidden_states", "output_attentions")
               if as_dict and _setting(name, target, args, kwargs)]
    if dropped:
        warnings.warn(f"{' and '.join(dropped)} requested, but a DSpark assistant_model does not produce them "
                      "(verification runs several tokens per forward and discards rejected drafts): those output "
                      "fields stay None. Generate without assistant_model to get them.", UserWarning, stacklevel=3)
    rows = _num_rows(args, kwargs)
    if _passed_cache(kwargs) is not None and rows > 1:
        warnings.warn(f"The cache you passed in is left holding masked slots of rejected drafts and without the rows "
                      f"that finish early (a batch of {rows} with a DSpark assistant_model): it must not be passed to "
                      "a later call, which would be refused. At batch 1 it is left as plain generate leaves it.",
                      UserWarning, stacklevel=3)
    # plain generate returns its cache in a dict output unless use_cache is off (the default is on)
    elif as_dict and _setting("use_cache", target, args, kwargs) is not False:
        warnings.warn("The target cache is not handed back with a DSpark assistant_model: it holds masked slots of "
                      "rejected drafts, so the output has no past_key_values (a cache you pass in yourself at batch 1 "
                      "is left as plain generate leaves it).", UserWarning, stacklevel=3)


def _end_stream(streamer) -> None:
    if streamer is None:
        return
    try:
        streamer.end()
    except Exception:  # the original error matters more than a streamer that cannot end
        logger.debug("streamer.end() failed while handling an error", exc_info=True)


TARGET_BIND_HOOKS.append(enable)
