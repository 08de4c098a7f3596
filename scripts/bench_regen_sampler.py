"""How fast the regeneration of training data samples: transformers' ``do_sample=True`` against the
:class:`~hf_dspark.sampling.NucleusDraw` processor it uses now (same temperature / top-p, same distribution).

A batch of chat prompts answered by the embedded target at one thread, the two arms alternating within each repeat
so load drifts hit both alike. Pause background jobs first (kill -STOP), then

    .venv/bin/python scripts/bench_regen_sampler.py --repeats 3 --out benchmarks/current/regen_sampler
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from hf_dspark.loading import load_target
from hf_dspark.training.regenerate import SamplingSettings


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=48, help="as the regeneration beside the continuous run")
    p.add_argument("--new-tokens", type=int, default=60)
    p.add_argument("--temperature", type=float, default=0.2, help="the target's recommended sampling (SmolLM2)")
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="folder for result.json")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target()
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me about topic {i}: gardens, rivers "
                                             "and the people who look after them."}],
                                           tokenize=False, add_generation_prompt=True)
             for i in range(args.batch_size)]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    settings = SamplingSettings(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.new_tokens)
    arms = {"transformers do_sample": {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p,
                                       "max_new_tokens": args.new_tokens},
            "NucleusDraw": settings.generate_kwargs()}
    rates: dict[str, list[float]] = {name: [] for name in arms}
    with torch.inference_mode():
        for repeat in range(args.repeats):
            for name, kwargs in arms.items():
                torch.manual_seed(repeat)
                start = time.perf_counter()
                target.generate(**enc, **kwargs, min_new_tokens=args.new_tokens, pad_token_id=tokenizer.pad_token_id)
                rates[name].append(round(args.batch_size * args.new_tokens / (time.perf_counter() - start), 1))
    base, new = rates["transformers do_sample"], rates["NucleusDraw"]
    result = {"batch_size": args.batch_size, "new_tokens": args.new_tokens, "threads": args.threads,
              "temperature": args.temperature, "top_p": args.top_p, "tokens_per_second": rates,
              "speedup_per_repeat": [round(b / a, 2) for a, b in zip(base, new)],
              "speedup_geomean": round(statistics.geometric_mean([b / a for a, b in zip(base, new)]), 3)}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "result.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
