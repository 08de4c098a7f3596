"""Produce the SmolLM2-135M-Instruct training set: synthesised prompts answered by the target itself.

Resumable: rerun the same command and it continues where it stopped (prompts are fixed by the seed, answers
already in the output file are skipped). Usage:

    python scripts/regenerate_smollm2.py --out data/smollm2 --num-template 6000 --num-magpie 1500
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from hf_dspark.embedded import load_default_target
from hf_dspark.training.prompts import EvalOverlapGuard, Prompt, read_prompts, synthesise_template_prompts
from hf_dspark.training.regenerate import (
    SamplingSettings,
    regenerate_local,
    regenerate_with_engine,
    synthesise_magpie_prompts,
)

MAGPIE_SYSTEMS = [
    None,
    "You are a helpful AI assistant. Users ask you math word problems.",
    "You are a helpful AI assistant. Users ask you to write Python code.",
    "You are a helpful AI assistant. Users ask you for advice, explanations and writing help.",
]


def _write_prompts(path: Path, prompts: list[Prompt]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"turns": list(p.turns), "category": p.category}, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/smollm2")
    parser.add_argument("--eval-dir", default="../shared/eval_datasets")
    parser.add_argument("--num-template", type=int, default=6000)
    parser.add_argument("--num-magpie", type=int, default=1500)
    parser.add_argument("--magpie-max-new-tokens", type=int, default=64,
                        help="length cap of a synthesised request (longer ones are dropped as rambling)")
    parser.add_argument("--backend", choices=["generate", "engine"], default="generate",
                        help="answer with batched target.generate, or with the continuous-batching DSparkEngine "
                             "(policy none: a finished answer frees its row at once)")
    parser.add_argument("--batch-size", type=int, default=24,
                        help="generate: prompts per batch; engine: requests decoding at once")
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    guard = EvalOverlapGuard.from_dir(args.eval_dir)
    model, tokenizer = load_default_target()

    template_file = out / "prompts_template.jsonl"
    if not template_file.exists():
        _write_prompts(template_file, synthesise_template_prompts(args.num_template, seed=args.seed, guard=guard))
    magpie_file = out / "prompts_magpie.jsonl"
    if args.num_magpie:  # resumable: continues an interrupted synthesis from the prompts already written
        synthesise_magpie_prompts(model, tokenizer, args.num_magpie, seed=args.seed, system_prompts=MAGPIE_SYSTEMS,
                                  guard=guard, out_path=magpie_file, max_new_tokens=args.magpie_max_new_tokens)

    prompts = read_prompts(template_file)
    if magpie_file.exists():
        magpie = read_prompts(magpie_file)[: args.num_magpie]
        # interleave so an early stop still leaves a mix of both sources
        prompts = [p for pair in zip(prompts, magpie) for p in pair] + prompts[len(magpie):] + magpie[len(prompts):]
    guard.raise_if_overlapping(prompts)
    settings = SamplingSettings(max_new_tokens=args.max_new_tokens)
    if args.backend == "engine":
        from hf_dspark.serving import DSparkEngine

        engine = DSparkEngine(model, policy="none", max_running_requests=args.batch_size, tokenizer=tokenizer,
                              max_batch_tokens=args.batch_size * 1024)
        regenerate_with_engine(engine, tokenizer, prompts, out / "train.jsonl", settings=settings, seed=args.seed)
    else:
        regenerate_local(model, tokenizer, prompts, out / "train.jsonl", settings=settings,
                         batch_size=args.batch_size, seed=args.seed)


if __name__ == "__main__":
    main()
