"""Held-out validation curve of training runs: τ_probabilistic / accept@k / loss of every checkpoint on
conversations the drafters never trained on (the last --holdout records of the regenerated data, the same ones STS
calibration uses). Shows where more epochs stop helping on a small data set, and picks a checkpoint without
touching the evaluation benchmarks.

    python scripts/validate_checkpoints.py --runs runs/smollm2-markov runs/smollm2-none --out runs/validation
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from hf_dspark.loading import load_drafter, load_target
from hf_dspark.training.target_cache import (MANIFEST_NAME, TargetCacheDataset, build_target_cache, load_manifest,
                                             read_jsonl)
from hf_dspark.training.trainer import evaluate_on_cache

logger = logging.getLogger("validate_checkpoints")


def checkpoints(run: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every checkpoint of ``run``, plus its final drafter (at the last logged step)."""
    found = [(int(d.name.split("-")[-1]), d) for d in run.glob("checkpoint-*") if (d / "config.json").is_file()]
    final = run / "drafter"
    if (final / "config.json").is_file():
        lines = (run / "metrics.jsonl").read_text().splitlines()
        step = json.loads(lines[-1])["step"] if lines else -1
        if step not in {s for s, _ in found}:
            found.append((step, final))
    return sorted(found)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", required=True, help="training run directories (train_drafter.py --out)")
    p.add_argument("--data", default="data/smollm2/train.jsonl")
    p.add_argument("--holdout", type=int, default=32, help="the last N records are the held-out set")
    p.add_argument("--cache", default="runs/cache/smollm2-holdout", help="held-out target cache (built if absent)")
    p.add_argument("--train-cache", default="runs/cache/smollm2", help="training cache (for its layer ids)")
    p.add_argument("--target", default=None)
    p.add_argument("--num-anchors", type=int, default=64)
    p.add_argument("--out", default="runs/validation")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target)
    if not (Path(args.cache) / MANIFEST_NAME).is_file():
        records = list(read_jsonl(args.data))[-args.holdout:]
        layers = load_manifest(args.train_cache)["target_layer_ids"]
        build_target_cache(target, tokenizer, records, args.cache, layer_ids=layers, progress=False)
    dataset = TargetCacheDataset(args.cache)
    rows = []
    for run in map(Path, args.runs):
        for step, directory in checkpoints(run):
            drafter = load_drafter(directory, target).model
            metrics = evaluate_on_cache(drafter, dataset, num_anchors=args.num_anchors)
            rows.append({"run": run.name, "step": step, **metrics})
            logger.info("%s step %d: tau_prob %.3f accept@0 %.3f loss %.3f", run.name, step,
                        metrics["tau_probabilistic"], metrics["accept_rate@0"], metrics["loss"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "validation.json").write_text(json.dumps({"holdout_records": args.holdout, "rows": rows}, indent=2))
    print("| run | step | held-out τ_prob | accept@0 | accept@1 | loss |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['step']} | {r['tau_probabilistic']:.3f} | {r['accept_rate@0']:.3f} | "
              f"{r['accept_rate@1']:.3f} | {r['loss']:.3f} |")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["run"] for r in rows):
        pts = [(r["step"], r["tau_probabilistic"]) for r in rows if r["run"] == name]
        ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out τ_probabilistic")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "validation.png", dpi=120)


if __name__ == "__main__":
    main()
