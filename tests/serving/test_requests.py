"""Requests are validated at submit (a bad one never reaches a step shared with others), a handle reaches its engine
only through the callbacks it is given, and a request whose prefill fails inside the engine fails alone: the
requests beside it complete and equal plain greedy."""

from __future__ import annotations

import ast
import functools
import inspect

import numpy as np
import pytest
import torch
from conftest import make_tiny_drafter, make_tiny_llama

from hf_dspark import DSparkEngine
from hf_dspark.scheduling import SPSProfile
from hf_dspark.serving import requests as requests_module
from hf_dspark.serving.requests import FinishReason, Request, RequestHandle, RequestRejectedError, SamplingParams

SPS = SPSProfile.from_user_table({1: 100.0, 64: 50.0})


@pytest.fixture(scope="module")
def target():
    return make_tiny_llama(seed=0)


@pytest.fixture(scope="module")
def draft(target):
    return make_tiny_drafter(target, seed=1, block_size=4, markov_rank=8)


def greedy(target, prompt, n):
    return target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n)[0, len(prompt):].tolist()


@pytest.mark.parametrize("prompt, message", [
    ([5, 9, 96], "outside the target's vocabulary"),
    ([5, -1, 7], "outside the target's vocabulary"),
    ([5, 9.0, 7], "must be ints"),
    ([5, True, 7], "must be ints"),
    (torch.tensor([[5, 9, 7], [8, 3, 4]]), r"1-D or \[1, n\]"),
    (torch.tensor([5.0, 9.0]), "must be integers"),
    (object(), "unsupported prompt type"),
])
def test_malformed_prompts_are_refused_at_submit(target, draft, prompt, message):
    engine = DSparkEngine(target, draft, "fixed", sps=SPS)
    with pytest.raises(RequestRejectedError, match=message):
        engine.submit(prompt, 4)
    assert engine.metrics()["rejected_requests"] == 1 and not engine.has_work()


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": 3.5}, "max_new_tokens must be an int"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ({"top_k": 2.0}, "top_k must be an int"),
    ({"seed": "7"}, "seed must be an int"),
    ({"temperature": 0.0, "do_sample": True}, "temperature must be > 0"),
    ({"eos_token_id": [2, 2.5]}, "eos_token_id must be an int"),
    ({"do_sample": "yes"}, "do_sample must be a bool"),  # failed inside the engine step
    ({"do_sample": None}, "do_sample must be a bool"),
    ({"isolate": "no"}, "isolate must be a bool"),  # a truthy string isolated the request
    ({"seed": 2**64, "do_sample": True}, r"seed must be in \["),  # torch's overflow ValueError, after validation
    ({"seed": -(2**63) - 1, "do_sample": True}, r"seed must be in \["),
])
def test_bad_limits_are_refused_at_submit(target, draft, kwargs, message):
    engine = DSparkEngine(target, draft, "fixed", sps=SPS)
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(RequestRejectedError, match=message):
        engine.submit([5, 9, 7], **kwargs)


def test_seeds_at_the_ends_of_torchs_range_and_numpy_bools_are_served(target, draft):
    engine = DSparkEngine(target, draft, "fixed", sps=SPS)
    for seed in (2**64 - 1, -(2**63)):
        assert len(engine.submit([5, 9, 7], 3, do_sample=True, seed=seed, eos_token_id=[]).result().token_ids) == 3
    handle = engine.submit([5, 9, 7], 4, do_sample=np.False_, isolate=np.True_)
    assert handle._request.params.do_sample is False and handle._request.params.isolate is True
    assert handle.result().token_ids == greedy(target, [5, 9, 7], 4)


def test_a_one_row_tensor_is_one_prompt(target, draft):
    engine = DSparkEngine(target, draft, "fixed", sps=SPS)
    assert engine.submit(torch.tensor([[5, 9, 7]]), 4).result().token_ids == greedy(target, [5, 9, 7], 4)


