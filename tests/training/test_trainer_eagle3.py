"""The Eagle3 baseline trains with the same trainer, losses and evaluation as the block drafters."""

from __future__ import annotations

import pytest
import torch
from chat_data import make_chat_records, make_chat_tokenizer, single_thread  # noqa: F401
from conftest import make_tiny_llama

from hf_dspark import DSparkDraftModel, Eagle3DraftModel
from hf_dspark.training.losses import LossConfig
from hf_dspark.training.target_cache import TargetCacheDataset, build_target_cache
from hf_dspark.training.trainer import DSparkTrainer, DSparkTrainingConfig, evaluate_on_cache


@pytest.mark.usefixtures("single_thread")
def test_trainer_reduces_the_loss_on_a_cache(tmp_path):

    target = make_tiny_llama(num_layers=4)
    build_target_cache(target, make_chat_tokenizer(), make_chat_records(16), tmp_path / "cache", layer_ids=[1, 2],
                       max_length=96, batch_size=8, dtype="float32", progress=False)
    cache = TargetCacheDataset(tmp_path / "cache")
    torch.manual_seed(0)
    draft = Eagle3DraftModel.from_target(target, block_size=4, target_layer_ids=[1, 2])
    before = evaluate_on_cache(draft, cache, num_anchors=8)
    config = DSparkTrainingConfig(output_dir=str(tmp_path / "run"), max_steps=20, per_device_batch_size=2,
                                  gradient_accumulation_steps=2, learning_rate=3e-3, num_anchors=8, save_steps=10,
                                  progress=False, mixed_precision="no", loss=LossConfig.for_head("none"))
    DSparkTrainer(draft, cache, config).train()
    after = evaluate_on_cache(draft, cache, num_anchors=8)
    assert after["loss"] < 0.8 * before["loss"], (before, after)
    # (τ_probabilistic compares with the *target's* distribution; this random tiny target did not write the chats)
    assert after["ce"] < before["ce"] and 1.0 <= after["tau_probabilistic"] <= 5.0
    reloaded = DSparkDraftModel.from_pretrained(tmp_path / "run" / "drafter", target=target)
    assert type(reloaded) is Eagle3DraftModel
