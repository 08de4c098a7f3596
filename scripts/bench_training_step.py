"""Where a training sample's time goes in the continuous run, and what bf16 buys on this CPU.

Per sample of the on-policy data, one thread: the target's prefill (features; in bf16 where the CPU has bf16 units,
as the run prefills), the fp32 LM head's log-normaliser, reading both back from a feature memo (what later epochs
pay instead), and one optimizer step of the committed drafter at batch 4 in fp32 and, on a CPU with bf16 units, in
bf16 autocast (``--mixed-precision`` of scripts/train_continuous.py). ``--loss-from REV`` adds an fp32 arm whose loss is
hf_dspark/training/losses.py as of git revision REV: what a change to the loss did to the step's time, on the same
batches. The arms alternate within each repeat, so load drifts hit all alike. Pause background jobs first
(kill -STOP), then

    .venv/bin/python scripts/bench_training_step.py --repeats 3 --steps 8
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from train_continuous import ON_POLICY

from hf_dspark import DSparkDraftModel
from hf_dspark.cpu_kernels import cpu_has_bf16_units
from hf_dspark.loading import load_target
from hf_dspark.training import trainer as trainer_module
from hf_dspark.training.continuous import prefilling_target
from hf_dspark.training.feature_memo import FeatureMemo
from hf_dspark.training.losses import LossConfig
from hf_dspark.training.prefill_features import TargetPrefillDataset, chat_record_files, read_chat_records
from hf_dspark.training.trainer import DSparkTrainer, DSparkTrainingConfig, make_accelerator


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default="drafter_training/smollm2/drafter")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per arm and repeat")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--num-anchors", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--loss-from", metavar="REV", default=None,
                   help="add an fp32 arm with hf_dspark/training/losses.py as of this git revision")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    return p.parse_args(argv)


def loss_at_revision(rev: str):
    """hf_dspark.training.losses as of git revision ``rev``, imported beside today's (its relative imports resolve
    to today's package: only the loss differs between the arms)."""
    source = subprocess.run(["git", "show", f"{rev}:hf_dspark/training/losses.py"], check=True,
                            capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as workdir:
        path = Path(workdir) / "losses_at_revision.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("hf_dspark.training.losses_at_revision", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
    return module


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target()
    drafter = DSparkDraftModel.from_pretrained(args.drafter, target=target).float()
    records = read_chat_records(chat_record_files(ON_POLICY))
    n = args.batch_size * args.steps
    records = records[:: max(1, len(records) // n)][:n]
    prefiller = prefilling_target(target)
    data = TargetPrefillDataset(target, tokenizer, records, drafter.config.target_layer_ids, feature_target=prefiller,
                                logsumexp=True, progress=False)
    # the prefill and the log-normaliser, timed apart on the same samples; computed once, so an arm's step time is
    # the drafter's alone
    head_only = data.logsumexp
    data.logsumexp = False
    t0 = time.perf_counter()
    items = [data[i] for i in range(len(data))]
    prefill = (time.perf_counter() - t0) / len(items)
    data.logsumexp = head_only
    t0 = time.perf_counter()
    for item in items:
        item["target_logsumexp"] = data._answer_logsumexp(item["target_last_hidden_states"], item["loss_mask"])
    logsumexp = (time.perf_counter() - t0) / len(items)
    # what a later epoch pays instead of both: reading the sample back from the feature memo (page cache warm)
    with tempfile.TemporaryDirectory() as memo_dir:
        memo = FeatureMemo(memo_dir, {"bench_training_step": 1})
        for sample, item in zip(data.samples, items):
            memo.store(sample.input_ids, sample.loss_mask, item)
        t0 = time.perf_counter()
        for sample in data.samples:
            memo.load(sample.input_ids, sample.loss_mask)
        memo_read = (time.perf_counter() - t0) / len(items)
    arms = {"no": trainer_module.compute_loss}
    if cpu_has_bf16_units():  # elsewhere oneDNN emulates bf16: an arm nobody would run (step_precision("auto"))
        arms["bf16"] = trainer_module.compute_loss
    if args.loss_from:
        arms[f"no@{args.loss_from}"] = loss_at_revision(args.loss_from).compute_loss
    step = {arm: [] for arm in arms}
    losses = {arm: [] for arm in arms}
    for _ in range(args.repeats):
        for arm, compute_loss in arms.items():
            precision = arm.partition("@")[0]
            trainer_module.compute_loss = compute_loss
            config = DSparkTrainingConfig(output_dir="runs/bench-training-step", max_steps=10**9,
                                          per_device_batch_size=args.batch_size, gradient_accumulation_steps=1,
                                          num_anchors=args.num_anchors,
                                          loss=LossConfig.for_head(drafter.config.sequential_head),
                                          schedule="constant", warmup_steps=1, progress=False)
            fresh = DSparkDraftModel.from_pretrained(args.drafter, target=target).float()
            trainer = DSparkTrainer(fresh, items, config, accelerator=make_accelerator(precision))
            trainer.training_step()  # warm-up: first-call allocations and oneDNN primitive creation
            t0 = time.perf_counter()
            loss = 0.0
            for _ in range(args.steps - 1):
                stats, _ = trainer.training_step()
                loss += stats.summary(config.loss)["loss"] / (args.steps - 1)
            step[arm].append((time.perf_counter() - t0) / (args.steps - 1) / args.batch_size)
            losses[arm].append(loss)
    tokens = statistics.mean(len(s.input_ids) for s in data.samples)
    result = {"tokens_per_sample": round(tokens), "prefill_dtype": str(next(prefiller.parameters()).dtype),
              "prefill_s": round(prefill, 3),
              "logsumexp_fp32_s": round(logsumexp, 3), "memo_read_s": round(memo_read, 4),
              "step_fp32_s": [round(s, 3) for s in step["no"]],
              "step_bf16_s": [round(s, 3) for s in step.get("bf16", [])],
              "step_speedup_bf16": [round(a / b, 2) for a, b in zip(step["no"], step.get("bf16", []))],
              "loss_fp32": [round(x, 4) for x in losses["no"]],
              "loss_bf16": [round(x, 4) for x in losses.get("bf16", [])]}
    if args.loss_from:
        old = f"no@{args.loss_from}"
        result.update({f"step_fp32_s_loss_at_{args.loss_from}": [round(s, 3) for s in step[old]],
                       f"loss_fp32_loss_at_{args.loss_from}": [round(x, 4) for x in losses[old]],
                       "step_speedup_over_revision": [round(a / b, 2) for a, b in zip(step[old], step["no"])]})
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
