"""End to end through the stock ``target.generate(..., assistant_model=draft)``: greedy output must be token-identical
to plain greedy for every row of every batch; the oracle drafter drives accept-all / partial / EOS-mid-block paths."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_drafter, make_tiny_llama, make_tiny_qwen3

from hf_dspark import DSparkDraftModel

VOCAB = 96
NUM_PROMPTS = 20


def random_prompts(n: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(3, 17, (1,), generator=gen)),), generator=gen)
            for _ in range(n)]


def left_pad(prompts: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    return ids, mask


def plain_greedy(target, prompt: torch.Tensor, **kwargs) -> list[int]:
    out = target.generate(prompt[None], do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist()


def strip_pad(tokens: list[int], reference: list[int], pad: int = 0) -> list[int]:
    return tokens[: len(reference)] if tokens[len(reference):] == [pad] * (len(tokens) - len(reference)) else tokens


def speculative_rows(target, draft, prompts, batch_size: int, **kwargs) -> list[list[int]]:
    rows = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        ids, mask = left_pad(chunk)
        out = target.generate(ids, attention_mask=mask, do_sample=False, assistant_model=draft, **kwargs)
        rows.extend(out[:, ids.shape[1]:].tolist())
    return rows


@pytest.fixture(scope="module")
def target():
    return make_tiny_llama(seed=0)


@pytest.fixture(scope="module")
def draft(target):
    return make_tiny_drafter(target, seed=1, block_size=5, markov_rank=16)


@pytest.fixture(scope="module")
def references(target):
    prompts = random_prompts(NUM_PROMPTS)
    return prompts, [plain_greedy(target, p, max_new_tokens=24) for p in prompts]


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_greedy_identical_to_plain_generate(target, draft, references, batch_size):
    prompts, expected = references
    got = speculative_rows(target, draft, prompts, batch_size, max_new_tokens=24)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert strip_pad(g, e) == e, f"prompt {i}, batch {batch_size}"


class OracleDrafter:
    """Wraps a real drafter; its blocks are the target's greedy continuation with the first ``k`` slots right and
    the rest wrong, k cycling through ``pattern`` — drives accept-all, partial and reject-first rounds."""

    def __init__(self, draft, target, pattern):
        self.draft, self.target, self.pattern, self.calls = draft, target, pattern, 0
        self.original = draft.draft_block

    def __call__(self, cache, anchor_ids, anchor_positions, *, logits_processor=None, **kwargs):
        block = self.original(cache, anchor_ids, anchor_positions, logits_processor=logits_processor, **kwargs)
        gamma = block.tokens.shape[1]
        tokens = []
        for prefix in logits_processor.prefixes:
            real = prefix[(prefix != 0).nonzero()[0, 0]:] if (prefix != 0).any() else prefix
            cont = self.target.__dict__["_hf_dspark_original_generate"](
                real[None], do_sample=False, max_new_tokens=gamma, min_new_tokens=gamma)[0, len(real):]
            k = self.pattern[self.calls % len(self.pattern)]
            self.calls += 1
            row = cont.clone()
            row[k:] = (row[k:] + 1) % VOCAB
            tokens.append(row)
        block.tokens = torch.stack(tokens)
        return block


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 13, 26])
def test_oracle_acceptance_paths_and_length_limit_mid_block(target, draft, references, monkeypatch, max_new_tokens):
    prompts, _ = references
    oracle = OracleDrafter(draft, target, pattern=[5, 0, 2, 4, 5, 1, 3])
    monkeypatch.setattr(draft, "draft_block", oracle)
    expected = [plain_greedy(target, p, max_new_tokens=max_new_tokens) for p in prompts[:8]]
    # every round verifies the oracle's whole block (the fixed policy; no lookup, whose proposals would stand in
    # for the drafter's): each acceptance path of the pattern really runs
    got = speculative_rows(target, draft, prompts[:8], 4, max_new_tokens=max_new_tokens, dspark_policy="fixed",
                           dspark_lookup=False)
    for g, e in zip(got, expected):
        assert strip_pad(g, e) == e
    if max_new_tokens > 7:
        assert draft.stats.tau > 2.0  # the oracle's accepted blocks were really used
        assert set(draft.stats.by_source) <= {"drafter", "none"}


def test_eos_inside_an_accepted_block(target, draft, references, monkeypatch):
    prompts, expected_long = references
    oracle = OracleDrafter(draft, target, pattern=[5])  # every draft right: EOS arrives inside accepted blocks
    monkeypatch.setattr(draft, "draft_block", oracle)
    for prompt, cont in list(zip(prompts, expected_long))[:6]:
        eos = cont[9]  # a token the target really emits mid-way becomes the end-of-sequence token
        expected = plain_greedy(target, prompt, max_new_tokens=24, eos_token_id=eos)
        ids, mask = left_pad([prompt])
        out = target.generate(ids, attention_mask=mask, do_sample=False, assistant_model=draft, max_new_tokens=24,
                              eos_token_id=eos)
        assert out[0, ids.shape[1]:].tolist() == expected
        assert expected[-1] == eos


def test_batch_with_eos_rows_finishing_at_different_rounds(target, draft, references):
    prompts, expected_long = references
    eos = expected_long[0][5]
    expected = [plain_greedy(target, p, max_new_tokens=20, eos_token_id=eos) for p in prompts[:8]]
    ids, mask = left_pad(prompts[:8])
    out = target.generate(ids, attention_mask=mask, do_sample=False, assistant_model=draft, max_new_tokens=20,
                          eos_token_id=eos, pad_token_id=0)
    for row, e in zip(out[:, ids.shape[1]:].tolist(), expected):
        assert row[: len(e)] == e and all(t == 0 for t in row[len(e):])


def test_qwen3_target_greedy_identical():
    target = make_tiny_qwen3(seed=3)
    torch.manual_seed(4)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=4, head="rnn", markov_rank=8).eval()
    prompts = random_prompts(6, seed=5)
    expected = [plain_greedy(target, p, max_new_tokens=16) for p in prompts]
    got = speculative_rows(target, draft, prompts, 3, max_new_tokens=16)
    for g, e in zip(got, expected):
        assert strip_pad(g, e) == e


@pytest.mark.parametrize("head", ["none", "gated"])
def test_other_heads_greedy_identical(target, references, head):
    torch.manual_seed(2)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=3, head=head, markov_rank=8).eval()
    prompts, expected = references
    got = speculative_rows(target, draft, prompts[:6], 6, max_new_tokens=24)
    for g, e in zip(got, expected[:6]):
        assert strip_pad(g, e) == e


def test_return_dict_and_scores_match_plain(target, draft, references):
    prompt = references[0][0]
    plain = target.generate(prompt[None], do_sample=False, max_new_tokens=10, return_dict_in_generate=True,
                            output_scores=True)
    ours = target.generate(prompt[None], do_sample=False, max_new_tokens=10, return_dict_in_generate=True,
                           output_scores=True, assistant_model=draft)
    assert torch.equal(plain.sequences, ours.sequences)
    assert len(ours.scores) == len(plain.scores)
    for a, b in zip(plain.scores, ours.scores):
        assert torch.allclose(a, b, atol=1e-4)


def test_stats_are_reset_per_call(target, draft, references):
    prompt = references[0][0]
    target.generate(prompt[None], do_sample=False, max_new_tokens=12, assistant_model=draft)
    first = draft.stats
    target.generate(prompt[None], do_sample=False, max_new_tokens=12, assistant_model=draft)
    assert draft.stats is not first
    assert draft.stats.committed_tokens == 11  # the first token comes from the prefill, not a round
    assert draft.stats.tau >= 1.0


def test_beam_search_is_refused(target, draft, references):
    with pytest.raises(ValueError, match="beam"):
        target.generate(references[0][0][None], num_beams=2, max_new_tokens=4, assistant_model=draft)


def test_drafter_for_another_target_is_refused(draft):
    other = make_tiny_llama(seed=0, num_layers=6)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        draft.bind_target(other)
    same_shape = make_tiny_llama(seed=9)
    with pytest.raises(ValueError, match="embedding"):
        draft.bind_target(same_shape)


def test_static_cache_is_refused(target, draft, references):
    with pytest.raises(ValueError, match="DynamicCache"):
        target.generate(references[0][0][None], max_new_tokens=4, assistant_model=draft,
                        cache_implementation="static")


def test_processors_reading_ids_match_plain(target, draft, references):
    """Repetition penalty and no-repeat-n-gram read each row's ids: drafts and verification must see the same."""
    prompts, _ = references
    kwargs = dict(max_new_tokens=20, repetition_penalty=1.5, no_repeat_ngram_size=3)
    expected = [plain_greedy(target, p, **kwargs) for p in prompts[:6]]
    got = speculative_rows(target, draft, prompts[:6], 3, **kwargs)
    for g, e in zip(got, expected):
        assert strip_pad(g, e) == e


