"""Evaluate one or two drafters (e.g. DSpark vs DFlash) on the benchmark prompts, DeepSpec's protocol.

Writes results.md, results.json, the raw rounds and PNG plots to --out and prints the markdown tables.
Defaults: the embedded SmolLM2-135M-Instruct target, ../shared/eval_datasets, T = 0 and 1. The library keeps
DeepSpec's caps and 2048 new tokens; on a CPU pass smaller --max-samples / --max-new-tokens:

    python scripts/eval_drafter.py --drafter runs/dspark/drafter --baseline-drafter runs/dflash/drafter \\
        --out results/smollm2 --max-samples 20 --max-new-tokens 256
    python scripts/eval_drafter.py --drafter runs/dspark/calibrated --out results/x --temperatures 1 --no-speedup
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from hf_dspark import DSparkDraftModel
from hf_dspark.evaluation.benchmarks import DEEPSPEC_SEED, DEFAULT_BENCHMARKS
from hf_dspark.evaluation.harness import DEFAULT_THRESHOLDS, drafter_label, evaluate
from hf_dspark.embedded import load_target

logger = logging.getLogger("eval_drafter")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_drafters(paths: list[str], names: list[str] | None, target) -> dict[str, DSparkDraftModel]:
    param = next(target.parameters())
    drafters = [DSparkDraftModel.from_pretrained(p, target=target).to(device=param.device, dtype=param.dtype).eval()
                for p in paths]
    labels = list(names) if names else [drafter_label(d) for d in drafters]
    if len(labels) != len(drafters):
        raise SystemExit(f"--names needs {len(drafters)} labels, got {len(labels)}")
    if len(set(labels)) < len(labels):  # e.g. two DSpark drafters: tell them apart by position
        labels = [f"{label}#{i + 1}" for i, label in enumerate(labels)]
    return dict(zip(labels, drafters))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True, help="drafter directory (any supported checkpoint dialect)")
    p.add_argument("--baseline-drafter", nargs="+", default=None,
                   help="drafters to compare with (e.g. DFlash, Eagle3), scored on the same prompts")
    p.add_argument("--names", nargs="+", default=None, help="labels for the drafters (default: DSpark / DFlash)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--target", default=None, help="target model path / id (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--eval-dir", default=None, help="folder of <benchmark>.jsonl (default: ../shared/eval_datasets)")
    p.add_argument("--benchmarks", nargs="+", default=list(DEFAULT_BENCHMARKS))
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--max-new-tokens", type=int, default=2048)
    p.add_argument("--max-samples", type=int, default=None, help="lower every benchmark's cap (CPU runs)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seed", type=int, default=DEEPSPEC_SEED)
    p.add_argument("--thresholds", type=float, nargs="+", default=list(DEFAULT_THRESHOLDS))
    p.add_argument("--no-speedup", action="store_true", help="skip the plain-generate timing runs")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # one DSparkStats summary per generate call would flood the log; the results carry the same numbers
    logging.getLogger("hf_dspark").addFilter(lambda record: record.levelno > logging.INFO)
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target, DTYPES[args.dtype])
    target.to(args.device)
    paths = [args.drafter] + list(args.baseline_drafter or [])
    drafters = load_drafters(paths, args.names, target)
    result = evaluate(target, tokenizer, drafters, benchmarks=args.benchmarks, eval_dir=args.eval_dir,
                      temperatures=args.temperatures, max_new_tokens=args.max_new_tokens,
                      max_samples=args.max_samples, seed=args.seed, batch_size=args.batch_size,
                      measure_speedup=not args.no_speedup, thresholds=args.thresholds)
    written = result.save(args.out, plots=not args.no_plots)
    print(result.to_markdown())
    print(f"written: {written['markdown']}, {written['json']} (+ {len(written) - 2} rounds/plot files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
