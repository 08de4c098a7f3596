"""What plain ``generate`` accepts works the same with a DSpark assistant: a prefilled cache, stop strings, calls from
several threads, scores of rows that stopped early (issue #40). Each case compares with plain ``generate`` itself."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from conftest import make_tiny_drafter, make_tiny_llama
from transformers import DynamicCache, GenerationConfig, SynthIDTextWatermarkingConfig

from hf_dspark import DSparkDraftModel

PROMPT = torch.tensor([[1, 5, 9, 22, 7, 3, 40, 41, 12, 13]])


@pytest.fixture(scope="module")
def target():
    return make_tiny_llama().eval()


@pytest.fixture(scope="module")
def draft(target):
    return make_tiny_drafter(target, seed=0)


def prefilled(target, ids: torch.Tensor, count: int, mask: torch.Tensor | None = None) -> DynamicCache:
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(ids[:, :count], attention_mask=None if mask is None else mask[:, :count], cache=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
def test_a_prefilled_cache_is_extended_as_plain_generate_extends_it(target, draft, keyword):
    mask = torch.ones_like(PROMPT)
    expected = target.generate(input_ids=PROMPT, attention_mask=mask, max_new_tokens=12, do_sample=False,
                               **{keyword: prefilled(target, PROMPT, 5)})
    cache = prefilled(target, PROMPT, 5)
    with warnings.catch_warnings():  # at batch 1 the cache is left as plain generate leaves it: nothing to say
        warnings.simplefilter("error", UserWarning)
        got = target.generate(input_ids=PROMPT, attention_mask=mask, max_new_tokens=12, do_sample=False,
                              assistant_model=draft, dspark_lookup=False, dspark_confidence_threshold=0.0,
                              **{keyword: cache})
    assert torch.equal(got, expected)
    assert draft.stats.reused_prompt_tokens == 5 and draft.stats.prompt_tokens == 10  # 5 prefilled, not 10 again


def test_a_prefilled_cache_of_a_left_padded_batch(target, draft):
    ids = torch.tensor([[0, 0, 5, 9, 22, 7, 3], [1, 7, 3, 8, 9, 10, 11]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
    expected = target.generate(input_ids=ids, attention_mask=mask, cache=prefilled(target, ids, 4, mask),
                               max_new_tokens=10, do_sample=False)
    with pytest.warns(UserWarning, match="must not be passed to a later call"):
        got = target.generate(input_ids=ids, attention_mask=mask, cache=prefilled(target, ids, 4, mask),
                              max_new_tokens=10, do_sample=False, assistant_model=draft)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("stop_at", [3, 6])
def test_a_callers_cache_continues_a_conversation_as_plain_generate_leaves_it(target, draft, monkeypatch, stop_at):
    """transformers' "continue with the cache" pattern: a turn's cache, passed again with the next prompt. Drafts
    accepted past the EOS that ended the turn (every draft right: EOS arrives inside accepted blocks) must not stay
    in the caller's cache, where the next turn would attend to them."""
    from test_generate import OracleDrafter

    monkeypatch.setattr(draft, "draft_block", OracleDrafter(draft, target, pattern=[5]))
    eos = int(target.generate(PROMPT, max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, 10 + stop_at])
    kwargs = {"max_new_tokens": 12, "do_sample": False, "eos_token_id": eos, "pad_token_id": 0}
    ours = {"assistant_model": draft, "dspark_policy": "fixed", "dspark_lookup": False}

    def two_turns(**extra):
        cache = DynamicCache(config=target.config)
        first = target.generate(PROMPT, cache=cache, **kwargs, **extra)
        length = cache.get_seq_length()
        if extra:
            assert draft.stats.tau > 2.0  # accepted blocks really ran
        second = target.generate(torch.cat([first, torch.tensor([[30, 31, 32]])], 1), cache=cache, **kwargs, **extra)
        return first, length, second

    expected = two_turns()
    assert expected[0][0, -1] == eos and expected[1] == expected[0].shape[1] - 1
    got = two_turns(**ours)
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_a_callers_cache_is_never_kept_for_other_calls(target, draft):
    """The prefix cache keeps a finished call's caches for the scope's next call, which crops and extends them in
    place: a cache the caller passed (and holds) must not be among them."""
    from hf_dspark.speculation.shared_state import forget, shared_state_for

    forget(target)
    cache = DynamicCache(config=target.config)
    prompt = torch.tensor([[1] + list(range(20, 40))])
    target.generate(prompt, cache=cache, max_new_tokens=6, do_sample=False, assistant_model=draft)
    assert len(shared_state_for(target).prefixes) == 0
    forget(target)