def test_duplicate_request_ids_are_refused_while_the_first_runs(target, draft):
    engine = DSparkEngine(target, draft, "fixed", sps=SPS)
    first = engine.submit([5, 9, 7], 4, request_id="job-1")
    with pytest.raises(RequestRejectedError, match="already in use"):
        engine.submit([8, 3, 4], 4, request_id="job-1")
    first.result()
    assert engine.submit([8, 3, 4], 4, request_id="job-1").result().token_ids == greedy(target, [8, 3, 4], 4)


def test_sampling_params_are_checked_on_their_own(target):
    with pytest.raises(RequestRejectedError, match="max_new_tokens must be an int"):
        SamplingParams(max_new_tokens=2.5)


def test_a_handle_cancels_through_its_callback():
    """A handle reaches the engine only through the callbacks it is given: ``cancel()`` calls its cancel callback
    (the callback, not the handle, flags the request), and waiting steps through its step callback."""
    request = Request([5, 9, 7], SamplingParams(max_new_tokens=4), {2})
    calls = []
    handle = RequestHandle(request, cancel=lambda: calls.append("cancel"), step=lambda: calls.append("step") or False,
                           is_running=lambda: False)
    handle.cancel()
    assert calls == ["cancel"] and not request.cancel_requested and not handle.done()
    with pytest.raises(RuntimeError, match="cannot progress"):  # nothing steps it to the end: the callback said so
        handle.result()
    assert calls == ["cancel", "step"]
    request.finish(FinishReason.CANCELLED)
    assert handle.result().finish_reason is FinishReason.CANCELLED and handle.result().text is None


def test_an_engine_handle_holds_a_cancel_callback_not_the_engine(target, draft):
    """The engine hands each handle callbacks (no import of the engine in requests.py, no engine on the handle);
    cancelling through it ends the request at the next step boundary with a prefix of plain greedy."""
    assert not any(isinstance(node, ast.ImportFrom) and node.module == "engine"
                   for node in ast.walk(ast.parse(inspect.getsource(requests_module))))
    engine = DSparkEngine(target, draft, "fixed", sps=SPS)
    handle = engine.submit([5, 9, 7], 12)
    assert not any(isinstance(value, DSparkEngine) for value in vars(handle).values())
    engine.step()  # the prefill and one round: at most 1 + γ of the 12 tokens
    handle.cancel()
    out = handle.result()
    assert out.finish_reason is FinishReason.CANCELLED and 0 < len(out.token_ids) < 12
    assert out.token_ids == greedy(target, [5, 9, 7], 12)[:len(out.token_ids)]
    assert engine.metrics()["finished_requests"] == {"cancelled": 1}


