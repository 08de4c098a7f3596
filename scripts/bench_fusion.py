"""The lookup proposer fused with the drafter against its peers, side by side in one process (issue #16).

Arms, every generation run by each of them in rotating order on the same input:

    plain          target.generate (greedy or sampling)
    prompt lookup  transformers' built-in prompt lookup (prompt_lookup_num_tokens=10)
    lookup only    hf-dspark, lookup proposals only (dspark_lookup="only": the drafter never runs)
    DSpark only    hf-dspark, drafter only (dspark_lookup=False), cost-aware scheduler
    fused          hf-dspark default: lookup + drafter under the cost-aware scheduler

and, on request (``--arms``): "plain, skinny linears" / "prompt lookup, skinny linears" (the peers with the CPU
kernels hf-dspark's loop uses, ``hf_dspark.cpu_kernels.loop_kernels``: what is speculation and what is the
kernel), "fused, stock linears" (``dspark_cpu_linears=False``), "no proposals", "fused, no prefix cache" and the
engine arms. ``--compare-drafter DIR`` runs every drafter arm a second time with another drafter ("fused, compared
drafter", ...), interleaved with the rest: a new drafter against the shipped one on the same inputs.

Workloads: the benchmark prompts (gsm8k, math500, humaneval, mbpp, mt-bench turn 1, and mt-bench turn 2, which
re-reads the turn-1 answer plain greedy wrote), the fixed held-out prompts no recipe trains on (``data/heldout``:
hand-written chat and code requests, ``--heldout N`` of each) and the multi-turn tool-calling agent loop of
``bench_agent_loop.py`` (4 generations per user turn on the growing conversation; every arm continues on plain's
reply, so all arms see identical histories). At T = 0 every output is checked token-identical to plain.

    python scripts/bench_fusion.py --per-category 3 --heldout 4 --max-new-tokens 96 --turns 8 --temperatures 0 1 \
        --out DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

import torch

from hf_dspark.cpu_kernels import loop_kernels
from hf_dspark.evaluation.agent_script import STEPS, ScriptedAgent
from hf_dspark.evaluation.benchmarks import default_eval_dir
from hf_dspark.evaluation.heldout import read_heldout
from hf_dspark.loading import load_drafter, load_target
from hf_dspark.serving import DSparkEngine
from hf_dspark.training.prompts import read_prompts

logger = logging.getLogger("bench_fusion")
CATEGORIES = ["gsm8k", "math500", "humaneval", "mbpp", "mt-bench"]
HELDOUT_DIR = Path(__file__).resolve().parents[1] / "data" / "heldout"


DEFAULT_ARMS = ("plain", "prompt lookup", "lookup only", "DSpark only", "fused")


def arms(drafter, names=DEFAULT_ARMS, compare=None) -> dict[str, dict]:
    """Each hf-dspark arm keeps its own lookup-history scope: an arm may reuse text of its own earlier calls (as a
    user's later requests would), never the answer another arm just produced for the same input. "no proposals"
    (hf-dspark's round with the "none" policy: every round one plain step) measures what the loop itself costs.
    A scope also keeps each call's caches for the scope's next call (the prefix cache); "fused, no prefix cache"
    turns that off, so the difference to "fused" is what re-prefilling the conversation costs."""
    every = {"plain": {}, "prompt lookup": {"prompt_lookup_num_tokens": 10},
             "lookup only": {"assistant_model": drafter, "dspark_lookup": "only", "dspark_cache_salt": "lookup"},
             "DSpark only": {"assistant_model": drafter, "dspark_lookup": False},
             "fused": {"assistant_model": drafter, "dspark_cache_salt": "fused"},
             "fused, no prefix cache": {"assistant_model": drafter, "dspark_cache_salt": "fused-nocache",
                                        "dspark_prefix_cache": False},
             "no proposals": {"assistant_model": drafter, "dspark_policy": "none", "dspark_lookup": False},
             # the CPU kernel of hf-dspark's loop given to the peers, and taken from hf-dspark
             "plain, skinny linears": {"skinny": True},
             "prompt lookup, skinny linears": {"prompt_lookup_num_tokens": 10, "skinny": True},
             "fused, stock linears": {"assistant_model": drafter, "dspark_cache_salt": "fused-stock",
                                      "dspark_cpu_linears": False},
             # the serving engine at one request in flight, on the same conversation (its own scope)
             "engine": {"engine": {"prefix_cache": True}, "cache_salt": "engine"},
             "engine, no prefix cache": {"engine": {"prefix_cache": False}, "cache_salt": "engine-nocache"}}
    unknown = set(names) - set(every)
    if unknown or not {"plain", "prompt lookup"} <= set(names):
        raise SystemExit(f"--arms: {sorted(unknown)} unknown; choose from {list(every)} (plain and prompt lookup "
                         "are the references every ratio needs)")
    chosen = {name: every[name] for name in names}
    if compare is not None:  # another drafter in the drafter arms, under salts of its own: it shares nothing
        for name in [n for n in names if every[n].get("assistant_model") is drafter]:
            chosen[f"{name}, compared drafter"] = {**every[name], "assistant_model": compare,
                                                   "dspark_cache_salt": f"{name}, compared drafter"}
    return chosen


def render(tokenizer, messages: list[dict]) -> torch.Tensor:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


class Runner:
    """Runs one input through every arm (rotating the order), records seconds, tokens, identity and stats."""

    def __init__(self, target, tokenizer, drafter, temperature: float, seed: int, arm_names=DEFAULT_ARMS,
                 compare=None):
        self.target, self.tokenizer, self.drafter = target, tokenizer, drafter
        self.arms = arms(drafter, arm_names, compare)
        self.engines = {}
        for name, spec in self.arms.items():
            if "engine" in spec:  # built (and its step cost measured) before anything is timed
                self.engines[name] = DSparkEngine(target, drafter, "scheduled", tokenizer=tokenizer,
                                                  max_running_requests=1, **spec["engine"])
                _ = self.engines[name].step_cost
        self.sampling = {"do_sample": False} if temperature == 0 else {"do_sample": True, "temperature": temperature}
        self.temperature, self.seed, self.calls = temperature, seed, 0
        self.records = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))  # workload -> arm -> field -> list

    def run(self, workload: str, messages: list[dict], max_new_tokens: int) -> list[int]:
        """Every arm on one conversation; returns plain's new tokens (what the conversation continues with)."""
        ids = render(self.tokenizer, messages)
        names = list(self.arms)
        shift = self.calls % len(names)
        self.calls += 1
        outputs = {}
        for name in names[shift:] + names[:shift]:
            torch.manual_seed(self.seed + self.calls)
            start = time.perf_counter()
            if name in self.engines:
                sampling = {} if self.temperature == 0 else {"do_sample": True, "temperature": self.temperature}
                new = self.engines[name].submit(ids[0].tolist(), max_new_tokens, cache_salt=self.arms[name][
                    "cache_salt"], **sampling).result().token_ids
                seconds = time.perf_counter() - start
            else:
                kwargs = {k: v for k, v in self.arms[name].items() if k != "skinny"}
                with loop_kernels(self.target) if self.arms[name].get("skinny") else nullcontext():
                    out = self.target.generate(ids, attention_mask=torch.ones_like(ids),
                                               max_new_tokens=max_new_tokens, pad_token_id=self.tokenizer.pad_token_id,
                                               **self.sampling, **kwargs)
                seconds = time.perf_counter() - start
                new = out[0, ids.shape[1]:].tolist()
            outputs[name] = new
            record = self.records[workload][name]
            record["seconds"].append(seconds)
            record["tokens"].append(len(new))
            if "assistant_model" in self.arms[name]:
                record["stats"].append(self.arms[name]["assistant_model"].stats)
        if self.temperature == 0:
            for name, new in outputs.items():
                self.records[workload][name]["identical"].append(new == outputs["plain"])
        return outputs["plain"]


def benchmark_workloads(runner: Runner, eval_dir: Path, per_category: int, max_new_tokens: int,
                        categories=CATEGORIES) -> None:
    for category in categories:
        prompts = read_prompts(eval_dir / f"{category}.jsonl")[:per_category]
        for prompt in prompts:
            first = [{"role": "user", "content": prompt.turns[0]}]
            name = "mt-bench turn 1" if category == "mt-bench" else category
            answer = runner.run(name, first, max_new_tokens)
            if category == "mt-bench" and len(prompt.turns) > 1:
                text = runner.tokenizer.decode(answer, skip_special_tokens=True)
                second = first + [{"role": "assistant", "content": text}, {"role": "user", "content": prompt.turns[1]}]
                runner.run("mt-bench turn 2", second, max_new_tokens)
            logger.info("%s: prompt done", name)


def heldout_workloads(runner: Runner, per_set: int, max_new_tokens: int) -> None:
    """Single-turn prompts from sources no recipe trains on: novel text, where the drafter, not lookup, must pay."""
    for name in ("chat", "code"):
        for prompt in read_heldout(HELDOUT_DIR / f"{name}.jsonl")[:per_set]:
            runner.run(f"held-out {name}", [{"role": "user", "content": prompt.text}], max_new_tokens)
        logger.info("held-out %s: done", name)


def agent_loop(runner: Runner, num_turns: int) -> None:
    agent = ScriptedAgent(num_turns)
    while not agent.done:
        messages, max_new = agent.next_request()
        reply = runner.run("agent loop", messages, max_new)
        agent.reply(runner.tokenizer.decode(reply, skip_special_tokens=True))
        if agent.generation % len(STEPS) == 0:
            logger.info("agent loop: turn done (%d messages)", len(agent.messages))


def summarize(records: dict, temperature: float) -> list[dict]:
    rows = []
    for workload, per_arm in records.items():
        plain_tps = sum(per_arm["plain"]["tokens"]) / sum(per_arm["plain"]["seconds"])
        lookup_tps = sum(per_arm["prompt lookup"]["tokens"]) / sum(per_arm["prompt lookup"]["seconds"])
        for arm, record in per_arm.items():
            tps = sum(record["tokens"]) / sum(record["seconds"])
            row = {"T": temperature, "workload": workload, "arm": arm, "tok_s": tps, "x_plain": tps / plain_tps,
                   "x_best_peer": tps / max(plain_tps, lookup_tps), "generations": len(record["tokens"]),
                   "tokens": sum(record["tokens"]), "seconds": sum(record["seconds"]),
                   "identical": all(record["identical"]) if record.get("identical") else None}
            if record.get("stats"):
                merged = record["stats"][0]
                for stats in record["stats"][1:]:
                    merged = merged.merge(stats)
                row["tau"] = merged.tau
                row["by_source"] = {name: {"rounds": child.rounds, "tau": child.tau,
                                           "acceptance": child.acceptance_rate}
                                    for name, child in merged.by_source.items()}
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| T | workload | arm | tok/s | × plain | × max(plain, prompt lookup) | τ | rounds: lookup / drafter / plain "
             "| greedy identical |", "|---" * 9 + "|"]
    for r in rows:
        src = r.get("by_source", {})
        split = " / ".join(str(src.get(k, {}).get("rounds", 0)) for k in ("lookup", "drafter", "none")) if src else "–"
        same = {True: "yes", False: "NO", None: "–"}[r["identical"]]
        lines.append(f"| {r['T']:g} | {r['workload']} | {r['arm']} | {r['tok_s']:.1f} | {r['x_plain']:.2f} | "
                     f"{r['x_best_peer']:.2f} | {r.get('tau', float('nan')):.2f} | {split} | {same} |")
    return "\n".join(lines)


def ratio_lines(rows: list[dict]) -> list[str]:
    """Geometric mean (range) over workloads of the ratios a drafter A/B is judged by: each hf-dspark arm against
    itself with the compared drafter, and fused against lookup only (what the drafter adds on this text)."""
    pairs = [(arm, f"{arm}, compared drafter") for arm in ("fused", "DSpark only", "lookup only")]
    pairs += [("fused", "lookup only"), ("fused, compared drafter", "lookup only, compared drafter")]
    lines = []
    for temperature in sorted({r["T"] for r in rows}):
        speed = {(r["workload"], r["arm"]): r["tok_s"] for r in rows if r["T"] == temperature}
        for top, bottom in pairs:
            ratios = [speed[w, top] / speed[w, bottom] for w, arm in speed if arm == top and (w, bottom) in speed]
            if ratios:
                mean = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
                spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
                count = f"{len(ratios)} workload" + "s" * (len(ratios) != 1)
                lines.append(f"T = {temperature:g}: {top} ÷ {bottom}: {mean:.3f} ({spread}) over {count}")
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target directory (default: the embedded SmolLM2)")
    p.add_argument("--drafter", default=None, help="drafter directory (default: the shipped one)")
    p.add_argument("--per-category", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--heldout", type=int, default=0, help="prompts of each held-out set (data/heldout); 0 = skip")
    p.add_argument("--turns", type=int, default=8, help="agent-loop user turns (4 generations each); 0 = skip")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0])
    p.add_argument("--skip-benchmarks", action="store_true")
    p.add_argument("--categories", nargs="+", default=CATEGORIES, choices=CATEGORIES,
                   help="benchmark categories to run (default: all)")
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS),
                   help=f"arms to run (default: {', '.join(DEFAULT_ARMS)}; also: no proposals, "
                        "fused, no prefix cache, plain, skinny linears, prompt lookup, skinny linears, fused, stock "
                        "linears, engine, engine, no prefix cache)")
    p.add_argument("--compare-drafter", default=None,
                   help="a second drafter directory: every drafter arm also runs with it (\"<arm>, compared "
                        "drafter\"), interleaved, e.g. the previously shipped drafter against a new one")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("hf_dspark").setLevel(logging.WARNING)  # one stats line per generate call would flood
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target)
    drafter = load_drafter(args.drafter, target).model
    compare = load_drafter(args.compare_drafter, target).model if args.compare_drafter else None
    eval_dir = default_eval_dir()
    warm = render(tokenizer, [{"role": "user", "content": "Say hello."}])
    for extra in arms(drafter, args.arms, compare).values():  # one-off costs (the step-cost profile, kernels) are not timed
        if "engine" in extra:
            continue  # the Runner builds the engines and measures their step cost before timing
        kwargs = {k: v for k, v in extra.items() if k != "skinny"}
        with loop_kernels(target) if extra.get("skinny") else nullcontext():
            target.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=8, do_sample=False, **kwargs)
    rows = []
    for temperature in args.temperatures:
        runner = Runner(target, tokenizer, drafter, temperature, args.seed, args.arms, compare)
        if not args.skip_benchmarks:
            benchmark_workloads(runner, eval_dir, args.per_category, args.max_new_tokens, args.categories)
        if args.heldout:
            heldout_workloads(runner, args.heldout, args.max_new_tokens)
        if args.turns:
            agent_loop(runner, args.turns)
        rows += summarize(runner.records, temperature)
        print(table([r for r in rows if r["T"] == temperature]), flush=True)
    ratios = ratio_lines(rows)
    print("\n".join(ratios))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_fusion.json").write_text(json.dumps(rows, indent=1))
        summary = "\n".join(f"- {line}" for line in ratios)
        (out / "bench_fusion.md").write_text(table(rows) + "\n\n" + summary + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