def test_a_batch_cache_is_refused_when_passed_again(target, draft):
    """At batch > 1 the speculative loop leaves the caller's cache with rejected drafts' slots and finished rows
    dropped, unlike plain generate's: passing it to a later call would attend to them, so that is refused."""
    ids = torch.tensor([[0, 0, 5, 9, 22, 7, 3], [1, 7, 3, 8, 9, 10, 11]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
    cache = prefilled(target, ids, 4, mask)
    with pytest.warns(UserWarning, match="must not be passed to a later call"):
        out = target.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=6, do_sample=False,
                              assistant_model=draft)
    following = torch.cat([out, torch.full((2, 1), 30)], 1)
    for extra in ({"assistant_model": draft}, {}):  # a plain call on the target too
        with pytest.raises(ValueError, match="cache= .*batch of 2 rows"):
            target.generate(input_ids=following, attention_mask=torch.cat([mask, torch.ones(2, 7)], 1).long(),
                            cache=cache, max_new_tokens=4, do_sample=False, **extra)


def test_a_cache_holding_the_whole_prompt_is_refused(target, draft):
    with pytest.raises(ValueError, match="already holds 10 positions, and the prompt has 10"):
        target.generate(input_ids=PROMPT, cache=prefilled(target, PROMPT, 10), max_new_tokens=4, do_sample=False,
                        assistant_model=draft)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from hf_dspark.embedded import converted_target_dir

    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(converted_target_dir())
    except Exception as err:  # the embedded target is converted on first use by other tests / the CLI
        pytest.skip(f"the embedded SmolLM2 tokenizer is not available: {err}")


@pytest.fixture(scope="module")
def wide_target():
    """A tiny target with SmolLM2's vocabulary, so its tokenizer (a real BPE one) decodes its output."""
    return make_tiny_llama(vocab_size=49152).eval()


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("where", ["keyword", "generation_config"])
def test_stop_strings_stop_where_plain_generate_stops(wide_target, smollm2_tokenizer, batch, where):
    torch.manual_seed(0)
    draft = DSparkDraftModel.from_target(wide_target, num_layers=1).eval()
    full = wide_target.generate(PROMPT, max_new_tokens=20, do_sample=False)
    stop = smollm2_tokenizer.decode(full[0, 15:17])
    ids = PROMPT.repeat(batch, 1)
    if where == "keyword":
        kwargs = {"stop_strings": [stop]}
    else:
        config = wide_target.generation_config.__class__(**wide_target.generation_config.to_dict())
        config.stop_strings = [stop]
        kwargs = {"generation_config": config}
    expected = wide_target.generate(ids, max_new_tokens=20, do_sample=False, tokenizer=smollm2_tokenizer, **kwargs)
    got = wide_target.generate(ids, max_new_tokens=20, do_sample=False, tokenizer=smollm2_tokenizer,
                               assistant_model=draft, **kwargs)
    assert expected.shape[1] < full.shape[1]  # the stop string did stop it
    assert torch.equal(got, expected)


def test_stop_strings_without_a_tokenizer_fail_as_in_plain_generate(target, draft):
    with pytest.raises(ValueError, match="could not locate a tokenizer"):
        target.generate(PROMPT, max_new_tokens=4, stop_strings=["x"], assistant_model=draft)


def test_concurrent_calls_from_threads_each_equal_plain_and_leave_plain_calls_alone(target, draft):
    prompts = [torch.tensor([[1, 5, 9, 22, 7 + i, 3, 11 + i]]) for i in range(8)]
    kwargs = {"max_new_tokens": 24, "do_sample": False}
    expected = [target.generate(p, **kwargs) for p in prompts]
    plain_logits = target.generate(prompts[0], return_dict_in_generate=True, output_logits=True, **kwargs).logits
    failures: list[str] = []
    barrier = threading.Barrier(3)

    def speculative(first: int) -> None:
        barrier.wait()
        for i in range(first, len(prompts), 2):
            try:
                got = target.generate(prompts[i], assistant_model=draft, **kwargs)
                if not torch.equal(got, expected[i]):
                    failures.append(f"prompt {i}: {got.tolist()} != {expected[i].tolist()}")
            except Exception as err:  # noqa: BLE001 (the failure is the finding)
                failures.append(f"prompt {i}: {err!r}")

    def plain() -> None:  # the loop's kernels and feature taps must not reach a plain call in another thread
        barrier.wait()
        for _ in range(4):
            out = target.generate(prompts[0], return_dict_in_generate=True, output_logits=True, **kwargs)
            if not all(torch.equal(a, b) for a, b in zip(out.logits, plain_logits)):
                failures.append("a plain generate call beside the speculative ones computed other logits")

    threads = [threading.Thread(target=speculative, args=(k,)) for k in range(2)] + [threading.Thread(target=plain)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures


def test_a_streamer_waiting_on_another_call_does_not_stall_it(target, draft):
    """A streamer with back-pressure (a server's bounded queue) may wait in ``put`` until its consumer, itself waiting
    on another call on the same target, moves on: plain ``generate`` has no lock to deadlock on, so the tokens a
    round commits are handed out after the round lets go of the target's shared state."""
    other_done = threading.Event()
    failures: list[str] = []

    class WaitsForTheOtherCall:  # the first put after the prompt waits until the other call has finished
        puts = 0

        def put(self, value):
            self.puts += 1
            if self.puts == 3:  # the prompt, the first token (after the prefill), the first round's tokens
                threading.Thread(target=other_call).start()
                if not other_done.wait(timeout=600):  # a deadlock, not a slow machine
                    failures.append("the other call never finished while this streamer waited")

        def end(self):
            pass

    def other_call():
        try:
            # the threshold policy: no step-cost measurement, whose seconds depend on the machine's load
            got = target.generate(PROMPT, max_new_tokens=6, do_sample=False, assistant_model=draft,
                                  dspark_confidence_threshold=0.0)
            if not torch.equal(got, target.generate(PROMPT, max_new_tokens=6, do_sample=False)):
                failures.append("the other call's tokens differ from plain generate's")
        finally:
            other_done.set()

    prompt = torch.tensor([[1, 7, 3, 8, 9, 10, 11]])
    got = target.generate(prompt, max_new_tokens=8, do_sample=False, assistant_model=draft,
                          streamer=WaitsForTheOtherCall(), dspark_confidence_threshold=0.0)
    assert torch.equal(got, target.generate(prompt, max_new_tokens=8, do_sample=False))
    assert other_done.is_set() and not failures, failures


@pytest.mark.parametrize("output", ["scores", "logits"])
def test_scores_of_a_row_that_stopped_early_are_what_plain_generate_returns(target, draft, output):
    ids = torch.tensor([[1, 5, 9, 22], [1, 7, 3, 8]])
    probe = target.generate(ids, max_new_tokens=12, do_sample=False)
    eos = int(probe[0, 6])  # row 0 stops after 3 tokens, row 1 goes on
    kwargs = {"max_new_tokens": 12, "do_sample": False, "eos_token_id": eos, "pad_token_id": 0,
              "return_dict_in_generate": True, f"output_{output}": True, "repetition_penalty": 1.3}
    expected = target.generate(ids, **kwargs)
    got = target.generate(ids, assistant_model=draft, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    assert expected.sequences[0, -1] == 0 and expected.sequences[1, -1] != 0  # one row ended early
    ours, theirs = getattr(got, output), getattr(expected, output)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    if output == "scores":
        scores = target.compute_transition_scores(got.sequences, got.scores, normalize_logits=True)
        reference = target.compute_transition_scores(expected.sequences, expected.scores, normalize_logits=True)
        assert torch.isfinite(scores).all()
        torch.testing.assert_close(scores, reference, rtol=1e-4, atol=1e-4)


def left_padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 10, 4 and 8 own tokens, left-padded with 0 to 10."""
    rows = [[1, 5, 9, 22, 7, 3, 40, 41, 12, 13], [1, 7, 3, 8], [1, 30, 31, 32, 33, 34, 30, 31]]
    ids = torch.tensor([[0] * (10 - len(r)) + r for r in rows])
    return ids, (torch.arange(10)[None] >= (10 - torch.tensor([len(r) for r in rows]))[:, None]).long()


@pytest.mark.parametrize("setting", [
    {"begin_suppress_tokens": [31, 14, 40]},  # each row's own first greedy token
    {"forced_eos_token_id": 7},
    {"exponential_decay_length_penalty": (2, 3.0), "eos_token_id": [2, 30]},
    {"no_repeat_ngram_size": 1, "sequence_bias": [[[0], 30.0]]},  # plain generate bans a padded row's pad id
    {"prefix_allowed_tokens_fn": lambda batch_id, sent: list(range(len(sent), len(sent) + 30))},
], ids=["begin_suppress_tokens", "forced_eos_token_id", "exponential_decay_length_penalty", "no_repeat_ngram_size",
        "prefix_allowed_tokens_fn"])
def test_processors_see_a_padded_row_as_plain_generate_shows_it(target, draft, setting):
    ids, mask = left_padded_batch()
    kwargs = {"attention_mask": mask, "max_new_tokens": 10, "do_sample": False, "pad_token_id": 0, **setting}
    expected = target.generate(ids, **kwargs)
    got = target.generate(ids, assistant_model=draft, dspark_lookup=False, dspark_confidence_threshold=0.0, **kwargs)
    assert torch.equal(got, expected)


def test_forced_bos_does_not_fire_on_a_padded_one_token_row(target, draft):
    ids = torch.tensor([[0, 0, 0, 1], [1, 5, 9, 22]])
    kwargs = {"attention_mask": (ids != 0).long(), "max_new_tokens": 6, "do_sample": False, "forced_bos_token_id": 5}
    assert torch.equal(target.generate(ids, assistant_model=draft, **kwargs), target.generate(ids, **kwargs))


@pytest.mark.parametrize("setting", [
    {"prefix_allowed_tokens_fn": lambda batch_id, sent: list(range(10 + 20 * batch_id, 30 + 20 * batch_id))},
    {"encoder_no_repeat_ngram_size": 1},  # a decoder-only target's "encoder" ids: the padded prompts
    {"encoder_repetition_penalty": 0.5},
], ids=["prefix_allowed_tokens_fn", "encoder_no_repeat_ngram_size", "encoder_repetition_penalty"])
def test_processors_holding_one_entry_per_row_see_their_row(target, draft, setting):
    ids, mask = left_padded_batch()
    kwargs = {"attention_mask": mask, "max_new_tokens": 8, "do_sample": False, **setting}
    expected = target.generate(ids, **kwargs)
    got = target.generate(ids, assistant_model=draft, dspark_lookup=False, dspark_confidence_threshold=0.0, **kwargs)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("setting, name", [
    ({"guidance_scale": 1.5}, "guidance_scale"),
    ({"watermarking_config": SynthIDTextWatermarkingConfig(keys=[5, 9, 12, 33], ngram_len=3)}, "SynthID"),
], ids=["guidance_scale", "synthid_watermark"])
def test_processors_with_per_step_state_are_refused(target, draft, setting, name):
    """Their state advances once per call: drafted and rejected positions would advance it too (other tokens)."""
    with pytest.raises(ValueError, match=name):
        target.generate(PROMPT, max_new_tokens=4, do_sample=False, assistant_model=draft, **setting)


@pytest.mark.parametrize("with_ids", [False, True])
def test_inputs_embeds_are_refused(target, draft, with_ids):
    """The loop prefills from token ids (the drafter and the lookup read them): embeddings would be ignored."""
    embeds = target.get_input_embeddings()(PROMPT).detach()
    ids = {"input_ids": PROMPT} if with_ids else {}
    with pytest.raises(ValueError, match="inputs_embeds"):
        target.generate(inputs_embeds=embeds, **ids, max_new_tokens=4, do_sample=False, assistant_model=draft)


@pytest.mark.parametrize("setting, instead", [
    ({"num_assistant_tokens": 3}, "dspark_num_tokens"),
    ({"assistant_confidence_threshold": 0.9}, "dspark_confidence_threshold"),
    ({"num_assistant_tokens_schedule": "constant"}, "dspark_policy"),
    ({"prompt_lookup_num_tokens": 3}, "dspark_lookup"),
    ({"assistant_lookbehind": 5}, "drop it"),
    ({"use_mtp": True}, "drop it"),  # the target's multi-token-prediction heads as transformers' assistant
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
@pytest.mark.parametrize("where", ["keyword", "generation_config"])
def test_settings_of_transformers_assisted_generation_are_refused(target, draft, setting, instead, where):
    """A DSpark assistant replaces transformers' assisted generation: its settings would be ignored silently."""
    (name,) = setting
    passed = setting if where == "keyword" else {"generation_config": GenerationConfig(**setting)}
    with pytest.raises(ValueError, match=f"{name}=.*{instead}"):
        target.generate(PROMPT, max_new_tokens=4, do_sample=False, assistant_model=draft, **passed)


def test_use_mtp_false_asks_for_nothing_and_is_taken(target, draft):
    kwargs = {"max_new_tokens": 6, "do_sample": False, "use_mtp": False}
    assert torch.equal(target.generate(PROMPT, assistant_model=draft, **kwargs), target.generate(PROMPT, **kwargs))


def test_a_prompt_masked_inside_is_refused(target, draft):
    """A pad id inside a prompt without an attention_mask (transformers infers one that masks it) gave other tokens
    than plain generate's: the loop takes every row to be left-padded, so a mask with holes is refused."""
    ids = torch.tensor([[1, 5, 0, 0, 22, 7]])
    with pytest.raises(ValueError, match=r"attention_mask masks positions inside the prompt of row\(s\) \[0\]"):
        target.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, assistant_model=draft)
    mask = torch.tensor([[0, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"row\(s\) \[0\]"):
        target.generate(torch.cat([ids, ids]), attention_mask=mask, max_new_tokens=4, assistant_model=draft)


def test_a_right_padded_prompt_is_refused(target, draft):
    """Plain generate only warns about right padding; the loop would attend to the pads (other tokens)."""
    ids = torch.tensor([[1, 5, 9, 22, 7], [1, 7, 3, 0, 0]])
    with pytest.raises(ValueError, match=r"attention_mask pads row\(s\) \[1\] on the right.*padding_side"):
        target.generate(ids, attention_mask=(ids != 0).long(), max_new_tokens=4, do_sample=False,
                        assistant_model=draft)


class _ScoreReader:
    """A stopping criterion that reads ``scores`` (None, or the steps' processed logits so far where the call keeps
    scores): it keeps what it was handed and stops once the last step chose by a margin below ``margin``."""

    def __init__(self, margin: float):
        self.margin, self.seen = margin, []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append(scores if scores is None else [s.clone() for s in scores])
        if scores is None:
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)
        top2 = scores[-1].float().topk(2, dim=-1).values
        return (top2[:, 0] - top2[:, 1]) < self.margin


@pytest.mark.filterwarnings("ignore:The target cache is not handed back")
@pytest.mark.parametrize("keep_scores", [False, True])
def test_a_stopping_criterion_reading_scores_is_handed_them_as_in_plain_generate(target, draft, keep_scores):
    from transformers import StoppingCriteriaList

    kwargs = {"max_new_tokens": 16, "do_sample": False}
    if keep_scores:
        kwargs.update(return_dict_in_generate=True, output_scores=True)
    margin = 0.0
    while True:  # a margin that stops the call somewhere inside its 16 tokens
        plain = _ScoreReader(margin)
        expected = target.generate(PROMPT, stopping_criteria=StoppingCriteriaList([plain]), **kwargs)
        if not keep_scores or len(plain.seen) < 16 or margin > 10:
            break
        margin += 0.25
    ours = _ScoreReader(margin)
    got = target.generate(PROMPT, stopping_criteria=StoppingCriteriaList([ours]), assistant_model=draft,
                          dspark_lookup=False, dspark_policy="fixed", **kwargs)
    sequences = (got.sequences, expected.sequences) if keep_scores else (got, expected)
    assert torch.equal(*sequences)
    assert len(ours.seen) == len(plain.seen) == sequences[1].shape[1] - PROMPT.shape[1]
    for mine, theirs in zip(ours.seen, plain.seen):
        if theirs is None:
            assert mine is None
            continue
        assert len(mine) == len(theirs)
        assert all(a.shape == b.shape and torch.allclose(a, b, atol=1e-4) for a, b in zip(mine, theirs))


@pytest.mark.parametrize("setting, name", [
    ({"dola_layers": "low"}, "dola_layers"),
    ({"penalty_alpha": 0.6, "top_k": 4}, "penalty_alpha"),
    ({"force_words_ids": [[5]]}, "force_words_ids"),
], ids=["dola", "contrastive_search", "constrained_beam_search"])
@pytest.mark.parametrize("where", ["keyword", "generation_config"])
def test_settings_choosing_another_decoding_method_are_refused(target, draft, setting, name, where):
    """These settings make plain generate run another decoding method (DoLa, contrastive search, constrained beam
    search); with a DSpark assistant they were ignored and greedy tokens came back."""
    passed = setting if where == "keyword" else {"generation_config": GenerationConfig(max_new_tokens=4, **setting)}
    with pytest.raises(ValueError, match=f"{name}.*DSpark assistant_model"):
        target.generate(PROMPT, max_new_tokens=4, do_sample=False, assistant_model=draft, **passed)


def test_position_ids_other_than_the_masks_are_refused(target, draft):
    """Plain generate prefills with the position_ids passed to it; the loop derives positions from the attention
    mask, so other position ids gave other tokens. Those equal to the mask's are taken (the same tokens)."""
    kwargs = {"max_new_tokens": 6, "do_sample": False}
    with pytest.raises(ValueError, match="position_ids="):
        target.generate(PROMPT, position_ids=torch.arange(10)[None] * 3, assistant_model=draft, **kwargs)
    ids, mask = left_padded_batch()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    expected = target.generate(ids, attention_mask=mask, position_ids=positions, **kwargs)
    got = target.generate(ids, attention_mask=mask, position_ids=positions, assistant_model=draft, **kwargs)
    assert torch.equal(got, expected)


class _StopAfter:
    """A stopping criterion that stops a row once its last token is one of ``tokens`` (no ``eos_token_id``)."""

    def __init__(self, tokens: list[int]):
        self.tokens = torch.tensor(tokens)

    def __call__(self, input_ids, scores, **kwargs):
        return torch.isin(input_ids[:, -1], self.tokens)


@pytest.mark.parametrize("output", [None, "scores"])
def test_without_eos_rows_stopped_by_a_criterion_go_on_as_in_plain_generate(target, draft, output):
    """Plain generate pads a stopped row only when an EOS criterion is present: without one (no eos_token_id), a row
    stopped by another criterion (stop strings, yours) goes on decoding until every row has stopped, and the batch
    ends at the step its last row stopped. The loop padded such rows instead (other tokens)."""
    from transformers import StoppingCriteriaList

    ids, mask = left_padded_batch()
    full = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    # each row stops at its own step: its 2nd, 4th and 7th token (or earlier, where one of these comes sooner)
    stop_tokens = [int(full[0, 11]), int(full[1, 13]), int(full[2, 16])]
    kwargs = {"attention_mask": mask, "max_new_tokens": 12, "do_sample": False, "eos_token_id": None,
              "pad_token_id": 0}
    if output:
        kwargs.update(return_dict_in_generate=True, output_scores=True)
    expected = target.generate(ids, stopping_criteria=StoppingCriteriaList([_StopAfter(stop_tokens)]), **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The target cache is not handed back")
        got = target.generate(ids, stopping_criteria=StoppingCriteriaList([_StopAfter(stop_tokens)]),
                              assistant_model=draft, dspark_lookup=False, dspark_confidence_threshold=0.0, **kwargs)
    sequences = (got.sequences, expected.sequences) if output else (got, expected)
    assert 10 < sequences[1].shape[1] < full.shape[1]  # the criterion ended the batch before max_new_tokens
    assert torch.equal(sequences[1], full[:, :sequences[1].shape[1]])  # no row was padded: all went on
    assert torch.equal(*sequences)
    if output:
        assert len(got.scores) == len(expected.scores)
        for a, b in zip(got.scores, expected.scores):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


class _StopAtLength:
    """A stopping criterion of the older kind: one Python bool for the whole batch (plain generate takes it)."""

    def __call__(self, input_ids, scores, **kwargs):
        return bool(input_ids.shape[1] >= 15)


@pytest.mark.parametrize("batch", [1, 3])
def test_a_stopping_criterion_returning_a_bool_works_as_in_plain_generate(target, draft, batch):
    from transformers import StoppingCriteriaList

    ids, mask = left_padded_batch()
    kwargs = {"attention_mask": mask[:batch], "max_new_tokens": 10, "do_sample": False}
    expected = target.generate(ids[:batch], stopping_criteria=StoppingCriteriaList([_StopAtLength()]), **kwargs)
    got = target.generate(ids[:batch], stopping_criteria=StoppingCriteriaList([_StopAtLength()]),
                          assistant_model=draft, **kwargs)
    assert expected.shape[1] == 15 and torch.equal(got, expected)
