"""Distributed launches are never silent: the log states processes and global batch, warns when accelerate's simple
launcher started one process for a multi-process launch, and the documented CPU command really runs two."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from chat_data import make_chat_records, make_chat_tokenizer, single_thread  # noqa: F401
from conftest import make_tiny_llama

from hf_dspark import DSparkDraftModel
from hf_dspark.training.losses import LossConfig
from hf_dspark.training.target_cache import TargetCacheDataset, build_target_cache
from hf_dspark.training.trainer import DSparkTrainer, DSparkTrainingConfig, launched_for_several_processes

pytestmark = pytest.mark.usefixtures("single_thread")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch")
    target, tokenizer = make_tiny_llama(num_layers=4), make_chat_tokenizer()
    target.generation_config.eos_token_id = tokenizer.eos_token_id
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    build_target_cache(target, tokenizer, make_chat_records(8), root / "cache", layer_ids=[1, 2], max_length=64,
                       batch_size=4, progress=False)
    return root, target


def test_launch_is_logged_and_a_lost_process_count_warns(saved, tmp_path, monkeypatch, caplog):
    root, target = saved
    assert not launched_for_several_processes({"ACCELERATE_USE_CPU": "False"})  # accelerate launch, one process
    assert not launched_for_several_processes({"ACCELERATE_USE_CPU": "False", "MASTER_ADDR": "127.0.0.1",
                                               "WORLD_SIZE": "2"})  # torchrun / --multi_gpu
    # what `accelerate launch --num_processes 2` exports on a host without GPUs, then starting ONE process
    monkeypatch.setenv("ACCELERATE_USE_CPU", "False")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    torch.manual_seed(0)
    drafter = DSparkDraftModel.from_target(target, num_layers=1, block_size=4, markov_rank=8, target_layer_ids=[1, 2])
    config = DSparkTrainingConfig(output_dir=str(tmp_path), max_steps=1, per_device_batch_size=2,
                                  gradient_accumulation_steps=3, num_anchors=4, progress=False, mixed_precision="no",
                                  loss=LossConfig(chunk_blocks=4))
    with caplog.at_level("INFO", logger="hf_dspark.training.trainer"):
        DSparkTrainer(drafter, TargetCacheDataset(root / "cache"), config).train()
    assert ("Training with 1 process(es) (NO on cpu): global batch 6 sequences per optimizer step = 2 per device x 3 "
            "accumulation x 1 process(es)") in caplog.text
    warning = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warning) == 1 and "--multi_gpu --num_processes N" in warning[0].getMessage()
    assert "torchrun --nproc_per_node N" in warning[0].getMessage()


@pytest.mark.slow
def test_documented_cpu_command_runs_two_processes(saved, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2 scripts/train_drafter.py ...` on this CPU host (~40 s)."""
    root, _ = saved
    accelerate = Path(sys.executable).with_name("accelerate")
    out = tmp_path / "run"
    cmd = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", str(ROOT / "scripts" / "train_drafter.py"),
           "--cache", str(root / "cache"), "--target", str(root / "target"), "--out", str(out), "--num-layers", "1",
           "--block-size", "4", "--markov-rank", "8", "--num-anchors", "4", "--batch-size", "1", "--grad-accum", "2",
           "--steps", "2", "--save-steps", "100", "--no-progress", "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]).rstrip(os.pathsep)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("Training with 2 process(es) (MULTI_CPU on cpu:0): global batch 4 sequences per optimizer step = 1 per "
            "device x 2 accumulation x 2 process(es)") in done.stderr
    assert "ONE process" not in done.stderr
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert (out / "drafter" / "model.safetensors").is_file()
