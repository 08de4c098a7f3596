"""Train a DSpark (or DFlash: --head none) drafter on a target cache built by scripts/build_target_cache.py.

The same command runs on one CPU, one GPU, or many GPUs / nodes (`accelerate launch scripts/train_drafter.py ...`).
Stops at --steps (or --epochs), or cleanly at --max-minutes with a checkpoint; --resume continues exactly.
The finished drafter is written to <out>/drafter (fp32; the target's embedding / LM head are never saved).

    python scripts/train_drafter.py --cache cache/smollm2 --out runs/dspark --steps 2000 --max-minutes 600
    python scripts/train_drafter.py --cache cache/smollm2 --out runs/dspark --steps 2000 --resume
    accelerate launch --num_processes 8 scripts/train_drafter.py --cache cache/x --out runs/x --epochs 10 \\
        --batch-size 4 --grad-accum 16 --num-anchors 512 --num-layers 5

This script is ``hf-dspark train`` (same options, ``--help`` lists them); the work is done in the package.
"""

from __future__ import annotations

import sys

from hf_dspark.cli import main as hf_dspark_main


def main(argv: list[str] | None = None) -> int:
    return hf_dspark_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
