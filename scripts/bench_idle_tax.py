"""What the engine pays for proposers it carries but does not use: closed loops of the embedded target where the
scheduled policy is told never to speculate, next to plain decoding, arms interleaved step by step.

Why: on a 2-core CPU at 16 rows speculation cannot pay (a verified token costs ~0.8 of a plain one there), so the
best any policy can do is plain decoding's speed; the fused engine measured ~3 % below it. This separates what is
lost to the decisions (learning rounds, probes, bets) from what is paid every step just for being ready to
speculate: the drafter's context (the prompt's and every committed token's target features projected into its
cache, the feature tap), the lookup proposer's index and proposals, the round's planning.

Arms (all ``DSparkEngine`` on the same target, same request stream, same clock discipline as ``serve-bench``):

* ``none`` and ``none (again)``: plain decoding twice (their difference is the noise floor of this run);
* ``drafter carried``: the drafter attached, lookup off, the policy never drafting;
* ``lookup carried``: no drafter, lookup on, proposals made every round but never verified;
* ``both carried``: drafter and lookup (the default engine), neither used.

    python scripts/bench_idle_tax.py --concurrency 16 --requests 32 --repeats 2 --out benchmarks/2026-12-02e/idle_tax
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path

import numpy as np
import torch

from hf_dspark.evaluation.serving_bench import ClosedLoop, run_interleaved, serving_prompts
from hf_dspark.speculation.shared_state import LONG_MATCH_TOKENS
from hf_dspark.loading import load_drafter, load_target
from hf_dspark.scheduling import ScheduledPolicy
from hf_dspark.serving import DSparkEngine

logger = logging.getLogger("bench_idle_tax")


class NeverSpeculate(ScheduledPolicy):
    """The scheduled policy with every proposal declined before anything is verified: the round still plans
    (lookup proposals, their confidences), taps the target and keeps the drafter context, as the default engine
    does on a step where nothing pays."""

    def wants_drafts(self, *args, **kwargs) -> bool:
        return False

    def plan_sources(self, lookup_confidences, *args, **kwargs):
        return np.zeros(np.asarray(lookup_confidences).shape[0], dtype=bool), False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32, help="requests per arm and repeat")
    parser.add_argument("--min-new-tokens", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_idle_tax"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(None)
    drafter = load_drafter(None, target).model
    prompts = serving_prompts(tokenizer, None, 4, None, 512)
    slots = (max(len(ids) for _, ids in prompts) + args.max_new_tokens
             + max(drafter.config.block_size, LONG_MATCH_TOKENS) + 1)
    limits = dict(max_running_requests=args.concurrency, max_batch_tokens=args.concurrency * slots,
                  max_prefill_tokens=2048, tokenizer=tokenizer)
    arms = {"none": lambda: DSparkEngine(target, None, "none", **limits),
            "none (again)": lambda: DSparkEngine(target, None, "none", **limits),
            "drafter carried": lambda: DSparkEngine(target, drafter, NeverSpeculate(), lookup=False, **limits),
            "lookup carried": lambda: DSparkEngine(target, None, NeverSpeculate(), lookup=True, **limits),
            "both carried": lambda: DSparkEngine(target, drafter, NeverSpeculate(), **limits)}
    DSparkEngine(target, drafter, "fixed", tokenizer=tokenizer).generate([prompts[0][1]], 4)  # warm-up
    records: dict[str, list[dict]] = {name: [] for name in arms}
    for repeat in range(args.repeats):
        engines = {name: make() for name, make in arms.items()}
        for engine in engines.values():
            if engine.policy.needs_step_cost:
                engine.profile_sps()  # cached: loaded (and spot-checked) before the clock starts
        loops = [ClosedLoop(engine, prompts, args.concurrency, args.requests, args.max_new_tokens, {},
                            min_new_tokens=args.min_new_tokens) for engine in engines.values()]
        for name, engine, record in zip(engines, engines.values(), run_interleaved(loops)):
            kinds = engine.engine_metrics.step_kinds
            record.update(repeat=repeat, arm=name,
                          decode_s=sum(kind["seconds"] for kind in kinds.values()),
                          decode_steps=sum(kind["steps"] for kind in kinds.values()))
            records[name].append(record)
            logger.warning("repeat %d %-16s %.2f tok/s, prefill %.2f s, decode %.2f s in %d steps", repeat, name,
                           record["throughput"], record["prefill_s"], record["decode_s"], record["decode_steps"])
    baseline = [statistics.mean(pair) for pair in zip(*(
        [r["throughput"] for r in records[name]] for name in ("none", "none (again)")))]
    lines = [f"C = {args.concurrency}, {args.requests} requests of {args.min_new_tokens}-{args.max_new_tokens} new "
             f"tokens, {args.repeats} repeats; × the mean of the two plain arms in the same repeat",
             "| arm | tok/s (median) | × plain, per repeat | prefill s (mean) | decode ms/step (mean) |",
             "|---|---|---|---|---|"]
    for name, runs in records.items():
        ratios = " / ".join(f"{r['throughput'] / b:.3f}" for r, b in zip(runs, baseline))
        lines.append(f"| {name} | {statistics.median(r['throughput'] for r in runs):.1f} | {ratios} | "
                     f"{statistics.mean(r['prefill_s'] for r in runs):.2f} | "
                     f"{1e3 * statistics.mean(r['decode_s'] / r['decode_steps'] for r in runs):.1f} |")
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(records, indent=1, default=str))
    (args.out / "table.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
