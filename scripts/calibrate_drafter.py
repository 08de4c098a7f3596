"""STS-calibrate a drafter's confidence head on held-out prompts and save it with the temperatures (and offsets).

Runs the drafter at the serving temperature on prompts the trainer did not see (default: the last
--num-prompts records of the regenerated training data; build the target cache from the leading records only,
e.g. ``build_target_cache.py --limit``), refuses any prompt that overlaps the evaluation sets, fits one
temperature and offset per position (--temperatures-only: the paper's STS without offsets), and writes to
--out: the calibrated drafter (config ``confidence_temperatures`` / ``confidence_offsets``; at --temperature 0
the greedy fit ``greedy_confidence_temperatures`` / ``greedy_confidence_offsets``, keeping the sampling fit, so
calibrating twice gives a drafter calibrated for both), calibration.md / .json (ECE and AUC per position
before/after), reliability.png and the raw rounds.

    python scripts/calibrate_drafter.py --drafter runs/dspark/drafter --out runs/dspark/calibrated
    python scripts/calibrate_drafter.py --drafter runs/x/drafter --out runs/x/cal --prompts heldout.jsonl \\
        --num-prompts 0 --temperature 0
    # refit from the rounds an earlier run recorded (no generation): e.g. add offsets to a calibrated drafter
    python scripts/calibrate_drafter.py --drafter runs/x/cal --out runs/x/cal2 --rounds runs/x/cal/calibration_rounds.npz
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch
from transformers import AutoModelForCausalLM

from hf_dspark import DSparkDraftModel
from hf_dspark.evaluation.calibration_run import calibrate, fit_from_trace, held_out_prompts, save_calibrated
from hf_dspark.evaluation.recorder import RoundTrace
from hf_dspark.embedded import load_target

logger = logging.getLogger("calibrate_drafter")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True, help="drafter directory to calibrate")
    p.add_argument("--out", required=True, help="where the calibrated drafter and the report go")
    p.add_argument("--prompts", default="data/smollm2/train.jsonl",
                   help="held-out prompt file (jsonl/json: turns, messages, conversations, prompt, ...)")
    p.add_argument("--num-prompts", type=int, default=64, help="use the last N records (0 = the whole file)")
    p.add_argument("--temperature", type=float, default=1.0, help="serving temperature to calibrate for")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-dir", default=None, help="evaluation prompts to refuse (default: ../shared/eval_datasets)")
    p.add_argument("--target", default=None, help="target model path / id (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", default=None,
                   help="refit from a calibration_rounds.npz written by an earlier run instead of generating "
                        "(the drafter must be the one that recorded them: its raw confidence logits are reused)")
    p.add_argument("--rounds-temperature", type=float, default=None,
                   help="with --rounds: the serving temperature they were recorded at (for the report)")
    p.add_argument("--temperatures-only", action="store_true",
                   help="fit the paper's per-position temperatures only (default: temperature + offset)")
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
    if args.rounds:  # no generation: the target is needed only to bind the drafter (no tokenizer)
        if args.target is None:
            target, _ = load_target(None, DTYPES[args.dtype])
        else:
            target = AutoModelForCausalLM.from_pretrained(args.target, dtype=DTYPES[args.dtype]).eval()
        drafter = DSparkDraftModel.from_pretrained(args.drafter, target=target)
        trace = RoundTrace.load(args.rounds)
        if trace.block_size != drafter.config.block_size:
            raise SystemExit(f"{args.rounds} holds rounds of block size {trace.block_size}, the drafter drafts "
                             f"{drafter.config.block_size}: they were not recorded with this drafter")
        run = fit_from_trace(trace, serving_temperature=args.rounds_temperature,
                             offsets=not args.temperatures_only)
        return _write(drafter, run, args)
    prompts = held_out_prompts(args.prompts, args.num_prompts or None)
    target, tokenizer = load_target(args.target, DTYPES[args.dtype])
    target.to(args.device)
    param = next(target.parameters())
    drafter = DSparkDraftModel.from_pretrained(args.drafter, target=target).to(device=param.device,
                                                                              dtype=param.dtype).eval()
    run = calibrate(target, tokenizer, drafter, prompts, temperature=args.temperature,
                    max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
                    eval_dir=args.eval_dir, offsets=not args.temperatures_only)
    return _write(drafter, run, args)


def _write(drafter, run, args) -> int:
    written = save_calibrated(drafter, run, args.out, plots=not args.no_plots)
    print(run.to_markdown())
    print("temperatures: " + " ".join(f"{t:.3f}" for t in run.temperatures))
    if run.offsets is not None:
        print("offsets:      " + " ".join(f"{b:+.3f}" for b in run.offsets))
    print(f"calibrated drafter written to {written['drafter']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