@pytest.mark.parametrize("grouped", [True, False])
def test_a_request_failing_in_its_prefill_fails_alone(target, draft, monkeypatch, grouped):
    """Fault injection: the prefill of one request raises inside the step; only that request ends with an error,
    the others (prefilled together with it or alone) complete and equal plain greedy."""
    prompts = [[5, 9, 11, 40, 7], [8, 60, 12], [33, 21, 17, 90, 4, 6], [70, 71, 72]]
    engine = DSparkEngine(target, draft, "scheduled", sps=SPS, max_prefill_tokens=256 if grouped else 4)

    def poisoned(forward):
        @functools.wraps(forward)  # the same signature: the engine reads its cache argument's name from it
        def run(*args, **kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is not None and 33 in ids.flatten().tolist():
                raise RuntimeError("injected fault in the poisoned request's prefill")
            return forward(*args, **kwargs)
        return run

    original_forward = target.forward
    monkeypatch.setattr(target, "forward", poisoned(original_forward))
    handles = [engine.submit(p, 6) for p in prompts]
    while engine.step():
        pass
    for handle, prompt in zip(handles, prompts):
        if 33 in prompt:
            with pytest.raises(RuntimeError, match="failed inside the engine"):
                handle.result()
            assert handle._request.finish_reason is FinishReason.ERROR
        else:
            assert handle.result().token_ids == greedy(target, prompt, 6)
    assert engine.metrics()["finished_requests"] == {"error": 1, "length": 3}


def _poison_decode(engine, monkeypatch, fails):
    """Fault injection inside the decode step: the round raises whenever ``fails(row_ids)`` says so."""
    real_run = engine._round.run
    calls = {"n": 0}

    def run(*args, row_ids=None, **kwargs):
        calls["n"] += 1
        if fails(list(row_ids or []), calls["n"]):
            raise RuntimeError("injected fault in a decode step")
        return real_run(*args, row_ids=row_ids, **kwargs)

    monkeypatch.setattr(engine._round, "run", run)
    return calls


@pytest.mark.parametrize("policy", ["fixed", "scheduled"])
def test_a_request_failing_in_every_decode_step_fails_alone(target, draft, monkeypatch, policy):
    """The poisoned request's every decode step raises; it is traced and fails alone, and the requests that
    shared its steps resume from their committed tokens and still equal plain greedy."""
    prompts = [[5, 9, 11, 40, 7], [8, 60, 12], [33, 21, 17, 90, 4, 6], [70, 71, 72]]
    engine = DSparkEngine(target, draft, policy, sps=SPS, max_prefill_tokens=256)
    handles = [engine.submit(p, 12, request_id=f"r{i}") for i, p in enumerate(prompts)]
    _poison_decode(engine, monkeypatch, lambda rows, n: "r2" in rows)
    while engine.step():
        pass
    for i, (handle, prompt) in enumerate(zip(handles, prompts)):
        if i == 2:
            with pytest.raises(RuntimeError, match="failed inside the engine"):
                handle.result()
        else:
            assert handle.result().token_ids == greedy(target, prompt, 12)
    metrics = engine.metrics()
    assert metrics["finished_requests"] == {"error": 1, "length": 3}
    assert metrics["isolated_step_failures"] >= 2  # the shared step, then the poisoned request's own


def test_a_fault_after_tokens_were_committed_resumes_every_request(target, draft, monkeypatch):
    """A one-off failure (nobody's fault) in the middle of decoding: no request is lost, none is duplicated,
    every output equals plain greedy (the resumed rows re-prefill prompt + committed tokens)."""
    prompts = [[5, 9, 11, 40, 7], [8, 60, 12], [70, 71, 72]]
    engine = DSparkEngine(target, draft, "fixed", sps=SPS, max_prefill_tokens=256)
    handles = [engine.submit(p, 16) for p in prompts]
    calls = _poison_decode(engine, monkeypatch, lambda rows, n: n == 3)
    while engine.step():
        pass
    assert calls["n"] > 3
    assert [h.result().token_ids for h in handles] == [greedy(target, p, 16) for p in prompts]
    assert engine.metrics()["finished_requests"] == {"length": 3}
    assert engine.metrics()["isolated_step_failures"] == 1


def test_a_fault_in_every_step_fails_each_request_alone_and_the_engine_goes_on(target, draft, monkeypatch):
    prompts = [[5, 9, 11, 40, 7], [8, 60, 12], [70, 71, 72]]
    engine = DSparkEngine(target, draft, "fixed", sps=SPS, max_prefill_tokens=256)
    handles = [engine.submit(p, 8) for p in prompts]
    _poison_decode(engine, monkeypatch, lambda rows, n: True)
    for _ in range(200):
        if not engine.step():
            break
    assert all(h.done() for h in handles)
    assert engine.metrics()["finished_requests"] == {"error": 3}


@pytest.mark.parametrize("kwargs, setting", [
    ({"cache_salt": "alice"}, "cache_salt"),  # was dropped: the request shared the unsalted scope
    ({"max_new_tokens": 9}, "max_new_tokens"),
    ({"isolate": True}, "isolate"),
    ({"do_sample": True, "seed": 3}, "do_sample"),
    ({"eos_token_id": []}, "eos_token_id"),
])
def test_settings_beside_params_are_refused_not_ignored(target, draft, kwargs, setting):
    """``submit(..., params=SamplingParams(...))`` used params alone: a keyword given beside it (a salt, a limit)
    was silently ignored, so a salted request shared the default scope's caches and history."""
    engine = DSparkEngine(target, draft, "fixed", sps=SPS)
    with pytest.raises(RequestRejectedError, match=f"{setting}.*params="):
        engine.submit([5, 9, 7], params=SamplingParams(max_new_tokens=3), **kwargs)
    with pytest.raises(RequestRejectedError, match="params must be a SamplingParams"):
        engine.submit([5, 9, 7], params={"max_new_tokens": 3})
    assert not engine.has_work() and engine.metrics()["rejected_requests"] == 2
    out = engine.submit([5, 9, 7], 64, params=SamplingParams(max_new_tokens=3, cache_salt="alice")).result()
    assert out.token_ids == greedy(target, [5, 9, 7], 3)


@pytest.mark.parametrize("eos, message", [
    (-1, r"eos_token_id -1 is outside the target's vocabulary \[0, 96\)"),  # never matched: never stopped
    ([2, 96], r"eos_token_id 96 is outside the target's vocabulary"),
    (2.0, "eos_token_id must be an int or a list of ints"),
    ([True], "eos_token_id must be an int or a list of ints"),
])
def test_stop_ids_outside_the_vocabulary_are_refused(target, draft, eos, message):
    engine = DSparkEngine(target, draft, "fixed", sps=SPS)
    with pytest.raises(RequestRejectedError, match=message):
        engine.submit([5, 9, 7], 4, eos_token_id=eos)


def test_numpy_and_torch_integer_stop_ids_stop_like_ints(target, draft):
    """A stop id read from an array (numpy / torch integer) was refused as "not an int" while prompt ids of the same
    types were served."""
    prompt = [5, 9, 7]
    reference = greedy(target, prompt, 12)
    stop = reference[5]
    engine = DSparkEngine(target, draft, "fixed", sps=SPS)
    for eos in (np.int64(stop), [np.int32(stop)], torch.tensor(stop)):
        out = engine.submit(prompt, 12, eos_token_id=eos).result()
        assert out.token_ids == reference[:reference.index(stop) + 1] and out.finish_reason is FinishReason.STOP


def test_an_engine_chosen_request_id_never_takes_one_in_use(target, draft, monkeypatch):
    """A request without an id was given the next ``req-N``; when a caller's own id was that name the request was
    refused for a duplicate id it never gave."""
    import itertools

    monkeypatch.setattr(requests_module, "_REQUEST_IDS", itertools.count())
    engine = DSparkEngine(target, draft, "fixed", sps=SPS)
    mine = engine.submit([5, 9, 7], 4, request_id="req-0")
    other = engine.submit([8, 3, 4], 4)
    assert other.request_id not in ("req-0", None)
    assert mine.result().token_ids == greedy(target, [5, 9, 7], 4)
    assert other.result().token_ids == greedy(target, [8, 3, 4], 4)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": None}, "max_new_tokens must be an int, got None"),  # TypeError: '<' not supported ...
    ({"temperature": None}, "temperature must be a real number, got None"),  # TypeError: '>' not supported ...
])
def test_none_for_a_required_setting_is_refused_by_name(target, draft, kwargs, message):
    engine = DSparkEngine(target, draft, "fixed", sps=SPS)
    with pytest.raises(RequestRejectedError, match=message):
        engine.submit([5, 9, 7], **{"max_new_tokens": 4, **kwargs})
    assert engine.metrics()["rejected_requests"] == 1


def test_temperature_zero_is_greedy_not_refused(target, draft):
    """The warpers are documented as ignored when greedy, but ``temperature=0`` (vLLM's and OpenAI's way of saying
    greedy) was refused with "use do_sample=False for greedy" on a request that was greedy already."""
    engine = DSparkEngine(target, draft, "fixed", sps=SPS)
    assert engine.submit([5, 9, 7], 6, temperature=0.0).result().token_ids == greedy(target, [5, 9, 7], 6)
    with pytest.raises(RequestRejectedError, match="temperature must be > 0"):
        engine.submit([5, 9, 7], 6, temperature=0.0, do_sample=True)
    with pytest.raises(RequestRejectedError, match="temperature must be > 0"):
        engine.submit([5, 9, 7], 6, temperature=-1.0)
