"""Resuming never executes code from the run folder: the trainer state is unpickled with weights_only=True."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from chat_data import make_chat_records, make_chat_tokenizer, single_thread  # noqa: F401
from conftest import make_tiny_llama

from hf_dspark import DSparkDraftModel
from hf_dspark.training.losses import LossConfig
from hf_dspark.training.target_cache import TargetCacheDataset, build_target_cache
from hf_dspark.training.trainer import STATE_NAME, DSparkTrainer, DSparkTrainingConfig, load_trainer_state

pytestmark = pytest.mark.usefixtures("single_thread")


class _Payload:
    """What a tampered trainer_state.pt could hold: unpickling it would run ``os.system``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _trainer(target, cache, out, max_steps: int) -> DSparkTrainer:
    torch.manual_seed(0)
    drafter = DSparkDraftModel.from_target(target, num_layers=1, block_size=4, markov_rank=8, target_layer_ids=[1, 2])
    config = DSparkTrainingConfig(output_dir=str(out), max_steps=max_steps, per_device_batch_size=2,
                                  gradient_accumulation_steps=1, num_anchors=4, save_steps=1, progress=False,
                                  mixed_precision="no", loss=LossConfig(chunk_blocks=4))
    return DSparkTrainer(drafter, cache, config)


def test_resume_loads_a_real_state_and_refuses_a_pickled_payload(tmp_path):
    target = make_tiny_llama(num_layers=4)
    build_target_cache(target, make_chat_tokenizer(), make_chat_records(6), tmp_path / "cache", layer_ids=[1, 2],
                       max_length=96, batch_size=6, progress=False)
    cache = TargetCacheDataset(tmp_path / "cache")
    first = _trainer(target, cache, tmp_path / "run", max_steps=2)
    first.train(stop_at_step=1)
    checkpoint = first.latest_checkpoint()
    state = load_trainer_state(checkpoint / STATE_NAME)  # what DSparkTrainer writes loads with weights_only
    assert state["step"] == 1 and state["optimizer"]["state"]
    resumed = _trainer(target, cache, tmp_path / "run", max_steps=2)
    resumed.load_checkpoint(checkpoint)
    assert resumed.step == 1

    marker = tmp_path / "executed"
    with (checkpoint / STATE_NAME).open("wb") as f:
        pickle.dump({**state, "step": _Payload(marker)}, f, protocol=2)
    with pytest.raises(ValueError, match=r"Refusing to resume from .*trainer_state\.pt: it holds objects other "
                                         r"than tensors"):
        _trainer(target, cache, tmp_path / "run", max_steps=2).train(resume=True)
    assert not marker.exists()
