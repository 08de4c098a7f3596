"""The generate entry (generation/integration.py): binding a drafter on first use, refusing an unbound one with the
fix, validating DSpark keywords before decoding, warning about outputs it cannot produce, ending a streamer on error."""

from __future__ import annotations

import queue
import threading
import warnings

import pytest
import torch
from conftest import make_tiny_drafter, make_tiny_llama
from transformers import TextIteratorStreamer

from hf_dspark import DSparkDraftModel

PROMPT = torch.tensor([[1, 17, 33, 5, 60, 41]])


@pytest.fixture(scope="module")
def target():
    return make_tiny_llama(seed=0)


@pytest.fixture(scope="module")
def saved_bf16_drafter(target, tmp_path_factory):
    """A drafter checkpoint in bf16 (as the shipped one is), for an fp32 target."""
    torch.manual_seed(1)
    draft = DSparkDraftModel.from_target(make_tiny_llama(seed=0), num_layers=1, block_size=5, markov_rank=16)
    path = tmp_path_factory.mktemp("drafter") / "bf16"
    draft.to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def draft(target):
    return make_tiny_drafter(target, seed=1, block_size=5, markov_rank=16)


@pytest.fixture(scope="module")
def expected(target):
    return target.generate(PROMPT, do_sample=False, max_new_tokens=10)


class _Decoder:
    """Just enough tokenizer for TextIteratorStreamer."""

    def decode(self, ids, **kwargs) -> str:
        return " ".join(map(str, ids))


# ---------------------------------------------------------------------------------------------------------
# Defect 2: an unbound drafter as assistant_model
# ---------------------------------------------------------------------------------------------------------
def test_unbound_drafter_on_a_target_without_the_hook_says_to_bind_it(saved_bf16_drafter):
    fresh = make_tiny_llama(seed=0)  # nothing was ever bound to it: its generate is transformers' own
    draft = DSparkDraftModel.from_pretrained(saved_bf16_drafter)
    with pytest.raises(ValueError, match=r"not bound to a target\. Call draft\.bind_target\(target\)"):
        fresh.generate(PROMPT, assistant_model=draft, max_new_tokens=4, do_sample=False)
    draft.bind_target(fresh)  # the fix the message names
    assert torch.equal(fresh.generate(PROMPT, assistant_model=draft, max_new_tokens=10, do_sample=False),
                       fresh.generate(PROMPT, max_new_tokens=10, do_sample=False))


def test_a_drafter_for_another_vocabulary_says_so_on_a_target_never_bound(draft):
    """transformers' own generate compares vocabularies first and blamed the tokenizers ("provide `tokenizer` and
    `assistant_tokenizer`"): the message names both vocabularies and says which drafter to load."""
    other = make_tiny_llama(seed=0, vocab_size=128)  # nothing was ever bound to it
    assert "generate" not in other.__dict__  # transformers' own generate, not hf-dspark's wrapper
    message = (r"^This drafter was built for a target with vocab_size=96, but the given target has vocab_size=128\. "
               r"Load the drafter that matches this target \(this one was built for an unnamed llama target "
               r"\(hidden_size=64, 4 layers, vocab_size=96\)\)\.$")
    with pytest.raises(ValueError, match=message):
        other.generate(PROMPT, assistant_model=draft, max_new_tokens=4, do_sample=False)
    with pytest.raises(ValueError, match=message):  # assistant_model by position: generate's 7th argument
        other.generate(PROMPT, None, None, None, None, None, draft, max_new_tokens=4, do_sample=False)
    assert draft.target is not other  # refused, not bound


def test_bf16_drafter_is_bound_and_cast_on_first_use(target, draft, saved_bf16_drafter, expected, caplog):
    unbound = DSparkDraftModel.from_pretrained(saved_bf16_drafter)
    assert unbound.dtype == torch.bfloat16 and not unbound._bound_target
    with caplog.at_level("INFO", logger="hf_dspark.modeling.modeling"):
        out = target.generate(PROMPT, assistant_model=unbound, max_new_tokens=10, do_sample=False)
    assert torch.equal(out, expected)
    assert unbound.dtype == torch.float32 and unbound.target is target
    binds = [r.getMessage() for r in caplog.records if "Drafter bound" in r.getMessage()]
    assert len(binds) == 1 and "cast from torch.bfloat16 on cpu" in binds[0]


# ---------------------------------------------------------------------------------------------------------
# Defect 3: DSpark keywords are validated before decoding
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [-1, 6, 1.5, True, "2"])
def test_bad_num_tokens_is_refused(target, draft, value):
    with pytest.raises(ValueError, match=r"dspark_num_tokens=.* must be an int in \[0, 5\]"):
        target.generate(PROMPT, assistant_model=draft, max_new_tokens=4, dspark_num_tokens=value)


