"""verify(): literal greedy cases, ragged rows, and the sampling rule against a slow reference and p itself."""

from __future__ import annotations

import pytest
import torch

from hf_dspark.speculation.verification import PLACEHOLDER_TOKEN_ID, verify

P = PLACEHOLDER_TOKEN_ID


def one_hot_logits(argmax_tokens: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(1, len(argmax_tokens), vocab)
    for i, t in enumerate(argmax_tokens):
        logits[0, i, t] = 5.0
    return logits


def test_perfect_match_takes_bonus():
    r = verify(torch.tensor([[1, 2, 3]]), torch.tensor([3]), one_hot_logits([1, 2, 3, 7]), do_sample=False)
    assert r.num_accepted.tolist() == [3]
    assert r.output_tokens.tolist() == [[1, 2, 3, 7]]
    assert r.next_tokens.tolist() == [7]


def test_early_mismatch_recovers_target_token():
    r = verify(torch.tensor([[1, 5, 3]]), torch.tensor([3]), one_hot_logits([1, 2, 3, 7]), do_sample=False)
    assert r.num_accepted.tolist() == [1]
    assert r.output_tokens.tolist() == [[1, 2, P, P]]


def test_first_mismatch():
    r = verify(torch.tensor([[4, 2, 3]]), torch.tensor([3]), one_hot_logits([1, 2, 3, 7]), do_sample=False)
    assert r.output_tokens.tolist() == [[1, P, P, P]]


def test_unproposed_slots_are_ignored():
    # drafts beyond num_drafts match the target but were not proposed: the bonus comes right after the proposal
    r = verify(torch.tensor([[1, 2, 3]]), torch.tensor([1]), one_hot_logits([1, 2, 3, 7]), do_sample=False)
    assert r.output_tokens.tolist() == [[1, 2, P, P]]
    assert r.num_accepted.tolist() == [1]


def test_zero_drafts_is_a_plain_step():
    r = verify(torch.tensor([[9, 9]]), torch.tensor([0]), one_hot_logits([4, 5, 6]), do_sample=False)
    assert r.output_tokens.tolist() == [[4, P, P]]


def test_ragged_batch_rows_are_independent():
    logits = torch.cat([one_hot_logits([1, 2, 3, 7]), one_hot_logits([1, 2, 3, 7])])
    r = verify(torch.tensor([[1, 2, 3], [1, 9, 3]]), torch.tensor([3, 2]), logits, do_sample=False)
    assert r.num_accepted.tolist() == [3, 1]
    assert r.output_tokens.tolist() == [[1, 2, 3, 7], [1, 2, P, P]]


def test_sampling_needs_q():
    with pytest.raises(ValueError, match="draft_probs"):
        verify(torch.tensor([[1]]), torch.tensor([1]), one_hot_logits([1, 2]), None, do_sample=True)


def _reference_first_token(draft, q, p, u, residual_draw):
    """Slow scalar reference of the rule for one draft: accept with min(1, p/q), else draw the residual."""
    if u < min(1.0, float(p[draft] / q[draft])):
        return draft
    residual = (p - q).clamp(min=0)
    return residual_draw(residual / residual.sum())


def test_sampling_output_distribution_is_the_target_distribution():
    """Draft x ~ q, verify against p: the first committed token must be distributed as p, exactly."""
    torch.manual_seed(0)
    vocab, n = 5, 60000
    p_logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])
    q_probs = torch.tensor([0.1, 0.5, 0.1, 0.2, 0.1])
    drafts = torch.multinomial(q_probs, n, replacement=True)[:, None]
    gen = torch.Generator().manual_seed(1)
    r = verify(drafts, torch.ones(n, dtype=torch.long), p_logits.expand(n, 2, vocab).clone(),
               q_probs.expand(n, 1, vocab).clone(), do_sample=True, generator=gen)
    first = r.output_tokens[:, 0]
    empirical = torch.bincount(first, minlength=vocab).float() / n
    expected = torch.softmax(p_logits, -1)
    assert torch.allclose(empirical, expected, atol=0.01), (empirical, expected)
    # acceptance rate equals Σ min(p, q)
    assert abs(r.num_accepted.float().mean() - torch.minimum(expected, q_probs).sum()) < 0.01


def test_sampling_matches_scalar_reference_rule():
    torch.manual_seed(3)
    vocab = 4
    p = torch.softmax(torch.randn(vocab), -1)
    q = torch.softmax(torch.randn(vocab), -1)
    n = 40000
    drafts = torch.multinomial(q, n, replacement=True)
    gen = torch.Generator().manual_seed(7)
    r = verify(drafts[:, None], torch.ones(n, dtype=torch.long), p.log().expand(n, 2, vocab).clone(),
               q.expand(n, 1, vocab).clone(), do_sample=True, generator=gen)
    ref_gen = torch.Generator().manual_seed(11)
    uniform = torch.rand(n, generator=ref_gen)
    draw = lambda dist: int(torch.multinomial(dist, 1, generator=ref_gen))  # noqa: E731
    reference = torch.tensor([_reference_first_token(int(d), q, p, float(u), draw) for d, u in zip(drafts, uniform)])
    ours = torch.bincount(r.output_tokens[:, 0], minlength=vocab).float() / n
    theirs = torch.bincount(reference, minlength=vocab).float() / n
    assert torch.allclose(ours, theirs, atol=0.012)
    assert torch.allclose(ours, p, atol=0.012)


@pytest.mark.parametrize("do_sample", [False, True])
def test_full_blocks_need_no_lengths_tensor(do_sample):
    """num_drafts=None (every row proposes all γ, known on the host) decides exactly as the explicit lengths, and
    the committed mask it returns marks the accepted drafts and the next token."""
    torch.manual_seed(5)
    rows, gamma, vocab = 6, 4, 7
    logits = torch.randn(rows, gamma + 1, vocab) * 3
    q = torch.softmax(torch.randn(rows, gamma, vocab), -1)
    drafts = torch.multinomial(q.view(-1, vocab), 1).view(rows, gamma)
    drafts[:3] = logits[:3, :gamma].argmax(-1)  # some rows accept everything greedily
    results = []
    for num_drafts, host in ((torch.full((rows,), gamma), None), (None, [gamma] * rows),
                             (torch.full((rows,), gamma), [gamma] * rows)):
        gen = torch.Generator().manual_seed(9)
        results.append(verify(drafts, num_drafts, logits.clone(), q if do_sample else None, do_sample=do_sample,
                              generator=gen, host_num_drafts=host))
    for r in results[1:]:
        assert torch.equal(r.num_accepted, results[0].num_accepted)
        assert torch.equal(r.output_tokens, results[0].output_tokens)
    for r in results:
        expected = torch.arange(gamma + 1)[None, :] <= r.num_accepted[:, None]
        assert torch.equal(r.committed_mask(), expected)
