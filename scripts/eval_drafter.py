"""Evaluate one or two drafters (e.g. DSpark vs DFlash) on the benchmark prompts, DeepSpec's protocol.

Writes results.md, results.json, the raw rounds and PNG plots to --out and prints the markdown tables.
Defaults: the embedded SmolLM2-135M-Instruct target, ../shared/eval_datasets, T = 0 and 1. The library keeps
DeepSpec's caps and 2048 new tokens; on a CPU pass smaller --max-samples / --max-new-tokens:

    python scripts/eval_drafter.py --drafter runs/dspark/drafter --baseline-drafter runs/dflash/drafter \\
        --out results/smollm2 --max-samples 20 --max-new-tokens 256
    python scripts/eval_drafter.py --drafter runs/dspark/calibrated --out results/x --temperatures 1 --no-speedup

This script is ``hf-dspark eval`` (same options, ``--help`` lists them); the work is done in the package.
"""

from __future__ import annotations

import sys

from hf_dspark.cli import main as hf_dspark_main


def main(argv: list[str] | None = None) -> int:
    return hf_dspark_main(["eval", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
