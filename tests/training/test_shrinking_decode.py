"""The regeneration's decode loop: finished rows leave the batch, the answers stay ``generate``'s."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama
from transformers import DynamicCache

from hf_dspark.sampling import nucleus
from hf_dspark.training.shrinking_decode import decode_shrinking, greedy_tokens, nucleus_sampler

PROMPTS = [[5, 9, 13, 40, 7, 7, 22], [31, 8], [60, 61, 62, 63], [11, 12, 13, 14, 15, 16, 17, 18, 19], [77]]


def left_padded(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(seed=0)


def common_eos(model, ids, mask) -> int:
    """A token several rows emit at different steps, so that as end of sequence rows finish at different times."""
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[:, ids.shape[1]:]
    first_steps: dict[int, list[int]] = {}  # token -> the step where each row first emits it
    for row in out.tolist():
        for t in set(row):
            first_steps.setdefault(t, []).append(row.index(t))
    return max(first_steps, key=lambda t: (len(set(first_steps[t])), len(first_steps[t])))


@pytest.mark.parametrize("cache_kind", ["growing (default)", "DynamicCache"])
def test_greedy_answers_equal_generate_while_the_batch_shrinks(model, cache_kind):
    ids, mask = left_padded(PROMPTS)
    eos = common_eos(model, ids, mask)
    reference = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                               eos_token_id=eos, pad_token_id=0)[:, ids.shape[1]:].tolist()
    batch_sizes = []
    hook = model.model.register_forward_pre_hook(
        lambda m, args, kwargs: batch_sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        cache = DynamicCache(config=model.config) if cache_kind == "DynamicCache" else None
        rows = decode_shrinking(model, ids, mask, max_new_tokens=24, eos_token_ids=[eos], compact_every=2,
                                cache=cache)
    finally:
        hook.remove()
    for row, expected in zip(rows, reference):
        end = expected.index(eos) if eos in expected else None
        assert row.tokens == (expected[:end] if end is not None else expected)
        assert row.finished == (end is not None) and row.stop_token == (eos if end is not None else None)
    assert any(r.finished for r in rows) and not all(len(r.tokens) == len(rows[0].tokens) for r in rows)
    assert batch_sizes[0] == len(PROMPTS) and min(batch_sizes) < len(PROMPTS)  # finished rows left the batch
    assert batch_sizes == sorted(batch_sizes, reverse=True)


def test_rows_that_never_finish_run_to_the_cap(model):
    ids, mask = left_padded(PROMPTS[:2])
    rows = decode_shrinking(model, ids, mask, max_new_tokens=5, eos_token_ids=[])
    assert [len(r.tokens) for r in rows] == [5, 5] and not any(r.finished for r in rows)


def test_sampled_tokens_come_from_the_nucleus_and_repeat_with_the_seed(model):
    ids, mask = left_padded(PROMPTS)
    draws = []
    for _ in range(2):
        torch.manual_seed(7)
        draws.append([r.tokens for r in decode_shrinking(model, ids, mask, max_new_tokens=6,
                                                         next_tokens=nucleus_sampler(0.7, top_p=0.8))])
    assert draws[0] == draws[1]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    first = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
    kept_ids, kept = nucleus(first, 0.7, 0.8)
    for row, tokens in enumerate(draws[0]):
        allowed = set(kept_ids[row][kept[row] > 0].tolist())
        assert tokens[0] in allowed


def test_bad_arguments_are_refused(model):
    ids, mask = left_padded(PROMPTS[:1])
    with pytest.raises(ValueError, match="max_new_tokens"):
        decode_shrinking(model, ids, mask, max_new_tokens=0)
    with pytest.raises(ValueError, match="compact_every"):
        decode_shrinking(model, ids, mask, max_new_tokens=2, compact_every=0)
    with pytest.raises(ValueError, match="temperature"):
        nucleus_sampler(0.0)
    assert greedy_tokens(torch.tensor([[0.0, 2.0, 1.0]])).tolist() == [1]