@pytest.mark.parametrize("value", [-0.5, float("nan"), float("inf"), "0.5", False])
def test_bad_confidence_threshold_is_refused(target, draft, value):
    with pytest.raises(ValueError, match=r"dspark_confidence_threshold=.* must be a finite number >= 0"):
        target.generate(PROMPT, assistant_model=draft, max_new_tokens=4, dspark_confidence_threshold=value)


@pytest.mark.parametrize(("keyword", "value", "message"), [
    ("dspark_sequential_top_k", -1, r"dspark_sequential_top_k=-1 must be an int >= 0"),
    ("dspark_sequential_top_k", 2.5, r"dspark_sequential_top_k=2.5 must be an int >= 0"),
    ("dspark_cpu_linears", "x", r"dspark_cpu_linears='x' must be None, True or False"),
    ("dspark_prefix_cache", "x", r"dspark_prefix_cache='x' must be True or False"),
    ("dspark_step_cost", "x", r"dspark_step_cost='x' must be a StepCostProfile"),
    ("dspark_recorder", object(), r"dspark_recorder=.* has no observe_round"),
    ("generator", 5, r"generator=5 must be a torch.Generator"),
])
def test_other_bad_dspark_keywords_are_refused_by_name(target, draft, keyword, value, message):
    """docs/generate.md: every keyword is checked before decoding and a wrong value raises a ValueError naming it
    (these crashed inside the loop, or were taken as True)."""
    with pytest.raises(ValueError, match=message):
        target.generate(PROMPT, assistant_model=draft, max_new_tokens=4, do_sample=True, **{keyword: value})


