"""scripts/train_drafter.py end to end on a tiny saved target: reduced draft vocabulary (with the cache's
log-normaliser side-car written on the way), then a second run that starts from the first drafter's weights."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from chat_data import make_chat_records, make_chat_tokenizer, single_thread  # noqa: F401
from conftest import make_tiny_llama

from hf_dspark import DSparkDraftModel
from hf_dspark.training.target_cache import TargetCacheDataset, build_target_cache

pytestmark = pytest.mark.usefixtures("single_thread")
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_drafter.py"


def load_script():
    spec = importlib.util.spec_from_file_location("train_drafter_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def saved_target_and_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_script")
    target, tokenizer = make_tiny_llama(num_layers=4), make_chat_tokenizer()
    target.generation_config.eos_token_id = tokenizer.eos_token_id
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    build_target_cache(target, tokenizer, make_chat_records(12), root / "cache", layer_ids=[1, 2], max_length=64,
                       batch_size=4, progress=False)
    return root


def test_reduced_vocabulary_run_then_init_from(saved_target_and_cache):
    root = saved_target_and_cache
    script = load_script()
    common = ["--cache", str(root / "cache"), "--target", str(root / "target"), "--num-layers", "1",
              "--block-size", "4", "--markov-rank", "8", "--num-anchors", "4", "--batch-size", "2",
              "--grad-accum", "1", "--steps", "6", "--save-steps", "100", "--no-progress", "--threads", "1"]
    script.main([*common, "--out", str(root / "first"), "--draft-vocab-size", "40"])
    assert TargetCacheDataset(root / "cache").has_logsumexp  # side-car written for the reduced loss
    target = make_tiny_llama(num_layers=4)
    first = DSparkDraftModel.from_pretrained(root / "first" / "drafter", target=target)
    assert first.config.draft_vocab_size == 40
    from hf_dspark.training.trainer import evaluate_on_cache

    held_out = TargetCacheDataset(root / "cache")
    first_metrics = evaluate_on_cache(first, held_out, num_anchors=4)
    assert first_metrics == evaluate_on_cache(first, held_out, num_anchors=4)  # fixed anchors: deterministic
    assert first_metrics["tau_probabilistic"] >= 1 and first_metrics["num_supervised_slots"] > 0
    eos = make_chat_tokenizer().eos_token_id
    assert eos in first.draft_to_target.tolist()  # the end-of-turn token is always proposable
    script.main([*common, "--out", str(root / "second"), "--init-from", str(root / "first" / "drafter"),
                 "--lr", "0"])
    second = DSparkDraftModel.from_pretrained(root / "second" / "drafter", target=target)
    assert torch.equal(second.draft_to_target, first.draft_to_target)
    for name, tensor in first.state_dict().items():  # lr 0: the weights it started from, unchanged
        assert torch.equal(second.state_dict()[name], tensor), name
    metrics = [json.loads(line) for line in (root / "second" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 6 and all(m["lr"] == 0 for m in metrics)


def test_eagle3_baseline_trains_through_the_script(saved_target_and_cache):
    root = saved_target_and_cache
    load_script().main(["--cache", str(root / "cache"), "--target", str(root / "target"), "--head", "eagle3",
                        "--block-size", "4", "--num-anchors", "4", "--batch-size", "2", "--grad-accum", "1",
                        "--steps", "4", "--save-steps", "100", "--no-progress", "--threads", "1",
                        "--out", str(root / "eagle3")])
    from hf_dspark import Eagle3DraftModel

    drafter = DSparkDraftModel.from_pretrained(root / "eagle3" / "drafter", target=make_tiny_llama(num_layers=4))
    assert type(drafter) is Eagle3DraftModel and drafter.config.target_layer_ids == [1, 2]
    metrics = [json.loads(line) for line in (root / "eagle3" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 4 and metrics[-1]["l1"] >= 0 and metrics[-1]["confidence_bce"] == 0
