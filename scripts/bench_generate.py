"""Batch-1 generation benchmark on the embedded SmolLM2-135M-Instruct target (issue: generate drop-in).

Every configuration runs on the same prompts, interleaved prompt by prompt (round robin) so the noise of a
shared machine hits all of them alike; results are reported as ratios to plain ``generate`` measured in the
same run. Greedy speculative outputs are checked token for token against plain greedy of the same model.

    python scripts/bench_generate.py --drafter path/to/dspark [--dflash-drafter path] --per-benchmark 3 \
        --max-new-tokens 128 --out runs/bench_generate

This script is ``hf-dspark bench`` (same options, ``--help`` lists them); the work is done in the package.
"""

from __future__ import annotations

import sys

from hf_dspark.cli import main as hf_dspark_main


def main(argv: list[str] | None = None) -> int:
    return hf_dspark_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
