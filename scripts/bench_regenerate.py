"""Side by side: answering prompts with batched ``target.generate`` vs the continuous-batching engine.

Data regeneration is the slowest stage of training a drafter on a CPU, so its back-end matters. Both back-ends
answer the same prompts with the same sampling settings (outputs go to a scratch directory) and the script
prints new tokens per second of each and their ratio. Usage:

    python scripts/bench_regenerate.py --prompts data/smollm2-magpie/prompts_magpie.jsonl --num-prompts 48 \\
        --batch-sizes 24 --engine-running 24 48 --out benchmarks/regenerate.json
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import torch

from hf_dspark.loading import load_target
from hf_dspark.serving import DSparkEngine
from hf_dspark.training.prompts import read_prompts
from hf_dspark.training.regenerate import SamplingSettings, regenerate_local, regenerate_with_engine


def _new_tokens(path: Path) -> int:
    return sum(json.loads(line)["num_new_tokens"] for line in path.read_text().splitlines())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", required=True, help="jsonl of prompts (turns / messages)")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[24], help="generate back-end batch sizes")
    parser.add_argument("--engine-running", type=int, nargs="*", default=[24, 48],
                        help="engine back-end: requests decoding at once")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_target()
    prompts = read_prompts(args.prompts)[: args.num_prompts]
    settings = SamplingSettings(max_new_tokens=args.max_new_tokens)
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        configs = [("generate", b) for b in args.batch_sizes] + [("engine", r) for r in args.engine_running]
        for backend, width in configs:
            path = Path(scratch) / f"{backend}-{width}.jsonl"
            start = time.perf_counter()
            if backend == "generate":
                regenerate_local(model, tokenizer, prompts, path, settings=settings, batch_size=width, seed=args.seed)
            else:
                engine = DSparkEngine(model, policy="none", max_running_requests=width, tokenizer=tokenizer,
                                      max_batch_tokens=width * 1024)
                regenerate_with_engine(engine, tokenizer, prompts, path, settings=settings, seed=args.seed)
            seconds = time.perf_counter() - start
            tokens = _new_tokens(path)
            runs.append({"backend": backend, "width": width, "prompts": len(prompts), "new_tokens": tokens,
                         "seconds": round(seconds, 1), "tok_s": round(tokens / seconds, 1)})
            print(json.dumps(runs[-1]), flush=True)
    base = runs[0]["tok_s"]
    print(f"\n{'backend':>9} {'width':>5} {'tokens':>7} {'s':>7} {'tok/s':>7} {'ratio':>6}")
    for run in runs:
        print(f"{run['backend']:>9} {run['width']:>5} {run['new_tokens']:>7} {run['seconds']:>7.1f} "
              f"{run['tok_s']:>7.1f} {run['tok_s'] / base:>6.2f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"threads": args.threads, "torch": torch.__version__,
                                              "max_new_tokens": args.max_new_tokens, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
