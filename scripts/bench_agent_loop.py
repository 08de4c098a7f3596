"""Agent-loop benchmark: a scripted multi-turn tool-calling agent on the embedded SmolLM2-135M-Instruct target.

The motivating workload: an agent answers each user turn with ~4 short generations, so per-turn latency is what a
user feels. Each scripted turn runs, on the growing conversation:

    1. plan       the agent says what it will do
    2. tool call  one JSON object {"tool": ..., "arguments": {...}}
    3. read       a canned tool result is added as a `tool` message; the agent states what it learned
    4. answer     the reply to the user

Both arms (plain greedy ``generate`` and ``generate(..., assistant_model=draft)``) run every generation on the same
history, back to back, alternating which goes first; their outputs are asserted token-identical, so the two
histories never diverge (``--allow-mismatch`` records a differing output instead, e.g. on 8-bit targets, and both
arms continue on the plain reply). Reported: end-to-end turn latency (the four calls, templating included) per arm, per-step
latency, τ and speedup, as a table and as JSON (``--out``/agent_loop.json, also printed).

    python scripts/bench_agent_loop.py --drafter runs/smollm2-dspark/drafter --turns 8 --out runs/bench_agent_loop
    python scripts/bench_agent_loop.py --turns 1                      # smoke run (untrained drafter if none ships)
    python scripts/bench_agent_loop.py --drafter ... --quantize 8bit  # bitsandbytes target (CPU works)
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from hf_dspark.evaluation.agent_script import (INSTRUCTIONS, STEPS, SYSTEM_PROMPT, TURNS,  # noqa: F401 (re-exported)
                                               ScriptedTurn, step_message)
from hf_dspark.generation.chat import ChatSession
from hf_dspark.loading import load_drafter, load_target

logger = logging.getLogger("bench_agent_loop")


def step_messages(session: ChatSession, step: str, turn: ScriptedTurn) -> None:
    """The message an agent loop adds before generating ``step`` (the script lives in the package:
    ``hf_dspark.evaluation.agent_script``)."""
    session.add_message(**step_message(step, turn))


def timed_reply(session: ChatSession, max_new_tokens: int):
    session.max_new_tokens = max_new_tokens
    start = time.perf_counter()
    reply = session.reply()
    return reply, time.perf_counter() - start


def run_step(plain: ChatSession, spec: ChatSession, step: str, turn: ScriptedTurn, spec_first: bool,
             allow_mismatch: bool = False) -> dict:
    """One generation in both arms on identical histories; asserts identical greedy output (with
    ``allow_mismatch``: records where the outputs part and continues both arms on the plain reply, so the
    histories stay identical and the timings comparable)."""
    for session in (plain, spec):
        step_messages(session, step, turn)
    max_new = STEPS[step]
    order = [("dspark", spec), ("plain", plain)] if spec_first else [("plain", plain), ("dspark", spec)]
    results = {name: timed_reply(session, max_new) for name, session in order}
    (plain_reply, plain_s), (spec_reply, spec_s) = results["plain"], results["dspark"]
    identical = spec_reply.token_ids == plain_reply.token_ids
    first_difference = None
    if not identical:
        if not allow_mismatch:
            raise AssertionError(f"step {step!r}: speculative greedy output differs from plain greedy:\n"
                                 f"plain:  {plain_reply.text!r}\ndspark: {spec_reply.text!r}")
        pairs = zip(plain_reply.token_ids, spec_reply.token_ids)
        first_difference = next((i for i, (a, b) in enumerate(pairs) if a != b),
                                min(len(plain_reply.token_ids), len(spec_reply.token_ids)))
        logger.warning("step %r: outputs part at token %d (plain %r, dspark %r); continuing on the plain reply",
                       step, first_difference, plain_reply.text, spec_reply.text)
        spec.messages[-1] = dict(plain.messages[-1])
    stats = spec_reply.stats
    return {"step": step, "identical": identical, "first_difference": first_difference,
            "tokens": plain_reply.num_tokens, "plain_s": plain_s, "dspark_s": spec_s,
            "rounds": stats.rounds, "committed": stats.committed_tokens, "text": plain_reply.text,
            "json_valid": _is_json(plain_reply.text) if step == "tool_call" else None}


def _is_json(text: str) -> bool:
    try:
        json.loads(text.strip().strip("`").removeprefix("json").strip())
        return True
    except json.JSONDecodeError:
        return False


def summarize(rows: list[dict]) -> dict:
    plain_s, spec_s = sum(r["plain_s"] for r in rows), sum(r["dspark_s"] for r in rows)
    rounds, committed = sum(r["rounds"] for r in rows), sum(r["committed"] for r in rows)
    return {"plain_s": plain_s, "dspark_s": spec_s, "speedup": plain_s / spec_s if spec_s else float("nan"),
            "tau": committed / rounds if rounds else float("nan"), "tokens": sum(r["tokens"] for r in rows),
            "generations": len(rows)}


def print_tables(turns: list[dict], steps: dict[str, dict], total: dict) -> None:
    print(f"\n{'turn':>4} | {'plain s':>8} | {'dspark s':>8} | {'speedup':>7} | {'tau':>5} | {'tokens':>6}")
    print("-" * 52)
    for t in turns:
        s = t["summary"]
        print(f"{t['turn']:>4} | {s['plain_s']:8.2f} | {s['dspark_s']:8.2f} | {s['speedup']:6.2f}x | "
              f"{s['tau']:5.2f} | {s['tokens']:>6}")
    print("-" * 52)
    print(f"{'all':>4} | {total['plain_s']:8.2f} | {total['dspark_s']:8.2f} | {total['speedup']:6.2f}x | "
          f"{total['tau']:5.2f} | {total['tokens']:>6}")
    print(f"\n{'step':>9} | {'plain s/call':>12} | {'dspark s/call':>13} | {'speedup':>7} | {'tau':>5}")
    for name, s in steps.items():
        calls = s["generations"]
        print(f"{name:>9} | {s['plain_s'] / calls:12.3f} | {s['dspark_s'] / calls:13.3f} | {s['speedup']:6.2f}x | "
              f"{s['tau']:5.2f}")
    turn_plain = [t["summary"]["plain_s"] for t in turns]
    turn_spec = [t["summary"]["dspark_s"] for t in turns]
    print(f"\nmedian turn latency: plain {statistics.median(turn_plain):.2f} s, "
          f"dspark {statistics.median(turn_spec):.2f} s")


def warm_up(target, tokenizer, drafter) -> None:
    ids = tokenizer("Hello", return_tensors="pt")["input_ids"]
    for extra in ({}, {"assistant_model": drafter}):
        target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                        pad_token_id=tokenizer.eos_token_id, **extra)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default=None, help="drafter dir / Hub id (default: the shipped one, else UNTRAINED)")
    p.add_argument("--target", default=None, help="target dir / Hub id (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--turns", type=int, default=len(TURNS), help=f"user turns, 1..{len(TURNS)} (default: all)")
    p.add_argument("--quantize", default="none", choices=["none", "8bit", "4bit"], help="bitsandbytes target")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--out", default="runs/bench_agent_loop", help="directory for agent_loop.json")
    p.add_argument("--allow-mismatch", action="store_true",
                   help="record (instead of stopping at) greedy outputs that differ, e.g. on 8-bit targets whose "
                        "kernels round a 1-token and a multi-token forward differently")
    args = p.parse_args(argv)
    if not 1 <= args.turns <= len(TURNS):
        p.error(f"--turns must be in 1..{len(TURNS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target, args.dtype, quantize=args.quantize)
    loaded = load_drafter(args.drafter, target)
    drafter = loaded.model
    warm_up(target, tokenizer, drafter)
    plain = ChatSession(target, tokenizer, None, system_prompt=SYSTEM_PROMPT)
    spec = ChatSession(target, tokenizer, drafter, system_prompt=SYSTEM_PROMPT)
    turns, all_rows = [], []
    for index, turn in enumerate(TURNS[:args.turns]):
        rows = [run_step(plain, spec, step, turn, spec_first=(index + k) % 2 == 1, allow_mismatch=args.allow_mismatch)
                for k, step in enumerate(STEPS)]
        turns.append({"turn": index + 1, "user": turn.user, "steps": rows, "summary": summarize(rows)})
        all_rows += rows
        logger.warning("turn %d: plain %.2f s, dspark %.2f s", index + 1, turns[-1]["summary"]["plain_s"],
                       turns[-1]["summary"]["dspark_s"])
    steps = {name: summarize([r for r in all_rows if r["step"] == name]) for name in STEPS}
    total = summarize(all_rows)
    print_tables(turns, steps, total)
    report = {"config": {"drafter": loaded.source,
                         "target": args.target or "embedded SmolLM2",
                         "quantize": args.quantize, "dtype": args.dtype, "turns": args.turns,
                         "threads": torch.get_num_threads(),
                         "greedy_identical": all(r["identical"] for r in all_rows),
                         "identical_generations": sum(r["identical"] for r in all_rows)},
              "total": total, "steps": steps, "turns": turns}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "agent_loop.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({"total": total, "steps": steps}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
