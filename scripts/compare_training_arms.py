"""Equal-budget training arms from one drafter: which data and which learning-rate schedule win on held-out prompts.

Each arm continues the same starting drafter for --steps optimizer steps (fresh optimizer, batch 4, 64 anchors, the
continuous run's settings) and is scored on the fixed held-out cache (greedy τ, full block). An arm is
``DATA-SCHEDULE``: DATA is ``onpolicy`` (the target's own answers, data/smollm2*/), ``mix`` (those plus
human-written text and documentation, what scripts/train_continuous.py --with-human-text reads) or ``requests`` (only
the answers to composed chat requests, data/smollm2-requests/: whether that kind of prompt moves held-out chat
faster than the whole mix does); SCHEDULE is ``constant`` (the continuous run's rate) or ``cosine`` (warm-up, then
decaying to zero: what --cool-down does).

    nice -n 19 .venv/bin/python scripts/compare_training_arms.py --start drafter_training/smollm2/drafter \\
        --arms mix-constant mix-cosine onpolicy-cosine onpolicy-constant --seed 1 --out DIR

Run it again with another --seed to repeat; rows are appended to DIR/arms.jsonl, each arm's drafter (bf16) is kept in
DIR/run-ARM/drafter-seedS. ``--ce-weight`` / ``--l1-weight`` / ``--decay`` (the loss), ``--num-layers`` (depth,
grown by zero-output copies) and ``--skip-repeats`` (no loss on loops) apply to every arm of a call and are recorded
in its rows. Arms with one --seed train on the same batches
only while the data does not change: pause a regeneration writing into data/ until every arm of the comparison has
started.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from pathlib import Path

import torch
from train_continuous import HUMAN_TEXT, ON_POLICY

from hf_dspark import DSparkDraftModel
from hf_dspark.loading import load_target
from hf_dspark.training.continuous import ContinuousRecipe, prefilling_target, save_bf16, step_precision
from hf_dspark.training.losses import LossConfig
from hf_dspark.training.prefill_features import TargetPrefillDataset, chat_record_files, read_chat_records
from hf_dspark.training.target_cache import TargetCacheDataset
from hf_dspark.training.trainer import DSparkTrainer, DSparkTrainingConfig, make_accelerator
from hf_dspark.training.validation import score_prompt_sets

DATA = {"onpolicy": ON_POLICY, "mix": ON_POLICY + HUMAN_TEXT, "requests": ["data/smollm2-requests/train.jsonl"]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--start", required=True, help="the drafter every arm starts from")
    p.add_argument("--arms", nargs="+", required=True, help="DATA-SCHEDULE, e.g. onpolicy-cosine")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--lr", type=float, default=ContinuousRecipe.lr, help="the continuous run's rate by default")
    p.add_argument("--num-anchors", type=int, default=ContinuousRecipe.num_anchors, help="blocks per sequence")
    p.add_argument("--mixed-precision", default="auto", choices=["auto", "no", "bf16"],
                   help="the drafter's step, as scripts/train_continuous.py (auto: bf16 on a CPU with bf16 units)")
    p.add_argument("--ce-weight", type=float, default=None,
                   help="weight of the cross-entropy on the answer's tokens (default: the head's, LossConfig.for_head)")
    p.add_argument("--l1-weight", type=float, default=None,
                   help="weight of the L1 distance to the target's probabilities (default: the head's)")
    p.add_argument("--decay", type=float, default=None,
                   help="slot k's loss weight is exp(-k / decay) (default: the head's, 4.0 as DeepSpec): smaller "
                        "puts the early slots, which most rounds stop at, first")
    p.add_argument("--num-layers", type=int, default=None,
                   help="deepen the start to this many draft layers first (new layers start as zero-output copies: "
                        "DSparkDraftModel.grow_layers), to weigh capacity against the start's own depth")
    p.add_argument("--skip-repeats", type=int, default=None, metavar="N",
                   help="no loss on answer tokens completing an N-gram seen earlier in the conversation "
                        "(hf_dspark.training.repetition): loops are the lookup proposer's at serving time")
    p.add_argument("--feature-memo", default="runs/feature-memo",
                   help="the continuous run's feature memo: prefilled features are read from (and added to) it")
    p.add_argument("--heldout-cache", default="runs/cache/heldout-greedy-128")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    for arm in args.arms:
        data, _, schedule = arm.partition("-")
        if data not in DATA or schedule not in ("constant", "cosine"):
            p.error(f"arm {arm!r}: DATA must be one of {sorted(DATA)}, SCHEDULE constant or cosine")
    return args


def loss_config(drafter, args) -> LossConfig:
    """The continuous run's loss for the drafter's head, with what --ce-weight / --l1-weight / --decay override."""
    overrides = {name: value for name, value in (("ce_weight", args.ce_weight), ("l1_weight", args.l1_weight),
                                                 ("decay", args.decay)) if value is not None}
    return LossConfig.for_head(drafter.config.sequential_head, **overrides)


def run_arm(target, tokenizer, feature_target, heldout, args, arm: str, start: str) -> dict:
    """``start``: a private copy of --start, read once (the continuous run may rewrite --start between arms)."""
    data, _, schedule = arm.partition("-")
    drafter = DSparkDraftModel.from_pretrained(start, target=target).float()
    if args.num_layers:
        drafter.grow_layers(args.num_layers)
    dataset = TargetPrefillDataset(target, tokenizer, read_chat_records(chat_record_files(DATA[data])),
                                   drafter.config.target_layer_ids, max_length=1024, feature_target=feature_target,
                                   logsumexp=drafter.draft_to_target is not None, progress=False,
                                   memo_dir=args.feature_memo,
                                   memo_max_bytes=int(ContinuousRecipe.feature_memo_gb * 1e9),
                                   skip_repeats=args.skip_repeats)
    config = DSparkTrainingConfig(
        output_dir=str(Path(args.out) / f"run-{arm}"), max_steps=args.steps, per_device_batch_size=4,
        gradient_accumulation_steps=1, learning_rate=args.lr, num_anchors=args.num_anchors, seed=args.seed,
        loss=loss_config(drafter, args), schedule=schedule, warmup_steps=10, progress=False)
    precision = step_precision(args.mixed_precision)
    trainer = DSparkTrainer(drafter, dataset, config, accelerator=make_accelerator(precision))
    start, tokens, loss = time.monotonic(), 0, 0.0
    for _ in range(args.steps):
        stats, info = trainer.training_step()
        tokens += info["num_tokens"]
        loss += stats.summary(config.loss)["loss"] / args.steps
    scores = score_prompt_sets(trainer.drafter, heldout)
    save_bf16(trainer.drafter, Path(config.output_dir) / f"drafter-seed{args.seed}")  # for diagnose_misses --drafters
    return {"arm": arm, "seed": args.seed, "steps": args.steps, "tokens": tokens, "loss": round(loss, 4),
            "seconds": round(time.monotonic() - start), "start": args.start, "lr": args.lr,
            "num_anchors": args.num_anchors, "precision": precision,
            "ce_weight": config.loss.ce_weight, "l1_weight": config.loss.l1_weight,
            "decay": config.loss.decay,
            "num_layers": drafter.config.num_hidden_layers, "skip_repeats": args.skip_repeats,
            "heldout": {name: {"tau": round(s["tau_greedy"], 4),
                               "acceptance": [round(a, 3) for a in s["conditional_acceptance"]]}
                        for name, s in scores.items()}}


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target()
    feature_target = prefilling_target(target)  # as the continuous run prefills
    heldout = TargetCacheDataset(args.heldout_cache)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = out / "start"  # every arm of every seed in this folder starts from this one copy
    if not start.is_dir():
        shutil.copytree(args.start, start)
        (start / "SOURCE").write_text(args.start)
    elif (start / "SOURCE").read_text() != args.start:
        raise SystemExit(f"{out} holds arms that started from {(start / 'SOURCE').read_text()}, not {args.start}: "
                         "use another --out")
    for arm in args.arms:
        row = run_arm(target, tokenizer, feature_target, heldout, args, arm, str(start))
        print(json.dumps(row), flush=True)
        with (out / "arms.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
