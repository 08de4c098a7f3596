"""Greedy identity on the real embedded target (SmolLM2-135M-Instruct), batch 1 and a left-padded batch."""

from __future__ import annotations

import pytest
import torch

from hf_dspark import DSparkDraftModel

PROMPTS = ["What is 12 times 7? Answer briefly.",
           "Write a Python function that reverses a string.",
           "Give me two tips for sleeping better."]


@pytest.mark.slow
def test_untrained_drafter_greedy_identical_on_smollm2(smollm2):
    target, tok = smollm2
    torch.manual_seed(0)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=7, markov_rank=32).eval()
    rows = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                    return_tensors="pt", return_dict=True)["input_ids"][0] for p in PROMPTS]
    expected = [target.generate(r[None], do_sample=False, max_new_tokens=20)[0, len(r):].tolist() for r in rows]
    for r, e in zip(rows, expected):  # batch 1
        assert target.generate(r[None], do_sample=False, max_new_tokens=20, assistant_model=draft)[0, len(r):].tolist() == e
    width = max(len(r) for r in rows)  # a left-padded batch of 3
    ids = torch.full((3, width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, assistant_model=draft)
    for i, e in enumerate(expected):
        assert out[i, width:width + len(e)].tolist() == e


@pytest.mark.slow
def test_shipped_drafter_is_lossless_and_gets_drafts_accepted(smollm2):
    """The packaged default drafter (hf_dspark/checkpoints/...) on its target: greedy-identical, τ clearly above 1."""
    from hf_dspark import load_default_drafter
    from hf_dspark.embedded import DEFAULT_DRAFTER_DIR

    if not (DEFAULT_DRAFTER_DIR / "config.json").is_file():
        pytest.fail(f"The default drafter is missing from {DEFAULT_DRAFTER_DIR}: the package must ship it.")
    target, tok = smollm2
    draft = load_default_drafter(target)
    assert draft.config.confidence_temperatures is not None  # calibrated (STS) before shipping
    committed = rounds = 0
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        plain = target.generate(ids, do_sample=False, max_new_tokens=48)
        if draft.config.confidence_threshold:  # the shipped default as users get it
            assert torch.equal(plain, target.generate(ids, do_sample=False, max_new_tokens=48, assistant_model=draft))
        # the drafter's own acceptance: every round proposes the whole block
        ours = target.generate(ids, do_sample=False, max_new_tokens=48, assistant_model=draft,
                               dspark_confidence_threshold=0.0)
        assert torch.equal(plain, ours)
        committed, rounds = committed + draft.stats.committed_tokens, rounds + draft.stats.rounds
    # an untrained drafter commits ~1.0 token per round; the shipped one measured 1.44 here (BENCHMARKS.md)
    assert committed / rounds > 1.3, (committed, rounds)
