"""Agent loops side by side with default arguments: plain, plain with hf-dspark's CPU kernels, transformers' prompt
lookup, hf-dspark lookup only, drafter only, and hf-dspark as a drop-in user gets it (issue #41).

Workloads (``hf_dspark.evaluation.agent_bench``): held-out tool-calling scenarios (a JSON call turn and a short
answer turn per tool, 15-60 tokens) and the project's longer scripted agent turns. Every arm runs every generation
on the same conversation in rotating order; outputs are checked token-identical to plain. ``--repeats`` starts every
arm from nothing each time; the table gives the median and each repeat. Pause background jobs while it runs.

    python scripts/bench_agent_loop.py --repeats 3 --long-turns 2 --out runs/bench_agent_loop
    python scripts/bench_agent_loop.py --first-call --repeats 3     # a fresh process's first call, per arm

``--first-call`` starts one fresh process per arm and repeat (interleaved) and times its first generate call of a
tool-call turn: what a script that calls generate once pays, profiling and caches included.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from hf_dspark.evaluation.agent_bench import DEFAULT_ARMS, TOOL_SCENARIOS, Arm, generate_ids, prepare_arms, \
    run_workloads, summarize, table
from hf_dspark.loading import load_drafter, load_target

logger = logging.getLogger("bench_agent_loop")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default=None, help="drafter dir (default: the shipped one)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--long-turns", type=int, default=2, help="user turns of the longer script (4 calls each; 0: none)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/bench_agent_loop")
    p.add_argument("--first-call", action="store_true", help="time a fresh process's first call per arm instead")
    p.add_argument("--one-first-call", default=None, help=argparse.SUPPRESS)  # the child process of --first-call
    return p.parse_args(argv)


def first_call(arm_name: str, drafter_path: str | None) -> dict:
    """In this (fresh) process: load, then time the first call of the first tool-call turn."""
    target, tokenizer = load_target()
    drafter = load_drafter(drafter_path, target).model
    (arm,) = prepare_arms(target, drafter, [a for a in DEFAULT_ARMS if a.name == arm_name])
    scenario = TOOL_SCENARIOS[0]
    messages = [{"role": "system", "content": scenario.system},
                {"role": "user", "content": scenario.uses[0].request + " Call the right tool now. Reply with only "
                                                                       "the JSON object."}]
    ids, seconds = generate_ids(arm, tokenizer, messages, 40)
    return {"arm": arm_name, "seconds": seconds, "tokens": len(ids)}


def first_calls(args) -> dict:
    names = [a.name for a in DEFAULT_ARMS]
    results = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            command = [sys.executable, __file__, "--one-first-call", name, "--threads", str(args.threads)]
            command += ["--drafter", args.drafter] if args.drafter else []
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            results[name].append(json.loads(out.strip().splitlines()[-1])["seconds"])
    return {name: {"seconds": s, "median_s": statistics.median(s)} for name, s in results.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    if args.one_first_call:
        print(json.dumps(first_call(args.one_first_call, args.drafter)))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.first_call:
        report = first_calls(args)
        plain = report["plain"]["median_s"]
        print("| arm | first call s (median) | repeats | × plain |\n|---|---|---|---|")
        for name, r in report.items():
            print(f"| {name} | {r['median_s']:.2f} | {' / '.join(f'{s:.2f}' for s in r['seconds'])} | "
                  f"{plain / r['median_s']:.2f} |")
        (out / "first_call.json").write_text(json.dumps(report, indent=2))
        return 0
    target, tokenizer = load_target()
    loaded = load_drafter(args.drafter, target)
    warm = prepare_arms(target, loaded.model, [Arm("warm-up", {"assistant_model": True})])[0]
    generate_ids(warm, tokenizer, [{"role": "user", "content": "Hello"}], 8)  # loads kernels, the step-cost table
    repeats = []
    for repeat in range(args.repeats):
        start = time.perf_counter()
        repeats.append(run_workloads(target, tokenizer, loaded.model, long_turns=args.long_turns, repeat=repeat))
        logger.warning("repeat %d done in %.0f s", repeat + 1, time.perf_counter() - start)
    summary = summarize(repeats, [a.name for a in DEFAULT_ARMS])
    print(table(summary))
    report = {"config": {"drafter": loaded.source, "threads": args.threads, "repeats": args.repeats,
                         "long_turns": args.long_turns, "torch": torch.__version__},
              "summary": summary, "repeats": repeats}
    (out / "agent_loop.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
