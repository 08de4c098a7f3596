"""Held-out τ: rounds and greedy answers of a drafter on a prompt file (tiny target, lossless at T = 0)."""

from __future__ import annotations

import json

import pytest
import torch
from eval_fixtures import make_setup

from hf_dspark.evaluation.benchmarks import encode_chat_prompt, left_pad
from hf_dspark.evaluation.heldout import read_heldout, run_heldout


def test_run_heldout_records_full_blocks_and_greedy_answers(tmp_path):
    target, tokenizer, dspark, _ = make_setup()
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"id": f"h{i}", "turns": [t], "category": "chat"}) + "\n"
                            for i, t in enumerate(["what red tree ?", "what blue sky ?", "what green hill ?"])))
    prompts = read_heldout(path)
    assert [p.id for p in prompts] == ["h0", "h1", "h2"]
    threshold = dspark.config.confidence_threshold = 0.6
    run = run_heldout(target, tokenizer, dspark, prompts, max_new_tokens=12, batch_size=2)
    summary = run.summary()
    assert summary["rounds"] == len(run.trace) > 0 and 1.0 <= summary["tau"] <= dspark.config.block_size + 1
    assert len(summary["conditional_acceptance"]) == dspark.config.block_size
    # threshold 0: every round that did not end the answer proposed the whole block
    assert (run.trace.num_proposed == dspark.config.block_size).mean() > 0.5
    assert dspark.config.confidence_threshold == threshold  # restored after the run
    # the answers are the target's plain greedy ones
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids, mask = left_pad([encode_chat_prompt(tokenizer, prompts[0].text)], pad)
    with torch.no_grad():
        plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                pad_token_id=pad)
    expected = tokenizer.decode([t for t in plain[0, ids.shape[1]:].tolist() if t != pad], skip_special_tokens=True)
    answer = run.answers[0]
    assert answer["id"] == "h0" and answer["messages"][0]["content"] == prompts[0].text
    assert answer["messages"][1]["content"] == expected


def test_greedy_block_acceptance_on_a_cache_of_greedy_answers(tmp_path):
    import math

    from hf_dspark.training.validation import greedy_block_acceptance
    from hf_dspark.training.target_cache import TargetCacheDataset, build_target_cache

    target, tokenizer, dspark, dflash = make_setup()
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": f"h{i}", "turns": [t]}) + "\n"
                            for i, t in enumerate(["what red tree ?", "what blue sky ?"])))
    run = run_heldout(target, tokenizer, dspark, read_heldout(path), max_new_tokens=24, batch_size=2)
    build_target_cache(target, tokenizer, run.answers, tmp_path / "cache", layer_ids=dspark.config.target_layer_ids,
                       min_loss_tokens=1, progress=False)
    dataset = TargetCacheDataset(tmp_path / "cache")
    for drafter in (dspark, dflash):
        result = greedy_block_acceptance(drafter, dataset, num_anchors=16)
        cond = result["conditional_acceptance"]
        assert result["blocks"] > 0 and len(cond) == drafter.config.block_size
        assert all(0.0 <= c <= 1.0 for c in cond)
        # τ = 1 + Σ_k Π_{i≤k} q_i: the conditional rates chain into the pooled τ
        assert result["tau_greedy"] == pytest.approx(1 + sum(math.prod(cond[:k + 1]) for k in range(len(cond))))
