import json
import math
import os
import re
import shutil

import pytest
import torch
from chat_data import make_chat_records, make_chat_tokenizer, single_thread  # noqa: F401
from conftest import make_tiny_llama
from safetensors.torch import load_file

from hf_dspark import DSparkDraftModel
from hf_dspark.training.losses import LossConfig
from hf_dspark.training.target_cache import TargetCacheDataset, build_target_cache, load_manifest, validate_manifest
from hf_dspark.training.trainer import (
    FINAL_DIR,
    METRICS_NAME,
    STATE_NAME,
    DSparkTrainer,
    DSparkTrainingConfig,
    RunDirectoryError,
    SampleStream,
    lr_factor,
)

pytestmark = pytest.mark.usefixtures("single_thread")
LAYERS = [1, 2]


@pytest.fixture(scope="module")
def target():
    return make_tiny_llama(num_layers=4)


@pytest.fixture(scope="module")
def cache(tmp_path_factory, target):
    path = tmp_path_factory.mktemp("cache")
    build_target_cache(target, make_chat_tokenizer(), make_chat_records(24), path, layer_ids=LAYERS, max_length=96,
                       batch_size=8, dtype="float32", progress=False)
    return TargetCacheDataset(path)


def _trainer(target, cache, out, head="markov", **overrides) -> DSparkTrainer:
    torch.manual_seed(0)
    drafter = DSparkDraftModel.from_target(target, num_layers=1, block_size=4, head=head, markov_rank=16,
                                           target_layer_ids=LAYERS)
    validate_manifest(load_manifest(cache.cache_dir), drafter.config)
    settings = {"output_dir": str(out), "max_steps": 20, "per_device_batch_size": 2,
                "gradient_accumulation_steps": 2, "learning_rate": 3e-3, "num_anchors": 8, "save_steps": 5,
                "progress": False, "mixed_precision": "no", "loss": LossConfig.for_head(head)}
    settings.update(overrides)
    return DSparkTrainer(drafter, cache, DSparkTrainingConfig(**settings))


def _losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / METRICS_NAME).read_text().splitlines()]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, target, cache):
    out = tmp_path_factory.mktemp("full")
    trainer = _trainer(target, cache, out)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    trainer.train()
    return out, trainer, before


def test_training_reduces_the_loss_and_writes_everything(full_run, target):
    out, _, target_before = full_run
    losses = _losses(out)
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    last = json.loads((out / METRICS_NAME).read_text().splitlines()[-1])
    for key in ("ce", "l1", "confidence_bce", "accept_rate@0", "accept_rate@3", "tau_probabilistic",
                "confidence_abs_error", "confidence_bias", "lr", "grad_norm", "tokens_per_s"):
        assert key in last
    assert 1.0 <= last["tau_probabilistic"] <= 5.0
    assert (out / FINAL_DIR / "config.json").is_file()
    assert len(list(out.glob("checkpoint-*"))) == 2  # save_total_limit
    # the target never changes (it is not trained and not touched by the optimizer)
    assert all(torch.equal(v, target_before[k]) for k, v in target.state_dict().items())
    # the final drafter reloads and holds none of the target's tensors
    reloaded = DSparkDraftModel.from_pretrained(out / FINAL_DIR, target=target)
    assert not any(k.startswith(("embed", "lm_head", "model.")) for k in reloaded.state_dict())


def test_resume_is_exact(full_run, tmp_path, target, cache):
    out_full, full_trainer, _ = full_run
    first = _trainer(target, cache, tmp_path)
    first.train(stop_at_step=10)
    assert len(_losses(tmp_path)) == 10
    second = _trainer(target, cache, tmp_path)  # a fresh process would start exactly like this
    second.train(resume=True)
    assert _losses(tmp_path) == _losses(out_full)  # bit-identical loss sequence
    for a, b in zip(second.drafter.state_dict().values(), full_trainer.drafter.state_dict().values()):
        assert torch.equal(a, b)


def test_resume_after_a_crash_past_the_checkpoint_trims_the_log(tmp_path, target, cache):
    first = _trainer(target, cache, tmp_path, max_steps=8, save_steps=4)
    first.train(stop_at_step=6)  # checkpoints at 4 and 6: pretend step 6's checkpoint was lost
    (tmp_path / "latest").write_text("checkpoint-0000004")
    second = _trainer(target, cache, tmp_path, max_steps=8, save_steps=4)
    second.train(resume=True)
    assert [json.loads(x)["step"] for x in (tmp_path / METRICS_NAME).read_text().splitlines()] == list(range(1, 9))


def test_dflash_trains_with_ce_only(tmp_path, target, cache):
    trainer = _trainer(target, cache, tmp_path, head="none", max_steps=3)
    trainer.train()
    last = json.loads((tmp_path / METRICS_NAME).read_text().splitlines()[-1])
    assert last["loss"] == pytest.approx(last["ce"], rel=1e-5)
    assert trainer.drafter.markov_head is None and trainer.drafter.confidence_head is None


def test_upstream_dflash_convention_trains_and_saves_it(tmp_path, target, cache):
    """num_unpredicted_slots=1 (z-lab / transformers DFlash): training runs the same [anchor, MASK × γ] block that
    drafting runs, and the saved drafter records the convention."""
    trainer = _trainer(target, cache, tmp_path, head="none", max_steps=3)
    trainer.drafter.config.num_unpredicted_slots = 1
    trainer.train()
    losses = _losses(tmp_path)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    saved = json.loads((tmp_path / FINAL_DIR / "config.json").read_text())
    assert saved["num_unpredicted_slots"] == 1 and saved["block_size"] == 4