def test_zero_num_tokens_means_plain_decoding(target, draft, expected, monkeypatch):
    def no_drafting(*args, **kwargs):
        raise AssertionError("drafted with dspark_num_tokens=0")

    monkeypatch.setattr(draft, "draft_block", no_drafting)
    out = target.generate(PROMPT, assistant_model=draft, max_new_tokens=10, do_sample=False, dspark_num_tokens=0)
    assert torch.equal(out, expected) and draft.stats.proposed_tokens == 0
    with pytest.raises(ValueError, match="dspark_num_tokens=0 decodes plainly"):
        target.generate(PROMPT, assistant_model=draft, max_new_tokens=4, do_sample=True, dspark_num_tokens=0,
                        generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("setting", [
    {"dspark_cache_salt": "user-42"}, {"dspark_isolate": True}, {"dspark_lookup": False},
    {"dspark_prefix_cache": False}, {"dspark_cpu_linears": False}, {"dspark_policy": "fixed"},
    {"dspark_sequential_top_k": 0},
], ids=lambda setting: next(iter(setting)))
def test_zero_num_tokens_takes_the_other_dspark_keywords(target, draft, expected, setting):
    """A server passes its users' salt (and its other settings) on every call, some with ``dspark_num_tokens=0``:
    plain decoding has no use for them, and transformers must not see them (it refuses unknown keywords)."""
    out = target.generate(PROMPT, assistant_model=draft, max_new_tokens=10, do_sample=False, dspark_num_tokens=0,
                          **setting)
    assert torch.equal(out, expected)


def test_zero_num_tokens_still_checks_the_salt(target, draft):
    with pytest.raises(ValueError, match="dspark_cache_salt must be a string"):
        target.generate(PROMPT, assistant_model=draft, max_new_tokens=4, dspark_num_tokens=0, dspark_cache_salt=42)


def test_requested_outputs_that_are_not_produced_warn(target, draft):
    with (pytest.warns(UserWarning, match="output_hidden_states and output_attentions requested, but a DSpark"),
          pytest.warns(UserWarning, match="target cache is not handed back")):
        out = target.generate(PROMPT, assistant_model=draft, max_new_tokens=4, return_dict_in_generate=True,
                              output_hidden_states=True, output_attentions=True)
    assert out.hidden_states is None and out.attentions is None
    from transformers import DynamicCache

    with pytest.warns(UserWarning, match="cache you passed in .* must not be passed to a later call"):
        target.generate(PROMPT.repeat(2, 1), assistant_model=draft, max_new_tokens=4,
                        cache=DynamicCache(config=target.config))


@pytest.mark.parametrize("use_cache", [None, True])
def test_a_dict_output_without_the_cache_plain_generate_returns_warns(target, draft, use_cache):
    """Plain generate's dict output carries past_key_values by default: its absence must not go unsaid."""
    setting = {} if use_cache is None else {"use_cache": use_cache}
    plain = target.generate(PROMPT, max_new_tokens=4, return_dict_in_generate=True, **setting)
    assert plain.past_key_values is not None
    with pytest.warns(UserWarning, match="target cache is not handed back"):
        out = target.generate(PROMPT, assistant_model=draft, max_new_tokens=4, return_dict_in_generate=True,
                              **setting)
    assert out.past_key_values is None


def test_a_dict_output_with_use_cache_off_does_not_warn_about_the_cache(target, draft):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*target cache is not handed back")
        target.generate(PROMPT, assistant_model=draft, max_new_tokens=4, return_dict_in_generate=True,
                        use_cache=False)


def _consume(streamer) -> list[str]:
    try:
        return list(streamer)
    except queue.Empty:  # the stream was never ended: the consumer would have blocked
        return ["<blocked>"]


def test_streamer_is_ended_when_generate_fails(target, draft, monkeypatch):
    """Batch 2 with a streamer (refused before decoding) and an error inside decoding: both end the stream."""
    def run(ids, errors):
        try:  # threshold 0: every round drafts (the default scheduler may skip a drafter that does not pay)
            target.generate(ids, assistant_model=draft, streamer=streamer, max_new_tokens=4, do_sample=False,
                            dspark_confidence_threshold=0.0)
        except Exception as err:  # noqa: BLE001 - the test inspects it
            errors.append(err)

    streamer, errors = TextIteratorStreamer(_Decoder(), timeout=20), []
    worker = threading.Thread(target=run, args=(PROMPT.repeat(2, 1), errors))
    worker.start()
    assert "<blocked>" not in _consume(streamer)
    worker.join()
    assert len(errors) == 1 and "batch size 1 only" in str(errors[0])

    def broken(*args, **kwargs):
        raise RuntimeError("injected drafting failure")

    monkeypatch.setattr(draft, "draft_block", broken)
    streamer, errors = TextIteratorStreamer(_Decoder(), timeout=20), []
    worker = threading.Thread(target=run, args=(PROMPT, errors))
    worker.start()
    assert "<blocked>" not in _consume(streamer)
    worker.join()
    assert len(errors) == 1 and "injected drafting failure" in str(errors[0])


def test_drafter_cast_after_binding_is_cast_back(target, draft, expected):
    draft.to(torch.bfloat16)  # e.g. to save it in bf16, then used again with the fp32 target
    try:
        assert torch.equal(target.generate(PROMPT, assistant_model=draft, max_new_tokens=10, do_sample=False),
                           expected)
        assert draft.dtype == torch.float32
    finally:
        draft.to(torch.float32)


# ---------------------------------------------------------------------------------------------------------
# The step-cost cache folder is an optimisation: an unwritable one costs a warning, never the call
# ---------------------------------------------------------------------------------------------------------
def test_an_unwritable_cache_folder_warns_once_and_returns_the_same_tokens(expected, tmp_path, monkeypatch, caplog,
                                                                           users_cache_folder):
    def generate_with_a_fresh_pair(cache: str) -> torch.Tensor:
        monkeypatch.setenv("HF_DSPARK_CACHE", cache)
        fresh = make_tiny_llama(seed=0)  # nothing measured for it in this process yet: generate profiles it
        torch.manual_seed(1)
        drafter = DSparkDraftModel.from_target(fresh, num_layers=1, block_size=5, markov_rank=16).eval()
        return torch.cat([fresh.generate(PROMPT, assistant_model=drafter, max_new_tokens=10, do_sample=False)
                          for _ in range(2)])

    writable = generate_with_a_fresh_pair(str(tmp_path / "writable"))
    assert list((tmp_path / "writable" / "sps").glob("step-*.json"))  # the folder the test means is the one used
    (tmp_path / "a-file").write_text("")
    with caplog.at_level("WARNING"):
        unwritable = generate_with_a_fresh_pair(str(tmp_path / "a-file" / "sub"))
    assert torch.equal(unwritable, writable) and torch.equal(unwritable, torch.cat([expected, expected]))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name.startswith("hf_dspark")]
    assert len(warnings) == 1 and "cannot write the cache folder" in warnings[0]


def test_two_threads_enabling_one_target_install_one_wrapper(monkeypatch):
    """Workers binding their drafters to one shared target at start-up: a second wrapper around the first would
    read the same saved original (the first wrapper itself) and recurse on every later call."""
    import functools
    import types

    from hf_dspark.generation import integration

    target = make_tiny_llama(seed=0)
    expected = target.generate(PROMPT, max_new_tokens=4, do_sample=False)
    barrier = threading.Barrier(2, timeout=2)

    def wraps_once_both_have_looked(wrapped):  # both threads past the "already wrapped?" check, if they can be
        try:
            barrier.wait()
        except threading.BrokenBarrierError:  # the other thread waits until this one has installed its wrapper
            pass
        return functools.wraps(wrapped)

    monkeypatch.setattr(integration, "functools", types.SimpleNamespace(wraps=wraps_once_both_have_looked))
    threads = [threading.Thread(target=integration.enable, args=(target,)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    monkeypatch.undo()
    try:
        assert torch.equal(target.generate(PROMPT, max_new_tokens=4, do_sample=False), expected)
    finally:
        integration.disable(target)
    assert "generate" not in target.__dict__