def test_fixed_length_and_confidence_threshold(target, draft, references):
    prompt = references[0][0]
    expected = plain_greedy(target, prompt, max_new_tokens=16)
    out = target.generate(prompt[None], do_sample=False, max_new_tokens=16, assistant_model=draft, dspark_num_tokens=2)
    assert out[0, len(prompt):].tolist() == expected
    assert max(j for j, n in enumerate(draft.stats.proposed_at) if n) == 1  # never more than 2 drafts a round
    out = target.generate(prompt[None], do_sample=False, max_new_tokens=16, assistant_model=draft,
                          dspark_confidence_threshold=1.01)  # nothing is that confident: plain decoding steps
    assert out[0, len(prompt):].tolist() == expected
    assert draft.stats.proposed_tokens == 0


def test_min_new_tokens_in_a_padded_batch_matches_each_row_alone(target, draft, references):
    prompts, expected_long = references
    eos = expected_long[0][3]
    kwargs = dict(max_new_tokens=14, min_new_tokens=6, eos_token_id=eos, pad_token_id=0)
    expected = [plain_greedy(target, p, **kwargs) for p in prompts[:4]]
    got = speculative_rows(target, draft, prompts[:4], 4, **kwargs)
    for g, e in zip(got, expected):
        assert g[: len(e)] == e and all(t == 0 for t in g[len(e):])


def test_min_length_in_a_padded_batch_matches_plain_batched_generate(target, draft, references):
    """min_length counts the padded length in plain batched generate; each unpadded row must see it the same way
    (and with a repetition penalty beside it, both processors run batched across the rows)."""
    prompts, expected_long = references
    eos = expected_long[0][3]
    ids, mask = left_pad(prompts[:4])
    kwargs = dict(max_new_tokens=14, min_length=ids.shape[1] + 6, eos_token_id=eos, pad_token_id=0,
                  repetition_penalty=1.3, do_sample=False)
    plain = target.generate(ids, attention_mask=mask, **kwargs)[:, ids.shape[1]:]
    ours = target.generate(ids, attention_mask=mask, assistant_model=draft, **kwargs)[:, ids.shape[1]:]
    assert ours.tolist() == plain.tolist()
