"""pipeline("text-generation", assistant_model=draft) and streamers give exactly what plain generate gives."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import TINY_VOCAB, make_tiny_llama
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, TextIteratorStreamer, pipeline

from hf_dspark import DSparkDraftModel


def make_word_tokenizer(vocab_size: int = TINY_VOCAB) -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def setup():
    target = make_tiny_llama(seed=0)
    torch.manual_seed(1)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=5, markov_rank=16).eval()
    return target, draft, make_word_tokenizer()


PROMPTS = ["w5 w17 w33 w8", "w40 w41 w90 w3 w77 w12", "w60"]


def test_pipeline_text_equals_plain(setup):
    target, draft, tok = setup
    plain = pipeline("text-generation", model=target, tokenizer=tok)
    ours = pipeline("text-generation", model=target, tokenizer=tok, assistant_model=draft)
    for prompt in PROMPTS:
        expected = plain(prompt, max_new_tokens=16, do_sample=False)[0]["generated_text"]
        draft.stats = None
        got = ours(prompt, max_new_tokens=16, do_sample=False)[0]["generated_text"]
        assert got == expected
        assert draft.stats is not None and draft.stats.rounds > 0  # the speculative path really ran


def test_pipeline_batch_size_above_one(setup):
    target, draft, tok = setup
    tok.padding_side = "left"
    plain = pipeline("text-generation", model=target, tokenizer=tok)
    ours = pipeline("text-generation", model=target, tokenizer=tok, assistant_model=draft)
    expected = [plain(p, max_new_tokens=12, do_sample=False)[0]["generated_text"] for p in PROMPTS]
    got = ours(PROMPTS, max_new_tokens=12, do_sample=False, batch_size=3)
    assert [g[0]["generated_text"] for g in got] == expected


def test_iterator_streamer_streams_the_generated_text(setup):
    target, draft, tok = setup
    ids = tok(PROMPTS[1], return_tensors="pt")
    expected = target.generate(**ids, max_new_tokens=20, do_sample=False)
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("out", target.generate(
        **ids, max_new_tokens=20, do_sample=False, assistant_model=draft, streamer=streamer)))
    thread.start()
    text = "".join(streamer)
    thread.join()
    assert torch.equal(result["out"], expected)
    assert text.strip() == tok.decode(expected[0, ids["input_ids"].shape[1]:]).strip()


def test_a_pipeline_conversation_reuses_its_prefix_without_any_keyword(setup):
    """An agent loop through ``pipeline`` passes no hf-dspark keyword: its next turn still prefills only what is new
    (calls on a target share their caches by default) and equals plain greedy."""
    from hf_dspark.speculation.shared_state import forget

    target, draft, tok = setup
    forget(target)
    plain = pipeline("text-generation", model=target, tokenizer=tok)
    ours = pipeline("text-generation", model=target, tokenizer=tok, assistant_model=draft)
    conversation = " ".join(f"w{3 + (7 * i) % 90}" for i in range(30))
    previous_prompt_tokens = 0
    for turn in range(3):
        expected = plain(conversation, max_new_tokens=8, do_sample=False)[0]["generated_text"]
        got = ours(conversation, max_new_tokens=8, do_sample=False)[0]["generated_text"]
        assert got == expected
        if turn:  # at least the previous turn's prompt was reused (its reply re-tokenises on the word boundary)
            assert draft.stats.reused_prompt_tokens >= previous_prompt_tokens - 1 >= 29
        previous_prompt_tokens = len(tok(conversation)["input_ids"])
        conversation = got + " w9 w10 w11"
    forget(target)


def test_a_deep_copy_of_a_bound_target_generates_with_its_own_weights(setup):
    """``copy.deepcopy(target)`` after binding (a fine-tuned variant with the same embedding, two pipelines): the
    copy's ``generate``, plain or with the drafter, runs the copy, not the target it was copied from."""
    import copy

    from hf_dspark.speculation.shared_state import forget

    _, _, tok = setup
    target = make_tiny_llama(seed=0)
    torch.manual_seed(1)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=5, markov_rank=16).eval()
    clone = copy.deepcopy(target)
    with torch.no_grad():
        for layer in clone.model.layers:  # other weights, the same embedding and LM head: the drafter still fits
            layer.mlp.down_proj.weight.mul_(-1)
    prompt = PROMPTS[1]
    ids = tok(prompt, return_tensors="pt")
    expected = type(clone).generate(clone, **ids, max_new_tokens=12, do_sample=False)  # no wrapper involved
    assert not torch.equal(expected, target.generate(**ids, max_new_tokens=12, do_sample=False))
    assert torch.equal(clone.generate(**ids, max_new_tokens=12, do_sample=False), expected)
    got = pipeline("text-generation", model=clone, tokenizer=tok, assistant_model=draft)(
        prompt, max_new_tokens=12, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
    assert got == expected[0].tolist()
    assert draft.stats.rounds > 0 and draft.target is clone
    forget(target), forget(clone)


def test_a_pipeline_takes_a_drafter_loaded_for_a_target_with_other_special_token_ids(setup, tmp_path):
    """A drafter saved with its training target's config, loaded for the same weights under a config with other
    special ids (another revision; pad_token_id set by the user): transformers' pipeline compares the assistant's
    ids with the target's and refused it ("pass the assistant tokenizer"). Bound, a drafter carries its target's."""
    _, draft, tok = setup
    draft.save_pretrained(tmp_path)
    other = make_tiny_llama(seed=0)
    other.config.eos_token_id, other.config.pad_token_id = [2, 7], None
    loaded = DSparkDraftModel.from_pretrained(tmp_path, target=other).eval()
    expected = pipeline("text-generation", model=other, tokenizer=tok)(PROMPTS[0], max_new_tokens=10, do_sample=False)
    got = pipeline("text-generation", model=other, tokenizer=tok, assistant_model=loaded)(
        PROMPTS[0], max_new_tokens=10, do_sample=False)
    assert got == expected
    assert loaded.stats.rounds > 0


def test_pipeline_num_return_sequences_with_sampling(setup):
    target, draft, tok = setup
    ours = pipeline("text-generation", model=target, tokenizer=tok, assistant_model=draft)
    torch.manual_seed(0)
    got = ours(PROMPTS[0], max_new_tokens=6, do_sample=True, top_k=5, top_p=0.9, num_return_sequences=3)
    assert len(got) == 3 and all(g["generated_text"].startswith(PROMPTS[0]) for g in got)
    assert draft.stats.rounds > 0  # the speculative path ran
