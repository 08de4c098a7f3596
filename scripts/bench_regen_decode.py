"""How fast the regeneration answers real prompts: batched ``generate`` (every row decodes until the batch's longest
answer ends) against :func:`~hf_dspark.training.shrinking_decode.decode_shrinking` (an answer that ends leaves the
batch; ``shrinking``: with its default in-place growing KV cache, ``shrinking-dynamic``: with transformers'
``DynamicCache``, which copies the whole cache every step), all sampling with the regeneration's settings (T 0.2,
top-p 0.9, 384 tokens at most).

Each repeat takes the next ``--batch-size`` prompts of ``--prompts`` (chat records: their first user turns), sorted
by length as the regeneration sorts them, and runs every arm on them, the order rotating per repeat, at one thread.
The rate counts answer tokens (an end-of-sequence token included), not the steps spent on finished rows. Pause
background jobs first (kill -STOP), then

    .venv/bin/python scripts/bench_regen_decode.py --prompts data/smollm2-magpie4/train.jsonl --repeats 3 \\
        --out benchmarks/current/regen_decode

``speedup_*`` is each arm's rate ÷ the first arm's, per repeat.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from transformers import DynamicCache

from hf_dspark.loading import load_target
from hf_dspark.training.prefill_features import read_chat_records
from hf_dspark.training.regenerate import SamplingSettings
from hf_dspark.training.shrinking_decode import decode_shrinking


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True, help="chat-record jsonl whose first user turns are the prompts")
    p.add_argument("--arms", nargs="+", default=["generate", "shrinking"],
                   choices=["generate", "shrinking", "shrinking-dynamic"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=48, help="as the regeneration beside the continuous run")
    p.add_argument("--max-new-tokens", type=int, default=384, help="the regeneration's cap")
    p.add_argument("--compact-every", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="folder for result.json")
    return p.parse_args(argv)


def answer_tokens(new: torch.Tensor, eos_ids: set[int]) -> int:
    """Tokens up to and including each row's first end-of-sequence token (all of them where none)."""
    total = 0
    for row in new.tolist():
        end = next((i for i, t in enumerate(row) if t in eos_ids), None)
        total += len(row) if end is None else end + 1
    return total


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target()
    tokenizer.padding_side = "left"
    turns = [m["content"] for r in read_chat_records([args.prompts]) for m in r["messages"][:1] if m["role"] == "user"]
    eos = target.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    settings = SamplingSettings(max_new_tokens=args.max_new_tokens)
    rates: dict[str, list[float]] = {name: [] for name in args.arms}
    tokens: dict[str, list[int]] = {name: [] for name in args.arms}
    with torch.inference_mode():
        for repeat in range(args.repeats):
            batch = sorted(turns[repeat * args.batch_size:(repeat + 1) * args.batch_size], key=len)
            texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                   add_generation_prompt=True) for t in batch]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            shift = repeat % len(args.arms)
            for name in args.arms[shift:] + args.arms[:shift]:
                torch.manual_seed(repeat)
                start = time.perf_counter()
                if name == "generate":
                    out = target.generate(**enc, **settings.generate_kwargs(), pad_token_id=tokenizer.pad_token_id)
                    n = answer_tokens(out[:, enc["input_ids"].shape[1]:], eos_ids)
                else:
                    cache = DynamicCache(config=target.config) if name == "shrinking-dynamic" else None
                    rows = decode_shrinking(target, enc["input_ids"], enc["attention_mask"], args.max_new_tokens,
                                            next_tokens=settings.next_tokens(), eos_token_ids=eos_ids,
                                            compact_every=args.compact_every, cache=cache)
                    n = sum(len(r.tokens) + r.finished for r in rows)
                rates[name].append(round(n / (time.perf_counter() - start), 1))
                tokens[name].append(n)
            print(repeat, {k: v[-1] for k, v in rates.items()}, {k: v[-1] for k, v in tokens.items()}, flush=True)
    base = rates[args.arms[0]]
    result = {"prompts": args.prompts, "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
              "compact_every": args.compact_every, "threads": args.threads, "temperature": settings.temperature,
              "top_p": settings.top_p, "answer_tokens_per_second": rates, "answer_tokens": tokens}
    for name in args.arms[1:]:
        ratios = [b / a for a, b in zip(base, rates[name])]
        result[f"speedup_per_repeat {name}"] = [round(r, 2) for r in ratios]
        result[f"speedup_geomean {name}"] = round(statistics.geometric_mean(ratios), 3)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        name = "result.json" if args.arms == ["generate", "shrinking"] else f"result_{'_'.join(args.arms)}.json"
        (Path(args.out) / name).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
