"""Sampling is lossless: the distribution of the first generated tokens with and without the drafter agrees
(per-position two-sample χ²), and the same test catches a deliberately wrong q."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama
from scipy.stats import chi2_contingency

import hf_dspark.generation.generate as generate_module
from hf_dspark import DSparkDraftModel

VOCAB = 16
NUM_NEW = 3
ROWS, CALLS = 500, 4


@pytest.fixture(scope="module")
def setup():
    target = make_tiny_llama(seed=11, vocab_size=VOCAB)
    torch.manual_seed(12)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=4, markov_rank=8).eval()
    prompt = torch.tensor([[5, 9, 3, 12, 7, 4]])
    return target, draft, prompt


# Every round proposes the whole block (the threshold policy at 0): these tests check verification, so they must
# not depend on whether the default cost-aware scheduler finds drafting worth it for 500 rows of a tiny model.
FULL_BLOCK = {"dspark_confidence_threshold": 0.0}


def sample_tokens(target, prompt, seed, calls: int = CALLS, **kwargs) -> torch.Tensor:
    torch.manual_seed(seed)
    batches = [target.generate(prompt.expand(ROWS, -1), do_sample=True, temperature=0.9, top_k=10,
                               max_new_tokens=NUM_NEW, pad_token_id=0, **kwargs)[:, prompt.shape[1]:]
               for _ in range(calls)]
    out = torch.cat(batches)
    return torch.nn.functional.pad(out, (0, NUM_NEW - out.shape[1]), value=0)


def per_position_pvalues(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    pvalues = []
    for pos in range(NUM_NEW):
        counts = torch.stack([torch.bincount(a[:, pos], minlength=VOCAB), torch.bincount(b[:, pos], minlength=VOCAB)])
        counts = counts[:, counts.sum(0) > 0]
        pvalues.append(float(chi2_contingency(counts.numpy())[1]))
    return pvalues


def test_sampling_preserves_target_distribution(setup):
    target, draft, prompt = setup
    plain = sample_tokens(target, prompt, seed=0)
    ours = sample_tokens(target, prompt, seed=1, assistant_model=draft, **FULL_BLOCK)
    assert draft.stats.accepted_tokens > 0 and draft.stats.accepted_tokens < draft.stats.proposed_tokens
    pvalues = per_position_pvalues(plain, ours)
    assert min(pvalues) > 1e-3, pvalues


def test_chi2_catches_a_wrong_q(setup, monkeypatch):
    """Negative control: verifying with a q the drafts were NOT sampled from (uniform) must be detected."""
    target, draft, prompt = setup
    real_verify = generate_module.verify

    def verify_with_wrong_q(drafts, num_drafts, target_logits, draft_probs, **kwargs):
        wrong = torch.full_like(draft_probs, 1.0 / draft_probs.shape[-1])
        return real_verify(drafts, num_drafts, target_logits, wrong, **kwargs)

    monkeypatch.setattr(generate_module, "verify", verify_with_wrong_q)
    plain = sample_tokens(target, prompt, seed=0)
    wrong = sample_tokens(target, prompt, seed=1, assistant_model=draft, **FULL_BLOCK)
    assert min(per_position_pvalues(plain, wrong)) < 1e-6


def test_sampling_with_a_reduced_draft_vocabulary_preserves_target_distribution(setup):
    """q = 0 on the tokens the drafter cannot propose: the residual max(p − q, 0) must still give them their mass."""
    target, _, prompt = setup
    torch.manual_seed(12)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=4, markov_rank=8,
                                         draft_vocab=list(range(0, VOCAB, 2))).eval()
    plain = sample_tokens(target, prompt, seed=0)
    ours = sample_tokens(target, prompt, seed=1, assistant_model=draft, **FULL_BLOCK)
    assert 0 < draft.stats.accepted_tokens < draft.stats.proposed_tokens
    assert (ours % 2 == 1).any()  # tokens outside the draft vocabulary do get generated
    assert min(per_position_pvalues(plain, ours)) > 1e-3


# -- the draw itself (hf_dspark.sampling.sample_rows: inverse CDF, not torch.multinomial) ----------------------------
def test_sample_rows_draws_from_the_given_distribution_and_never_a_zero():
    from scipy.stats import chisquare

    from hf_dspark.sampling import sample_rows

    probs = torch.tensor([0.0, 0.1, 0.0, 0.45, 0.25, 0.2, 0.0])  # zeros first, inside and last
    draws = sample_rows(probs.repeat(40_000, 1), torch.Generator().manual_seed(3))
    counts = torch.bincount(draws, minlength=probs.numel())
    assert counts[probs == 0].sum() == 0
    assert chisquare(counts[probs > 0].numpy(), (probs[probs > 0] * draws.numel()).numpy()).pvalue > 1e-3
    # unnormalised rows are fine (the residual of a rejection is divided by its mass only when positive)
    assert sample_rows(torch.tensor([[0.0, 3.0, 0.0]]), None).tolist() == [1]
    # a uniform that rounds up to the total still lands on the last token with mass, not a trailing zero
    assert sample_rows(torch.tensor([[0.5, 0.5, 0.0, 0.0]]), None).item() in (0, 1)


def test_sample_rows_per_row_generators_draw_once_each_whatever_the_batch():
    """Each request's stream is its own: a row's token depends on its generator only, and each row consumes exactly
    one draw (the next draw of that generator is the same as after a single-row call)."""
    from hf_dspark.sampling import sample_rows

    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), -1)
    alone = [sample_rows(probs[r:r + 1], [torch.Generator().manual_seed(10 + r)]).item() for r in range(3)]
    gens = [torch.Generator().manual_seed(10 + r) for r in range(3)]
    assert sample_rows(probs, gens).tolist() == alone
    after = [torch.Generator().manual_seed(10 + r) for r in range(3)]
    for g in after:
        torch.rand(1, dtype=torch.float64, generator=g)
    assert [torch.rand(1, generator=g).item() for g in gens] == [torch.rand(1, generator=g).item() for g in after]


def test_sample_rows_refuses_a_row_without_mass():
    from hf_dspark.sampling import sample_rows

    for bad in ([[0.0, 0.0]], [[float("nan"), 1.0]], [[float("inf"), 1.0]]):
        with pytest.raises(ValueError, match="positive, finite total"):
            sample_rows(torch.tensor(bad), None)


def _warped_probabilities(scores: torch.Tensor, temperature: float, top_p: float, top_k: int | None) -> torch.Tensor:
    """transformers' own chain (temperature, top-k, top-p, softmax): the distribution ``do_sample=True`` draws from."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warped = TemperatureLogitsWarper(temperature)(None, scores.clone())
    if top_k:
        warped = TopKLogitsWarper(top_k)(None, warped)
    if top_p < 1.0:
        warped = TopPLogitsWarper(top_p)(None, warped)
    return torch.softmax(warped, dim=-1)


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.2, 0.9, None), (1.0, 0.9, None), (0.7, 0.5, None),
                                                     (1.5, 0.99, None), (1.0, 1.0, None), (0.8, 0.9, 20)])
