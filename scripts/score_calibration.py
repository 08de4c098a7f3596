"""How well a drafter's stored calibration predicts acceptance on rounds it was not fitted on.

A fit is scored in-sample and on split halves of its own prompts; what the scheduler meets is other text. This
scores the drafter's stored fit (greedy or sampling) on rounds recorded elsewhere, e.g. the held-out prompts'
rounds ``scripts/eval_heldout.py`` writes (``rounds-<drafter>-<set>.npz``):

    python scripts/score_calibration.py --drafter hf_dspark/checkpoints/smollm2-135m-instruct-dspark \\
        --rounds runs/heldout/ship/rounds-shipped-chat.npz runs/heldout/ship/rounds-shipped-code.npz --greedy
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_dspark.training.calibration import calibration_report
from hf_dspark.evaluation.recorder import RoundTrace


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True, help="drafter directory whose config holds the fit")
    p.add_argument("--rounds", nargs="+", required=True, help="calibration_rounds / rounds-*.npz files")
    p.add_argument("--greedy", action="store_true", help="score the greedy fit (default: the sampling fit)")
    args = p.parse_args(argv)
    config = json.loads((Path(args.drafter) / "config.json").read_text())
    prefix = "greedy_" if args.greedy else ""
    temperatures, offsets = config[f"{prefix}confidence_temperatures"], config.get(f"{prefix}confidence_offsets")
    print("| rounds | position | rounds | acceptance | mean calibrated confidence | ECE raw | ECE calibrated |")
    print("|---|---|---|---|---|---|---|")
    for path in args.rounds:
        trace = RoundTrace.load(path)
        for row in calibration_report(trace.confidence_logits, trace.num_accepted, trace.num_proposed,
                                      temperatures=temperatures, offsets=offsets):
            print(f"| {Path(path).name} | {row.position} | {row.num_rounds} | {row.acceptance_rate:.3f} | "
                  f"{row.mean_confidence_after:.3f} | {100 * row.ece_before:.1f} % | {100 * row.ece_after:.1f} % |")


if __name__ == "__main__":
    main()
