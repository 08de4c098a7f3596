"""Requests of the serving engine: sampling parameters, the engine-side state, and the caller's handle.

Threading model: the engine loop is the only writer of a request's tokens and state; callers read them through
a :class:`RequestHandle` from any thread. Every write happens under the request's condition variable, which
also wakes streaming readers. Cancellation is a flag the engine honours at its next step boundary, so a
cancelled request's output is always a prefix of what it would have produced.
"""

from __future__ import annotations

import enum
import itertools
import numbers
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields

import numpy as np
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

_REQUEST_IDS = itertools.count()
# what torch.Generator.manual_seed accepts (a seed outside it raised inside the engine, after validation)
_SEED_RANGE = (-(2**63), 2**64 - 1)


class RequestRejectedError(ValueError):
    """A request the engine will not serve (raised by ``submit``): malformed input, or limits it can never fit."""


def new_request_id() -> str:
    """An id for a request submitted without one (unique in this process among the ids chosen here)."""
    return f"req-{next(_REQUEST_IDS)}"


def encode_prompt(prompt, tokenizer, vocab_size: int) -> list[int]:
    """Token ids of a prompt given as ids (list / 1-D tensor / [1, n] tensor), text or chat messages, validated
    here so that a bad request is refused at ``submit`` instead of failing the engine step it would join."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() > 2 or (prompt.dim() == 2 and prompt.shape[0] != 1):
            raise RequestRejectedError(f"a prompt tensor must be 1-D or [1, n], got shape {tuple(prompt.shape)}; "
                                       "submit one request per row")
        if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
            raise RequestRejectedError(f"prompt token ids must be integers, got a {prompt.dtype} tensor")
        ids = prompt.reshape(-1).tolist()
    elif isinstance(prompt, str) or (isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], Mapping)):
        if tokenizer is None:
            raise ValueError("text and chat prompts need DSparkEngine(..., tokenizer=tokenizer); or submit ids.")
        if isinstance(prompt, str):
            ids = list(tokenizer(prompt)["input_ids"])
        else:
            encoded = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
            ids = list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)
    elif isinstance(prompt, Sequence):
        ids = list(prompt)
    else:
        raise RequestRejectedError(f"unsupported prompt type {type(prompt).__name__}: give token ids, text or chat "
                                   "messages")
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
    if bad is not None:
        raise RequestRejectedError(f"prompt token ids must be ints, got {bad!r} ({type(bad).__name__})")
    out_of_range = [int(t) for t in ids if not 0 <= int(t) < vocab_size]
    if out_of_range:
        raise RequestRejectedError(f"prompt token id {out_of_range[0]} is outside the target's vocabulary "
                                   f"[0, {vocab_size}) ({len(out_of_range)} such ids)")
    return [int(t) for t in ids]


def target_stop_token_ids(target) -> set[int]:
    """The target's own end-of-sequence ids (its generation config's, else its config's): requests stop at them
    unless they give their own."""
    eos = getattr(target.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(target.config.get_text_config(), "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


# Settings of a target's generation config that change plain ``generate``'s greedy tokens and the engine does not
# apply (a request's settings are its SamplingParams), with their neutral values.
_UNAPPLIED_GENERATION_SETTINGS = {
    "repetition_penalty": (1.0,), "no_repeat_ngram_size": (0,), "bad_words_ids": (), "min_length": (0,),
    "min_new_tokens": (0,), "forced_bos_token_id": (), "forced_eos_token_id": (), "suppress_tokens": (),
    "begin_suppress_tokens": (), "sequence_bias": (), "exponential_decay_length_penalty": (), "stop_strings": (),
    "guidance_scale": (1.0,), "num_beams": (1,), "max_time": (),
}


def unapplied_generation_settings(target) -> dict[str, object]:
    """The target's generation-config settings (non-neutral) that plain ``generate`` applies and the engine does
    not: where there are any, the engine's greedy tokens may differ from plain greedy's."""
    config = getattr(target, "generation_config", None)
    found = {}
    for name, neutral in _UNAPPLIED_GENERATION_SETTINGS.items():
        value = getattr(config, name, None)
        if value is None or value in neutral or (isinstance(value, (list, tuple, dict, str)) and not value):
            continue
        found[name] = value
    return found


def stop_token_ids(eos_token_id, default: set[int], vocab_size: int) -> set[int]:
    """A request's stop tokens: its ``eos_token_id`` (an int or a list of ints, numpy / torch integers too; an empty
    list never stops early), or ``default`` (the target's) when None. An id outside the vocabulary is refused: the
    target can never emit it, so the request would silently never stop there."""
    if eos_token_id is None:
        return set(default)
    if isinstance(eos_token_id, torch.Tensor) and not (eos_token_id.is_floating_point() or eos_token_id.is_complex()
                                                       or eos_token_id.dtype == torch.bool):
        eos_token_id = eos_token_id.reshape(-1).tolist()
    ids = [eos_token_id] if not isinstance(eos_token_id, (list, tuple, set)) else list(eos_token_id)
    if any(isinstance(e, (bool, np.bool_)) or not isinstance(e, numbers.Integral) for e in ids):
        raise RequestRejectedError(f"eos_token_id must be an int or a list of ints, got {eos_token_id!r}")
    outside = [int(e) for e in ids if not 0 <= int(e) < vocab_size]
    if outside:
        raise RequestRejectedError(f"eos_token_id {outside[0]} is outside the target's vocabulary [0, {vocab_size}): "
                                   "the request could never stop at it")
    return {int(e) for e in ids}


def raise_if_never_fits(ids: list[int], params: SamplingParams, max_request_tokens: int, max_positions: int) -> None:
    """Refuse a request no engine step could ever serve: an empty prompt, or prompt + max_new_tokens beyond the
    engine's ``max_request_tokens`` or the target's positions."""
    problem = None
    if not ids:
        problem = "the prompt is empty"
    elif len(ids) + params.max_new_tokens > max_request_tokens:
        problem = (f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
                   f"max_request_tokens={max_request_tokens}; shorten the prompt, lower max_new_tokens "
                   "or raise DSparkEngine(max_request_tokens=...)")
    elif len(ids) + params.max_new_tokens > max_positions:
        problem = (f"prompt + max_new_tokens = {len(ids) + params.max_new_tokens} exceeds the target's "
                   f"max_position_embeddings={max_positions}")
    if problem is not None:
        raise RequestRejectedError(f"request rejected: {problem}")


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an end-of-sequence token was generated (and is part of the output)
    LENGTH = "length"  # max_new_tokens reached
    CANCELLED = "cancelled"  # handle.cancel()
    ABORTED = "aborted"  # the engine stopped before the request finished
    ERROR = "error"  # the engine step failed; the handle re-raises the error


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings.

    Args:
        max_new_tokens (`int`, defaults to 64): tokens to generate at most (EOS included).
        do_sample (`bool`, defaults to False): sample (lossless speculative sampling) instead of greedy decoding.
        temperature (`float`, defaults to 1.0), top_k (`int`, defaults to None), top_p (`float`, defaults to None):
            sampling warpers, applied identically to the target's p and the drafter's q (ignored when greedy;
            ``temperature=0`` only there).
        seed (`int`, defaults to None): seeds the request's own generator (drafting, verification and the
            first token), so a seeded request never consumes other requests' randomness. Under ``none`` and
            ``fixed`` its output is then the same whatever runs beside it; under ``threshold`` (whose drafting stops
            when every row has stopped) and the load-aware ``scheduled`` / ``scheduled-async`` how many drafts it
            draws and verifies depends on its neighbours, and with it where each random number is used: the output
            distribution is unchanged, the exact sample is not.
        eos_token_id (`int | list[int]`, defaults to None = the target's generation config): stop tokens;
            an empty list never stops early.
        cache_salt (`str`, defaults to None): requests share lookup history (drafts copied from each other's
            earlier output: an agent's turns) and prefix caches by default; requests with different salts never
            do. Give each user / tenant its own salt: acceptance timing and cache hits can reveal another's text.
        isolate (`bool`, defaults to False): share nothing: no lookup history or prefix cache read or written.
    """

    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    eos_token_id: int | Sequence[int] | None = None
    cache_salt: str | None = None
    isolate: bool = False

    def __post_init__(self):
        # None only where it means "off" (top_k, top_p, seed): a None limit or temperature failed a comparison
        for name, optional in (("max_new_tokens", False), ("top_k", True), ("seed", True)):
            value = getattr(self, name)
            if (value is not None or not optional) and (isinstance(value, bool)
                                                        or not isinstance(value, numbers.Integral)):
                raise RequestRejectedError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
        for name, optional in (("temperature", False), ("top_p", True)):
            value = getattr(self, name)
            if (value is not None or not optional) and (isinstance(value, bool)
                                                        or not isinstance(value, numbers.Real)):
                raise RequestRejectedError(f"{name} must be a real number, got {value!r}")
        for name in ("do_sample", "isolate"):
            # a truthy string ("no") or None would pass for a mode and fail inside a shared step or isolate silently
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise RequestRejectedError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
            object.__setattr__(self, name, bool(value))
        if self.seed is not None and not _SEED_RANGE[0] <= self.seed <= _SEED_RANGE[1]:
            raise RequestRejectedError(f"seed must be in [{_SEED_RANGE[0]}, {_SEED_RANGE[1]}] (torch.Generator's "
                                       f"range), got {self.seed}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        # temperature 0 is greedy's own (vLLM's and OpenAI's way of asking for it): ignored with do_sample=False
        if not (self.temperature > 0 or (self.temperature == 0 and not self.do_sample)):
            raise ValueError(f"temperature must be > 0 (use do_sample=False for greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 or None disables it), got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise RequestRejectedError(f"cache_salt must be a string (one per user or tenant) or None, got "
                                       f"{self.cache_salt!r}")
        if self.isolate and self.cache_salt is not None:
            raise RequestRejectedError("isolate=True shares nothing, so a cache_salt has nothing to separate: give "
                                       "one or the other.")

    def logits_processors(self) -> LogitsProcessorList:
        """The warpers plain ``generate(do_sample=True, ...)`` would build, in the same order."""
        processors = LogitsProcessorList()
        if not self.do_sample:
            return processors
        if self.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k:
            processors.append(TopKLogitsWarper(self.top_k))
        if self.top_p is not None and self.top_p < 1.0:
            processors.append(TopPLogitsWarper(self.top_p))
        return processors

    @property
    def processing_key(self) -> tuple:
        """Requests with equal keys process logits identically (so the engine processes them in one call)."""
        if not self.do_sample:
            return (False,)
        return (True, self.temperature, self.top_k or 0, self.top_p if self.top_p is not None else 1.0)


def resolve_sampling_params(params: SamplingParams | None, settings: Mapping[str, object]) -> SamplingParams:
    """A request's settings: ``params``, or the ``settings`` given as ``submit`` keywords when it is None.

    Why refuse both at once: ``params`` would win and a keyword beside it would be ignored without a word, and an
    ignored ``cache_salt`` puts the request in the unsalted scope, sharing caches and history with other users."""
    if params is None:
        return SamplingParams(**settings)
    if not isinstance(params, SamplingParams):
        raise RequestRejectedError(f"params must be a SamplingParams (or None), got {type(params).__name__}")
    defaults = {f.name: f.default for f in fields(SamplingParams)}
    given = [name for name, value in settings.items() if _differs(value, defaults[name])]
    if given:
        raise RequestRejectedError(f"{', '.join(given)} given beside params=: set {'them' if len(given) > 1 else 'it'} "
                                   f"in the SamplingParams instead (params= is used alone)")
    return params


def _differs(value, default) -> bool:
    if value is default:
        return False
    try:
        return bool(value != default)
    except Exception:  # an array or another value without a plain truth: it was given
        return True


@dataclass
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: FinishReason
    text: str | None = None
    metrics: dict = field(default_factory=dict)


class Request:
    """Engine-side state of one request. Only the engine loop mutates it (under ``condition``)."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, eos_token_ids: set[int], *,
                 request_id: str | None = None, device: torch.device | str = "cpu"):
        self.request_id = request_id if request_id is not None else new_request_id()
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.processors = params.logits_processors()
        self.generator = torch.Generator(device=device)
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        self.condition = threading.Condition()
        self.tokens: list[int] = []
        self.token_times: list[float] = []
        self.submit_time = time.perf_counter()
        self.admit_time: float | None = None
        self.finish_time: float | None = None
        self.finish_reason: FinishReason | None = None
        self.error: BaseException | None = None
        self.cancel_requested = False
        self.num_rounds = 0
        self.prefill = None  # admission's prefill state while the prompt is being processed
        self.lookup_row = False  # the engine's lookup proposer indexes this request

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_remaining(self) -> int:
        """Tokens this request may still generate."""
        return self.params.max_new_tokens - len(self.tokens)

    def commit(self, tokens: Sequence[int], now: float) -> int:
        """Append tokens one at a time, stopping at EOS or max_new_tokens like plain ``generate``. Returns how
        many were committed; the request is finished afterwards if it stopped."""
        committed = 0
        with self.condition:
            for token in tokens:
                self.tokens.append(int(token))
                self.token_times.append(now)
                committed += 1
                if int(token) in self.eos_token_ids:
                    self._finish_locked(FinishReason.STOP, now)
                    break
                if len(self.tokens) >= self.params.max_new_tokens:
                    self._finish_locked(FinishReason.LENGTH, now)
                    break
            self.condition.notify_all()
        return committed

    def finish(self, reason: FinishReason, error: BaseException | None = None) -> None:
        with self.condition:
            if self.finish_reason is None:
                self.error = error
                self._finish_locked(reason, time.perf_counter())
            self.condition.notify_all()

    def _finish_locked(self, reason: FinishReason, now: float) -> None:
        self.finish_reason = reason
        self.finish_time = now
        self.prefill = None

    def metrics(self) -> dict:
        """Latency numbers of this request (seconds; tok/s counts tokens after the first, i.e. decoding speed)."""
        first = self.token_times[0] if self.token_times else None
        last = self.token_times[-1] if self.token_times else None
        n = len(self.tokens)
        decode_s = (last - first) if n > 1 else 0.0
        return {
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": n,
            "num_rounds": self.num_rounds,
            "queue_s": (self.admit_time - self.submit_time) if self.admit_time is not None else None,
            "ttft_s": (first - self.submit_time) if first is not None else None,
            "mean_itl_s": decode_s / (n - 1) if n > 1 else None,
            "tokens_per_second": (n - 1) / decode_s if decode_s > 0 else None,
            "e2e_s": (self.finish_time - self.submit_time) if self.finish_time is not None else None,
        }

    def output(self, tokenizer=None) -> RequestOutput:
        with self.condition:
            tokens = list(self.tokens)
            reason = self.finish_reason
        text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else None
        return RequestOutput(self.request_id, list(self.prompt_ids), tokens, reason, text, self.metrics())


class RequestHandle:
    """What ``engine.submit`` returns: iterate it to stream token ids, ``result()`` to wait, ``cancel()`` to stop.

    Without a running engine thread (``engine.start()``), waiting drives the engine's steps from the caller's
    thread, so single-threaded use needs no loop of its own.

    Args:
        request: the engine-side request (read only, under its condition).
        cancel: asks the engine to stop the request at its next step boundary.
        step: runs one engine step from the caller's thread (False: the engine had nothing to do).
        is_running: whether an engine thread runs the steps (waiting then only waits).
        tokenizer: decodes ``RequestOutput.text`` (None: no text).
    """

    def __init__(self, request: Request, *, cancel: Callable[[], None], step: Callable[[], bool],
                 is_running: Callable[[], bool], tokenizer=None):
        self._request = request
        self._cancel, self._step, self._is_running = cancel, step, is_running
        self._tokenizer = tokenizer

    @property
    def request_id(self) -> str:
        return self._request.request_id

    @property
    def prompt_ids(self) -> list[int]:
        return list(self._request.prompt_ids)

    @property
    def token_ids(self) -> list[int]:
        """Tokens generated so far (a snapshot)."""
        with self._request.condition:
            return list(self._request.tokens)

    def done(self) -> bool:
        return self._request.is_finished

    def cancel(self) -> None:
        """Stop generating at the next step boundary; the tokens produced so far are kept."""
        self._cancel()

    def _wait(self, predicate, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        request = self._request
        while True:
            with request.condition:
                if predicate():
                    return True
                if self._is_running():
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    request.condition.wait(timeout=0.1 if remaining is None else min(0.1, remaining))
                    continue
            if deadline is not None and time.monotonic() >= deadline:
                return False
            if not self._step() and not predicate():
                raise RuntimeError(f"request {request.request_id} cannot progress: the engine has no work for it "
                                   "(was it stopped?)")

    def __iter__(self) -> Iterator[int]:
        position = 0
        request = self._request
        while True:
            self._wait(lambda seen=position: len(request.tokens) > seen or request.is_finished, None)
            with request.condition:
                new = request.tokens[position:]
                finished = request.is_finished and position + len(new) >= len(request.tokens)
            yield from new
            position += len(new)
            if finished:
                break
        self._raise_if_failed()

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Block until the request finishes (TimeoutError after ``timeout`` seconds)."""
        if not self._wait(lambda: self._request.is_finished, timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        self._raise_if_failed()
        return self._request.output(self._tokenizer)

    def _raise_if_failed(self) -> None:
        if self._request.finish_reason is FinishReason.ERROR:
            raise RuntimeError(f"request {self.request_id} failed inside the engine") from self._request.error


__all__ = ["FinishReason", "Request", "RequestHandle", "RequestOutput", "RequestRejectedError", "SamplingParams",
           "resolve_sampling_params"]