def test_nucleus_keeps_the_tokens_and_probabilities_the_warpers_keep(temperature, top_p, top_k):
    """Peaked rows (the nucleus inside the 64 candidates) and flat ones (it reaches past them: the whole vocabulary
    is ranked) in one batch, over a 4,096-token vocabulary."""
    from hf_dspark.sampling import nucleus

    gen = torch.Generator().manual_seed(7)
    scores = torch.randn(12, 4096, generator=gen) * torch.tensor([8.0] * 6 + [0.5] * 6)[:, None]
    ids, probs = nucleus(scores, temperature, top_p, top_k)
    ours = torch.zeros_like(scores).scatter_add_(1, ids, probs)
    ours = ours / ours.sum(-1, keepdim=True)
    want = _warped_probabilities(scores, temperature, top_p, top_k)
    assert torch.equal(ours > 0, want > 0)
    torch.testing.assert_close(ours, want, atol=1e-6, rtol=1e-4)


def test_nucleus_draw_under_greedy_generate_samples_what_do_sample_would():
    """The processor that draws (regeneration's sampler) matches the warpers' distribution (χ²), and greedy
    ``generate`` with it emits exactly the drawn tokens."""
    from scipy.stats import chisquare

    from hf_dspark.sampling import NucleusDraw

    scores = torch.tensor([[2.0, 1.5, 0.3, -1.0, 1.9, 0.0, -3.0, 1.2]])
    want = _warped_probabilities(scores, 0.8, 0.9, None)[0]
    draw = NucleusDraw(0.8, top_p=0.9, generator=torch.Generator().manual_seed(5))
    out = draw(None, scores.repeat(30_000, 1))
    assert bool((torch.isfinite(out).sum(-1) == 1).all())
    counts = torch.bincount(out.argmax(-1), minlength=scores.shape[-1])
    assert counts[want == 0].sum() == 0
    expected = want[want > 0].double()
    expected = (expected / expected.sum() * counts.sum()).numpy()
    assert chisquare(counts[want > 0].numpy(), expected).pvalue > 1e-3
    with pytest.raises(ValueError, match="temperature must be > 0"):
        NucleusDraw(0.0)

    from transformers import LogitsProcessorList

    target = make_tiny_llama(seed=3, vocab_size=VOCAB)
    prompt = torch.tensor([[5, 9, 3, 12], [4, 4, 7, 1]])
    drawn = []

    class Recording(NucleusDraw):
        def __call__(self, input_ids, scores):
            out = super().__call__(input_ids, scores)
            drawn.append(out.argmax(-1))
            return out

    torch.manual_seed(0)
    out = target.generate(prompt, do_sample=False, max_new_tokens=6, min_new_tokens=6, pad_token_id=0,
                          logits_processor=LogitsProcessorList([Recording(1.0, top_p=0.95)]))
    assert torch.equal(out[:, prompt.shape[1]:], torch.stack(drawn, dim=1))
    assert len({tuple(r) for r in out[:, prompt.shape[1]:].tolist()}) == 2  # it samples: rows differ


