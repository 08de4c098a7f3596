"""training.recipe: the settings refuse what cannot run, the cache step honours limit / layers / logsumexp, and
the drafter assembled for a cache taps its layers (the full train path runs in test_train_script.py)."""

from __future__ import annotations

import pytest
from chat_data import make_chat_records, make_chat_tokenizer, single_thread  # noqa: F401
from conftest import make_tiny_llama

from hf_dspark.training.recipe import (CacheRecipe, DrafterRecipe, TrainingRecipe, build_drafter, cache_conversations,
                                       drafter_head)
from hf_dspark.training.target_cache import TargetCacheDataset, load_manifest

pytestmark = pytest.mark.usefixtures("single_thread")


def test_settings_that_cannot_run_are_refused():
    with pytest.raises(ValueError, match="exactly one of steps or epochs"):
        TrainingRecipe()
    with pytest.raises(ValueError, match="exactly one of steps or epochs"):
        TrainingRecipe(steps=3, epochs=1.0)
    with pytest.raises(ValueError, match="give init_from"):
        DrafterRecipe(grow_to_layers=2)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    import json

    root = tmp_path_factory.mktemp("recipe")
    target, tokenizer = make_tiny_llama(), make_chat_tokenizer()
    target.generation_config.eos_token_id = tokenizer.eos_token_id
    records = make_chat_records(10)
    halves = [root / "a.jsonl", root / "b.jsonl"]
    for path, part in zip(halves, (records[:5], records[5:])):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    manifest = cache_conversations(target, tokenizer, halves, root / "cache",
                                   CacheRecipe(layers=[1, 2], max_length=64, batch_size=4, limit=7, logsumexp=True))
    return target, root / "cache", manifest


def test_cache_reads_every_file_up_to_the_limit(cache):
    _, path, manifest = cache
    assert manifest["num_samples"] == 7 and manifest["target_layer_ids"] == [1, 2]  # 5 of a.jsonl + 2 of b.jsonl
    assert load_manifest(path) == manifest and TargetCacheDataset(path).has_logsumexp


def test_drafters_built_for_the_cache(cache):
    target, path, manifest = cache
    drafter, head = build_drafter(target, path, manifest, DrafterRecipe(head="gated", block_size=4, markov_rank=8,
                                                                       draft_vocab_size=30))
    assert head == drafter_head(drafter) == "gated" and drafter.config.target_layer_ids == [1, 2]
    assert drafter.config.draft_vocab_size == 30 and make_chat_tokenizer().eos_token_id in drafter.draft_to_target
    eagle3, head = build_drafter(target, path, manifest, DrafterRecipe(head="eagle3", block_size=4))
    assert head == drafter_head(eagle3) == "eagle3"
    again, _ = build_drafter(target, path, manifest, DrafterRecipe(head="gated", block_size=4, markov_rank=8,
                                                                   draft_vocab_size=30))
    for name, tensor in drafter.state_dict().items():  # seeded: the same initialisation every run
        assert (again.state_dict()[name] == tensor).all(), name


def test_a_continued_drafter_for_a_bf16_target_keeps_float32_rope(cache, tmp_path):
    """``init_from`` cast the loaded drafter to the target's dtype by hand after binding: in bf16 that rounded RoPE's
    inverse frequencies too (binding keeps them float32), so a bf16 run trained a drafter that attends to its
    context unlike the same weights served."""
    import torch

    from hf_dspark.modeling import DSparkDraftModel

    target, path, manifest = cache
    start = DSparkDraftModel.from_target(target, num_layers=1, block_size=4, markov_rank=8)
    start.save_pretrained(tmp_path / "start")
    reference = {n: b.clone() for n, b in start.named_buffers() if n.startswith("rotary_emb.")}
    bf16_target = make_tiny_llama().to(torch.bfloat16)
    drafter, _ = build_drafter(bf16_target, path, manifest, DrafterRecipe(init_from=tmp_path / "start"))
    assert drafter.dtype == torch.bfloat16 and reference
    for name, buffer in drafter.named_buffers():
        if name in reference:
            assert buffer.dtype == torch.float32 and torch.equal(buffer, reference[name]), name