def test_time_budget_stops_with_a_checkpoint_and_the_same_command_finishes(tmp_path, target, cache):
    trainer = _trainer(target, cache, tmp_path, max_steps=3, max_minutes=0.0)
    trainer.train(resume=True)  # nothing to resume yet: starts from scratch
    assert trainer.step == 1 and (tmp_path / "checkpoint-0000001").is_dir()
    assert not (tmp_path / FINAL_DIR).exists()  # not finished: only the checkpoint
    again = _trainer(target, cache, tmp_path, max_steps=3)
    again.train(resume=True)
    assert again.step == 3 and (tmp_path / FINAL_DIR / "config.json").is_file()


def test_existing_checkpoints_need_resume_and_same_settings(tmp_path, target, cache):
    _trainer(target, cache, tmp_path, max_steps=2).train()
    with pytest.raises(ValueError, match="--resume"):
        _trainer(target, cache, tmp_path, max_steps=2).train()
    with pytest.raises(ValueError, match="per_device_batch_size: 2 -> 1"):
        _trainer(target, cache, tmp_path, max_steps=2, per_device_batch_size=1).train(resume=True)


@pytest.mark.parametrize("damage", ["truncated state", "truncated weights", "missing state", "missing folder"])
def test_resuming_from_a_damaged_checkpoint_names_it_and_the_way_out(damage, tmp_path, target, cache):
    """A truncated trainer_state.pt raised torch's RuntimeError (a traceback), a truncated model.safetensors a
    SafetensorError, a missing one an errno line that named no way out."""
    _trainer(target, cache, tmp_path, max_steps=1).save_checkpoint()  # step 0's: no training needed
    checkpoint = tmp_path / "checkpoint-0000000"
    name = "model.safetensors" if damage == "truncated weights" else STATE_NAME
    if damage.startswith("truncated"):
        (checkpoint / name).write_bytes((checkpoint / name).read_bytes()[:200])
    elif damage == "missing state":
        (checkpoint / STATE_NAME).unlink()
    else:
        shutil.rmtree(checkpoint)
    with pytest.raises(RunDirectoryError, match=re.escape(f"Cannot resume from {checkpoint}: it is missing or "
                                                          "damaged (")) as err:
        _trainer(target, cache, tmp_path, max_steps=1).train(resume=True)
    assert f"earlier checkpoint-* folder in {tmp_path / 'latest'}" in str(err.value)


def test_lr_schedule_warmup_then_cosine_to_zero():
    assert lr_factor(0, 4, 100) == pytest.approx(0.25)
    assert lr_factor(3, 4, 100) == pytest.approx(1.0)
    assert lr_factor(4, 4, 100) == pytest.approx(1.0)
    assert lr_factor(52, 4, 100) == pytest.approx(0.5)
    assert lr_factor(100, 4, 100) == pytest.approx(0.0)
    assert lr_factor(0, 0, 10) == pytest.approx(1.0)
    assert DSparkTrainingConfig(output_dir="x", max_steps=1000).num_warmup_steps == 40


def test_sample_stream_is_a_resumable_sequence_of_permutations():
    stream = SampleStream(5, seed=3)
    first = stream.take(7)  # one whole epoch, then 2 of the next
    assert sorted(first[:5]) == list(range(5)) and stream.state_dict() == {"epoch": 1, "offset": 2}
    rest = stream.take(6)
    again = SampleStream(5, seed=3, epoch=1, offset=2)
    assert again.take(6) == rest
    assert SampleStream(5, seed=4).take(5) != first[:5] or SampleStream(5, seed=5).take(5) != first[:5]


_DDP_RUNNER = """
import sys
import torch
sys.path[:0] = [{tests!r}, {training_tests!r}]
from conftest import make_tiny_llama
from hf_dspark import DSparkDraftModel
from hf_dspark.training.losses import LossConfig
from hf_dspark.training.target_cache import TargetCacheDataset
from hf_dspark.training.trainer import DSparkTrainer, DSparkTrainingConfig
torch.set_num_threads(1)
torch.manual_seed(0)
drafter = DSparkDraftModel.from_target(make_tiny_llama(num_layers=4), num_layers=1, block_size=4, markov_rank=16,
                                       target_layer_ids={layers!r})
config = DSparkTrainingConfig(output_dir=sys.argv[2], max_steps=4, per_device_batch_size=1,
                              gradient_accumulation_steps=int(sys.argv[3]), learning_rate=3e-3, num_anchors=8,
                              progress=False, mixed_precision="no", loss=LossConfig(chunk_blocks=4))
DSparkTrainer(drafter, TargetCacheDataset(sys.argv[1]), config).train()
"""


@pytest.mark.slow
def test_two_processes_match_one_process_with_twice_the_accumulation(tmp_path, cache):
    # the same global batch split as 2 ranks × 2 micro-batches or 1 rank × 4 gives the same update
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    runner = tmp_path / "runner.py"
    runner.write_text(_DDP_RUNNER.format(tests=str(here.parent), training_tests=str(here), layers=LAYERS))
    torchrun = Path(sys.executable).with_name("torchrun")
    for name, cmd in (("ddp", [str(torchrun), "--nproc_per_node", "2", str(runner)]),
                      ("single", [sys.executable, str(runner)])):
        accum = "2" if name == "ddp" else "4"
        subprocess.run([*cmd, str(cache.cache_dir), str(tmp_path / name), accum], check=True, timeout=300,
                       capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    ddp, single = _losses(tmp_path / "ddp"), _losses(tmp_path / "single")
    assert len(ddp) == len(single) == 4
    assert ddp == pytest.approx(single, rel=1e-5)
    a = load_file(tmp_path / "ddp" / FINAL_DIR / "model.safetensors")
    b = load_file(tmp_path / "single" / FINAL_DIR / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
