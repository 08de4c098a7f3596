"""Produce a drafter's training set: prompts answered by the target itself (the published recipe).

Prompts come from your files (jsonl with ``turns``, ShareGPT ``conversations`` or OpenAI ``messages``;
``--prompts``), from templates (``--num-template``), and/or from the target itself (Magpie: the instruct model
writes user requests when given only the user-turn prefix; ``--num-magpie``). All are de-duplicated and refused
if they overlap the evaluation benchmarks. Answers come from the local target (batched ``generate``, or the
continuous-batching engine with ``--backend engine``) or from any OpenAI-compatible server (``--endpoint``).

Resumable: rerun the same command and it continues where it stopped (prompts are fixed by the seed, answers
already in the output file are skipped). Examples:

    python scripts/regenerate.py --out data/smollm2 --num-template 6000 --num-magpie 1500      # embedded SmolLM2
    python scripts/regenerate.py --target Qwen/Qwen3-0.6B --prompts my_prompts.jsonl --num-template 0 \\
        --num-magpie 0 --out data/qwen3
    python scripts/regenerate.py --target Qwen/Qwen3-8B --prompts my_prompts.jsonl --num-template 0 --num-magpie 0 \\
        --endpoint http://localhost:8000 --model-name Qwen/Qwen3-8B --out data/qwen3-8b     # a vLLM / SGLang server

This script is ``hf-dspark regenerate`` (same options, ``--help`` lists them); the work is done in the package.
"""

from __future__ import annotations

import sys

from hf_dspark.cli import main as hf_dspark_main


def main(argv: list[str] | None = None) -> int:
    return hf_dspark_main(["regenerate", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
