"""Build (or extend) a target cache: tapped-layer outputs + final hidden states of regenerated conversations.

Resumable: rerun the same command and it skips conversations already cached. Defaults fit a CPU and the
embedded SmolLM2-135M-Instruct target. Usage:

    python scripts/build_target_cache.py --data data/smollm2/train.jsonl --out cache/smollm2
    python scripts/build_target_cache.py --target path/to/model --data a.jsonl b.jsonl --out cache/x --layers 1 9 17

This script is ``hf-dspark cache`` (same options, ``--help`` lists them); the work is done in the package.
"""

from __future__ import annotations

import sys

from hf_dspark.cli import main as hf_dspark_main


def main(argv: list[str] | None = None) -> int:
    return hf_dspark_main(["cache", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
