"""Held-out τ: rounds and greedy answers of a drafter on a prompt file (tiny target, lossless at T = 0)."""

from __future__ import annotations

import json

import pytest
import torch
from eval_fixtures import make_setup

from hf_dspark import DSparkDraftModel
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


def greedy_answer_cache(target, tokenizer, dspark, tmp_path):
    """A target cache of the tiny target's greedy answers to two held-out prompts."""
    from hf_dspark.training.target_cache import TargetCacheDataset, build_target_cache

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": f"h{i}", "turns": [t]}) + "\n"
                            for i, t in enumerate(["what red tree ?", "what blue sky ?"])))
    run = run_heldout(target, tokenizer, dspark, read_heldout(path), max_new_tokens=24, batch_size=2)
    build_target_cache(target, tokenizer, run.answers, tmp_path / "cache", layer_ids=dspark.config.target_layer_ids,
                       min_loss_tokens=1, progress=False)
    dataset = TargetCacheDataset(tmp_path / "cache")
    return dataset


def test_greedy_block_acceptance_on_a_cache_of_greedy_answers(tmp_path):
    import math

    from hf_dspark.training.validation import greedy_block_acceptance

    target, tokenizer, dspark, dflash = make_setup()
    dataset = greedy_answer_cache(target, tokenizer, dspark, tmp_path)
    for drafter in (dspark, dflash):
        result = greedy_block_acceptance(drafter, dataset, num_anchors=16)
        cond = result["conditional_acceptance"]
        assert result["blocks"] > 0 and len(cond) == drafter.config.block_size
        assert all(0.0 <= c <= 1.0 for c in cond)
        # τ = 1 + Σ_k Π_{i≤k} q_i: the conditional rates chain into the pooled τ
        assert result["tau_greedy"] == pytest.approx(1 + sum(math.prod(cond[:k + 1]) for k in range(len(cond))))


def test_miss_breakdown_accounts_for_every_reached_slot(tmp_path):
    from hf_dspark.evaluation.miss_breakdown import (MISS_CAUSES, breakdown_table, confidence_table,
                                                     greedy_miss_breakdown)
    from hf_dspark.training.validation import greedy_block_acceptance

    target, tokenizer, dspark, dflash = make_setup()
    dataset = greedy_answer_cache(target, tokenizer, dspark, tmp_path)
    # half the vocabulary: the target's tokens outside it are misses of their own cause
    narrow = DSparkDraftModel.from_target(target, num_layers=1, block_size=5, markov_rank=16,
                                          draft_vocab=torch.arange(0, target.config.vocab_size, 2)).eval()
    results = {}
    for name, drafter in (("dspark", dspark), ("dflash", dflash), ("narrow", narrow)):
        r = results[name] = greedy_miss_breakdown(drafter, dataset, target.lm_head, num_anchors=16)
        assert r["tau_greedy"] == pytest.approx(greedy_block_acceptance(drafter, dataset, num_anchors=16)["tau_greedy"])
        assert r["reached"][0] == r["blocks"] > 0
        for k in range(drafter.config.block_size):
            assert r["accepted"][k] + sum(r["misses"][c][k] for c in MISS_CAUSES) == r["reached"][k]
        bins = r["slot1_by_target_confidence"].values()
        assert sum(b["reached"] for b in bins) == r["blocks"]
        assert sum(b["accepted"] for b in bins) == r["accepted"][0]
        for b in bins:
            assert b["accepted"] + sum(b["misses"].values()) == b["reached"]
        assert [sum(b["misses"][c] for b in bins) for c in MISS_CAUSES] == [r["misses"][c][0] for c in MISS_CAUSES]
    assert sum(results["dspark"]["misses"]["outside_vocabulary"]) == 0
    assert sum(results["narrow"]["misses"]["outside_vocabulary"]) > 0
    assert "| narrow |" in breakdown_table(results) and "target p 0.95-1.00" in confidence_table(results)


def test_draft_candidates_over_the_whole_vocabulary_rank_what_training_scores():
    from hf_dspark.training.losses import compute_block_logits
    from hf_dspark.training.validation import draft_candidates

    target, _, dspark, _ = make_setup()
    torch.manual_seed(0)
    hidden = torch.randn(6, dspark.config.block_size, dspark.config.hidden_size)
    prev = torch.randint(0, target.config.vocab_size, (6, dspark.config.block_size))
    with torch.no_grad():
        full, _ = compute_block_logits(dspark, hidden, prev, with_confidence=False)
        dspark.config.sequential_top_k = 0
        cand, vals = draft_candidates(dspark, hidden, prev, top_k=8)
        assert torch.equal(cand[..., 0], full.argmax(-1)) and torch.allclose(vals, full.topk(8).values)
        dspark.config.sequential_top_k = 4  # the bias on the base top-4 only: those four are the candidates
        cand, _ = draft_candidates(dspark, hidden, prev)
        assert cand.shape[-1] == 4
        assert torch.equal(cand.sort(-1).values,
                           dspark.compute_draft_logits(hidden).float().topk(4).indices.sort(-1).values)


def test_feature_ablations_alter_only_the_features(tmp_path):
    from hf_dspark.evaluation.miss_breakdown import (FEATURE_ABLATIONS, FeaturesAblated, ablation_table,
                                                     feature_ablations)
    from hf_dspark.training.validation import greedy_block_acceptance

    target, tokenizer, dspark, _ = make_setup()
    dataset = greedy_answer_cache(target, tokenizer, dspark, tmp_path)
    for ablation in FEATURE_ABLATIONS:
        altered = FeaturesAblated(dataset, ablation)
        for i in range(len(dataset)):
            before, after = dataset[i], altered[i]
            assert set(before) == set(after)
            for key in before:
                assert after[key].shape == before[key].shape and after[key].dtype == before[key].dtype
                if key != "target_hidden_states":
                    assert torch.equal(after[key], before[key])
            same = torch.equal(after["target_hidden_states"], before["target_hidden_states"])
            assert same == (ablation == "as given")
        again = FeaturesAblated(dataset, ablation)[0]["target_hidden_states"]
        assert torch.equal(altered[0]["target_hidden_states"], again)  # deterministic: every drafter sees the same
    assert not FeaturesAblated(dataset, "zeroed")[0]["target_hidden_states"].any()
    # the other conversation's features, repeated or cut to this one's length
    other = FeaturesAblated(dataset, "another conversation's")[0]["target_hidden_states"]
    source = dataset[1]["target_hidden_states"]
    n = min(len(other), len(source))
    assert torch.equal(other[:n], source[:n])
    with pytest.raises(ValueError, match="choose from"):
        FeaturesAblated(dataset, "shuffled")

    results = feature_ablations(dspark, dataset, num_anchors=16)
    assert results["as given"] == greedy_block_acceptance(dspark, dataset, num_anchors=16)
    assert set(results) == set(FEATURE_ABLATIONS)
    table = ablation_table({"dspark, chat": results})
    assert table.count("\n") == 2 and "features zeroed" in table


def test_run_heldout_refuses_no_prompts():
    with pytest.raises(ValueError, match="at least one prompt"):
        run_heldout(None, None, None, [])
