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

This script is ``hf-dspark calibrate`` (same options, ``--help`` lists them); the work is done in the package.
"""

from __future__ import annotations

import sys

from hf_dspark.cli import main as hf_dspark_main


def main(argv: list[str] | None = None) -> int:
    return hf_dspark_main(["calibrate", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
