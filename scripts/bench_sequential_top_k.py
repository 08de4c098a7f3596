"""The sequential bias on the base top-k only vs over the whole draft vocabulary (issue #17): τ and drafting cost.

``DSparkConfig.sequential_top_k`` (the ``dspark_sequential_top_k=`` generate keyword per call) evaluates the Markov
bias B_k = W2·u_k only on the base logits' top-k tokens and defines q_k on that support: still lossless (q is what
the drafts are sampled from), cheaper on a CPU, but not what the reference drafts. Every round here proposes the
whole block (threshold 0, no lookup), so τ measures the proposals alone; the arms alternate per prompt.

    python scripts/bench_sequential_top_k.py --per-category 2 --max-new-tokens 96 --top-k 0 64 --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from hf_dspark.evaluation.benchmarks import default_eval_dir
from hf_dspark.loading import load_drafter, load_target
from hf_dspark.training.prompts import read_prompts

CATEGORIES = ["gsm8k", "math500", "humaneval", "mbpp", "mt-bench"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--top-k", type=int, nargs="+", default=[0, 64])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(None)
    drafter = load_drafter(None, target).model
    prompts = [q.first_turn for c in CATEGORIES for q in read_prompts(default_eval_dir() / f"{c}.jsonl")[:args.per_category]]
    runs = {k: {"stats": [], "seconds": 0.0, "tokens": 0} for k in args.top_k}
    reference = {}
    for i, text in enumerate(prompts):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        order = args.top_k[i % len(args.top_k):] + args.top_k[:i % len(args.top_k)]
        for k in order:
            start = time.perf_counter()
            out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=args.max_new_tokens, assistant_model=drafter,
                                  dspark_confidence_threshold=0.0, dspark_lookup=False, dspark_sequential_top_k=k)
            runs[k]["seconds"] += time.perf_counter() - start
            runs[k]["tokens"] += out.shape[1] - ids.shape[1]
            runs[k]["stats"].append(drafter.stats)
            reference.setdefault(i, out.tolist())
            assert out.tolist() == reference[i], "greedy output differs between top-k settings"
    rows = []
    for k, run in runs.items():
        merged = run["stats"][0]
        for stats in run["stats"][1:]:
            merged = merged.merge(stats)
        rows.append({"sequential_top_k": k, "tau": merged.tau, "acceptance": merged.acceptance_rate,
                     "conditional": merged.conditional_acceptance, "draft_ms_per_round": 1e3 * merged.draft_seconds
                     / merged.rounds, "tok_s": run["tokens"] / run["seconds"], "rounds": merged.rounds})
    print("| sequential_top_k | τ (full block) | acceptance | drafting ms / round | tok/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['sequential_top_k'] or 'full vocabulary (0)'} | {r['tau']:.3f} | {r['acceptance']:.1%} | "
              f"{r['draft_ms_per_round']:.1f} | {r['tok_s']:.1f} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "sequential_top_k.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
