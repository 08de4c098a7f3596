"""Drafting cost per round next to the target's verify cost: batch-1 greedy generate at full block on a few
held-out prompts, every drafter interleaved prompt by prompt (same noise), draft / verify seconds from
``draft.stats``. Pause other jobs while it runs (kill -STOP), it is a timing.

    python scripts/bench_draft_cost.py --drafters A B --names a b --num-prompts 4 --threads 1 --out runs/cost.json
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from hf_dspark import DSparkDraftModel
from hf_dspark.cpu_kernels import prepack_linears
from hf_dspark.embedded import load_target
from hf_dspark.evaluation.benchmarks import encode_chat_prompt
from hf_dspark.evaluation.heldout import read_heldout
from hf_dspark.evaluation.harness import FULL_PROPOSALS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafters", nargs="+", required=True)
    p.add_argument("--names", nargs="+", default=None)
    p.add_argument("--sets", nargs="+", default=["data/heldout/chat.jsonl", "data/heldout/code.jsonl"])
    p.add_argument("--num-prompts", type=int, default=3, help="per set")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--no-prepack", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    logging.getLogger("hf_dspark").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    names = args.names or [Path(d).name for d in args.drafters]
    target, tokenizer = load_target()
    if not args.no_prepack:
        target = prepack_linears(target)
    drafters = {}
    for name, path in zip(names, args.drafters):
        d = DSparkDraftModel.from_pretrained(path, target=target).eval()
        drafters[name] = d if args.no_prepack else prepack_linears(d)
    prompts = [q for s in args.sets for q in read_heldout(s)[: args.num_prompts]]
    totals = {n: {"rounds": 0, "draft_s": 0.0, "verify_s": 0.0, "committed": 0} for n in names}
    for prompt in prompts:
        ids = torch.tensor([encode_chat_prompt(tokenizer, prompt.text)])
        for name, drafter in drafters.items():
            drafter.bind_target(target)
            with torch.no_grad():  # every round the whole block, drafter only
                target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                                max_new_tokens=args.max_new_tokens, do_sample=False, dspark_lookup=False,
                                pad_token_id=tokenizer.eos_token_id, **FULL_PROPOSALS)
            s, t = drafter.stats, totals[name]
            t["rounds"] += s.rounds
            t["draft_s"] += s.draft_seconds
            t["verify_s"] += s.verify_seconds
            t["committed"] += s.committed_tokens
    rows = {}
    for name, t in totals.items():
        rows[name] = {"rounds": t["rounds"], "tau": t["committed"] / t["rounds"],
                      "draft_ms_per_round": 1000 * t["draft_s"] / t["rounds"],
                      "verify_ms_per_round": 1000 * t["verify_s"] / t["rounds"]}
        rows[name]["draft_share_of_round"] = rows[name]["draft_ms_per_round"] / (
            rows[name]["draft_ms_per_round"] + rows[name]["verify_ms_per_round"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"prepacked": not args.no_prepack, "threads": args.threads,
                                          "num_prompts": len(prompts), "rows": rows}, indent=2))
    print("| drafter | rounds | τ (batch 1, full block) | draft ms / round | verify ms / round | draft share |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['rounds']} | {r['tau']:.2f} | {r['draft_ms_per_round']:.1f} | "
              f"{r['verify_ms_per_round']:.1f} | {r['draft_share_of_round']:.0%} |")


if __name__ == "__main__":
    main()
