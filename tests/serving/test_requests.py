"""Requests are validated at submit (a bad one never reaches a step shared with others), and a request whose
prefill fails inside the engine fails alone: the requests beside it complete and equal plain greedy."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import make_tiny_llama

from hf_dspark import DSparkDraftModel, DSparkEngine
from hf_dspark.serving import SPSProfile
from hf_dspark.serving.requests import FinishReason, RequestRejectedError, SamplingParams

SPS = SPSProfile.from_user_table({1: 100.0, 64: 50.0})


@pytest.fixture(scope="module")
def target():
    return make_tiny_llama(seed=0)


@pytest.fixture(scope="module")
def draft(target):
    torch.manual_seed(1)
    return DSparkDraftModel.from_target(target, num_layers=1, block_size=4, markov_rank=8).eval()


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
])
def test_bad_limits_are_refused_at_submit(target, draft, kwargs, message):
    engine = DSparkEngine(target, draft, "fixed", sps=SPS)
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(RequestRejectedError, match=message):
        engine.submit([5, 9, 7], **kwargs)


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
