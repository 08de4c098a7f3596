"""Train a DSpark (or DFlash: --head none) drafter on a target cache built by scripts/build_target_cache.py.

The same command runs on one CPU, one GPU, or several processes (GPUs, CPU processes, nodes).
Stops at --steps (or --epochs), or cleanly at --max-minutes with a checkpoint; --resume continues exactly.
The finished drafter is written to <out>/drafter (fp32; the target's embedding / LM head are never saved).
The log states the number of processes and the global batch (batch x grad-accum x processes) at start.

    python scripts/train_drafter.py --cache cache/smollm2 --out runs/dspark --steps 2000 --max-minutes 600
    python scripts/train_drafter.py --cache cache/smollm2 --out runs/dspark --steps 2000 --resume

Several processes. On a host with several GPUs accelerate turns --num_processes N into N processes by itself:

    accelerate launch --num_processes 8 scripts/train_drafter.py --cache cache/x --out runs/x --epochs 10 \\
        --batch-size 4 --grad-accum 16 --num-anchors 512 --num-layers 5

On a CPU-only host plain `accelerate launch --num_processes N` starts ONE process (accelerate's simple launcher;
the log then warns). These start N processes there (gloo), and on multi-GPU hosts too:

    accelerate launch --multi_gpu --num_processes 2 scripts/train_drafter.py --cache cache/x --out runs/x ...
    torchrun --nproc_per_node 2 scripts/train_drafter.py --cache cache/x --out runs/x ...

This script is ``hf-dspark train`` (same options, ``--help`` lists them); the work is done in the package.
"""

from __future__ import annotations

import sys

from hf_dspark.cli import main as hf_dspark_main


def main(argv: list[str] | None = None) -> int:
    return hf_dspark_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