class _BanEvenTokensAtEvenLengths:
    """A constraint (as grammar-constrained decoding applies one) that, at every other position, allows only odd
    tokens: there a drafter whose vocabulary is the even tokens has no allowed token at all."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        banned = (input_ids.shape[1] % 2 == 0) & (torch.arange(scores.shape[-1]) % 2 == 0)
        return scores.masked_fill(banned, float("-inf"))


def test_a_constraint_leaving_the_drafter_no_token_still_samples_the_target_distribution(setup):
    """Processors can leave a draft slot no finite logit (the allowed tokens all lie outside the draft vocabulary):
    plain generate samples fine there, so the drafter must too (it used to raise in sample_rows)."""
    from transformers import LogitsProcessorList

    target, _, prompt = setup
    torch.manual_seed(12)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=4, markov_rank=8,
                                         draft_vocab=list(range(0, VOCAB, 2))).eval()
    constraint = {"logits_processor": LogitsProcessorList([_BanEvenTokensAtEvenLengths()])}
    # half the usual draws: a processor that reads the ids runs once per row, and without the fix this raises anyway
    plain = sample_tokens(target, prompt, seed=0, calls=CALLS // 2, **constraint)
    ours = sample_tokens(target, prompt, seed=1, calls=CALLS // 2, assistant_model=draft, **FULL_BLOCK, **constraint)
    assert 0 < draft.stats.accepted_tokens < draft.stats.proposed_tokens
    constrained = ours[:, ::2]  # the constraint holds where the drafter had nothing to propose (0: after EOS)
    assert ((constrained % 2 == 1) | (constrained == 0)).all()
    assert min(per_position_pvalues(plain, ours)) > 1e-3


def test_a_callers_repetition_penalty_ignoring_prompt_positions_counts_them_in_the_padded_batch(setup):
    """``RepetitionPenaltyLogitsProcessor(prompt_ignore_length=n)`` passed by the caller skips the first n positions
    of the padded batch plain generate shows it: in a left-padded row those include its padding, so fewer of its
    own tokens are skipped (they were skipped as if the row had no padding)."""
    from transformers import LogitsProcessorList
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    target, draft, _ = setup
    # one unpadded row, then rows with four own tokens after two pads (the rows compared)
    prompts = torch.tensor([[5, 9, 3, 12, 7, 4]] + [[0, 0, 11, 6, 13, 6]] * 3)
    mask = (prompts != 0).long()

    def sample_padded_rows(seed: int, **kwargs) -> torch.Tensor:
        torch.manual_seed(seed)
        penalty = RepetitionPenaltyLogitsProcessor(3.0, prompt_ignore_length=4)  # padded rows: penalise 13 and 6
        out = [target.generate(prompts.repeat(ROWS // 4, 1), attention_mask=mask.repeat(ROWS // 4, 1),
                               do_sample=True, max_new_tokens=NUM_NEW, pad_token_id=0,
                               logits_processor=LogitsProcessorList([penalty]), **kwargs)[:, prompts.shape[1]:]
               for _ in range(CALLS // 2)]
        out = torch.nn.functional.pad(torch.cat(out), (0, NUM_NEW - out[0].shape[1]), value=0)
        return out[torch.arange(out.shape[0]) % 4 != 0]

    plain = sample_padded_rows(0)
    ours = sample_padded_rows(1, assistant_model=draft, **FULL_BLOCK)
    assert 0 < draft.stats.accepted_tokens < draft.stats.proposed_tokens
    assert min(per_position_pvalues(plain, ours)) > 1e-3


@pytest.mark.parametrize("batch", [1, 2])
def test_num_return_sequences_samples_each_row_that_many_times(setup, batch):
    """transformers repeats each row ``num_return_sequences`` times before the speculative loop runs, as for plain
    sampling: the same tokens as the repeated batch (whose distribution the tests above check), in plain's order."""
    target, draft, prompt = setup
    ids = torch.cat([prompt, torch.tensor([[0, 0, 0, 5, 9, 3]])])[:batch]
    mask = (torch.arange(6)[None] >= torch.tensor([0, 3])[:batch, None]).long()
    kwargs = {"do_sample": True, "temperature": 0.9, "max_new_tokens": 6, "pad_token_id": 0, "assistant_model": draft,
              **FULL_BLOCK}
    torch.manual_seed(3)
    got = target.generate(ids, attention_mask=mask, num_return_sequences=3, **kwargs)
    torch.manual_seed(3)
    repeated = target.generate(ids.repeat_interleave(3, 0), attention_mask=mask.repeat_interleave(3, 0), **kwargs)
    assert got.shape[0] == 3 * batch and torch.equal(got, repeated)
    assert len({tuple(row) for row in got[:3].tolist()}) > 1  # the copies are sampled, not one sample repeated
