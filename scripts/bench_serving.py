"""Serving benchmark (paper Figs. 7-8): DSparkEngine throughput vs per-user speed under closed-loop load.

For each concurrency C, every policy serves the same request stream with C requests always in flight (a finished
request is replaced at once): engine throughput (generated tok/s over the run), per-user tok/s (each request's
decoding speed after its first token, averaged), TTFT, mean verify budget (drafts verified per request per
step), τ and wasted verify tokens. Policies are interleaved within each concurrency level so the noise of a
shared machine hits them alike. Target: the embedded SmolLM2-135M-Instruct; drafter: the packaged default
drafter, else ``--drafter PATH``, else an UNTRAINED one (then the numbers show overhead only, and say so).

Smoke (< 2 min):
    python scripts/bench_serving.py --concurrency 1,2 --max-prompts 2 --max-new-tokens 16 --min-requests 2 \
        --requests-factor 1 --out runs/bench_serving_smoke
Full:
    python scripts/bench_serving.py --out runs/bench_serving
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import time
from pathlib import Path

import torch

from hf_dspark import DSparkDraftModel, load_default_target
from hf_dspark.evaluation.plots import plot_throughput_frontier
from hf_dspark.serving import DSparkEngine, profile_step_cost
from hf_dspark.training.prompts import read_prompts

BENCHMARKS = ("gsm8k", "humaneval", "mt-bench")
DEFAULT_POLICIES = "none,fixed1,fixed3,fixed7,threshold,scheduled"
logger = logging.getLogger("bench_serving")


def parse_policy(label: str, threshold: float) -> tuple[str, dict]:
    """"none", "fixedN" (verify N drafts), "fixed" (all), "threshold", "scheduled", "scheduled-async"."""
    match = re.fullmatch(r"fixed(\d+)", label)
    if match:
        return "fixed", {"num_tokens": int(match.group(1))}
    if label == "threshold":
        return "threshold", {"threshold": threshold}
    return label, {}


def load_prompts(tokenizer, eval_dir: Path, per_benchmark: int, max_prompts: int | None,
                 max_prompt_tokens: int) -> list[tuple[str, list[int]]]:
    """First turns, chat-templated, interleaved across benchmarks (gsm8k, humaneval, mt-bench, gsm8k, ...)."""
    per_name = {}
    for name in BENCHMARKS:
        rows = []
        for prompt in read_prompts(eval_dir / f"{name}.jsonl"):
            encoded = tokenizer.apply_chat_template([{"role": "user", "content": prompt.first_turn}],
                                                    add_generation_prompt=True, tokenize=True)
            ids = list(encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded)
            if len(ids) <= max_prompt_tokens:
                rows.append((name, ids))
            if len(rows) == per_benchmark:
                break
        per_name[name] = rows
    mixed = [row for group in zip(*per_name.values()) for row in group]
    return mixed[:max_prompts] if max_prompts else mixed


def load_drafter(path: str | None, target) -> tuple[DSparkDraftModel, str, bool]:
    if path:
        return DSparkDraftModel.from_pretrained(path, target=target).eval(), path, True
    try:
        from hf_dspark import load_default_drafter

        return load_default_drafter(target), "default packaged drafter", True
    except (ImportError, FileNotFoundError) as err:
        logger.warning("no trained drafter (%s): using an UNTRAINED drafter, numbers show overhead only", err)
        torch.manual_seed(0)
        return DSparkDraftModel.from_target(target).eval(), "UNTRAINED DSparkDraftModel.from_target (overhead only)", False


def run_level(engine: DSparkEngine, prompts: list[tuple[str, list[int]]], concurrency: int, num_requests: int,
              max_new_tokens: int, sampling: dict) -> dict:
    """Closed loop: keep ``concurrency`` requests in flight until ``num_requests`` have been served."""
    inflight, outputs, submitted = [], [], 0
    start = time.perf_counter()
    while submitted < num_requests or inflight:
        while len(inflight) < concurrency and submitted < num_requests:
            name, ids = prompts[submitted % len(prompts)]
            inflight.append((submitted, name, engine.submit(ids, max_new_tokens, **sampling)))
            submitted += 1
        engine.step()
        still = []
        for index, name, handle in inflight:
            if handle.done():
                outputs.append((index, name, handle.result()))
            else:
                still.append((index, name, handle))
        inflight = still
    wall = time.perf_counter() - start
    m = engine.metrics()
    tokens = sum(len(out.token_ids) for _, _, out in outputs)
    per_user = [out.metrics["tokens_per_second"] for _, _, out in outputs if out.metrics["tokens_per_second"]]
    ttft = [out.metrics["ttft_s"] for _, _, out in outputs if out.metrics["ttft_s"] is not None]
    return {
        "concurrency": concurrency, "num_requests": len(outputs), "generated_tokens": tokens, "wall_s": wall,
        "throughput": tokens / wall, "per_user_tps": sum(per_user) / len(per_user) if per_user else None,
        "mean_ttft_s": sum(ttft) / len(ttft) if ttft else None, "mean_verify_budget": m["mean_verify_budget"],
        "mean_verify_tokens": m["mean_verify_tokens"], "mean_batch_size": m["mean_batch_size"], "tau": m["tau"],
        "acceptance_rate": m["acceptance_rate"], "wasted_verify_tokens": m["wasted_verify_tokens"],
        "padding_tokens": m["padding_tokens"], "draft_s": m["draft_s"], "verify_s": m["verify_s"],
        "prefill_s": m["prefill_s"], "compactions": m["compactions"], "decode_steps": m["decode_steps"],
        "skipped_draft_steps": m["skipped_draft_steps"],
        "outputs": {index: out.token_ids for index, _, out in outputs},
    }


def median_over_repeats(results: list[dict]) -> list[dict]:
    """One record per (concurrency, policy): the median of every numeric field over the repeats (the machine is
    shared; a single run per cell is too noisy to rank policies that differ by a few percent)."""
    groups: dict[tuple[int, str], list[dict]] = {}
    for record in results:
        groups.setdefault((record["concurrency"], record["policy"]), []).append(record)
    summary = []
    for (concurrency, policy), records in groups.items():
        merged = {"concurrency": concurrency, "policy": policy, "repeats": len(records)}
        for key, value in records[0].items():
            values = [r.get(key) for r in records]
            if key not in merged and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                merged[key] = statistics.median(values)
        merged["throughput_runs"] = [r["throughput"] for r in records]
        summary.append(merged)
    return summary


def print_summary(summary: list[dict], policies: list[str], levels: list[int]) -> None:
    by_cell = {(r["concurrency"], r["policy"]): r for r in summary}
    print("\nmedian throughput tok/s (per-user tok/s) over repeats")
    print("C    | " + " | ".join(f"{p:>16s}" for p in policies))
    for concurrency in levels:
        cells = []
        for policy in policies:
            r = by_cell.get((concurrency, policy))
            cells.append(f"{r['throughput']:7.1f} ({r['per_user_tps'] or 0:5.1f})" if r else " " * 16)
        print(f"{concurrency:<4d} | " + " | ".join(f"{c:>16s}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", help="trained drafter dir (default: hf_dspark.load_default_drafter, else untrained)")
    parser.add_argument("--eval-dir", default=str(Path(__file__).resolve().parents[1].parent / "shared" / "eval_datasets"))
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    parser.add_argument("--policies", default=DEFAULT_POLICIES, help="comma list: none, fixedN, fixed, threshold, "
                        "scheduled, scheduled-async")
    parser.add_argument("--threshold", type=float, default=0.5, help="confidence threshold of the threshold policy")
    parser.add_argument("--prompts-per-benchmark", type=int, default=8)
    parser.add_argument("--max-prompts", type=int, default=None, help="cap on the total number of distinct prompts")
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--requests-factor", type=float, default=2.0, help="requests per level = factor × C ...")
    parser.add_argument("--min-requests", type=int, default=8, help="... but at least this many")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="runs per (concurrency, policy), order rotated; "
                        "the summary, table and plot use medians")
    parser.add_argument("--prepack", action="store_true", help="oneDNN-prepacked linears (hf_dspark.cpu_kernels)")
    parser.add_argument("--sps-repeats", type=int, default=3, help="timed repeats per step-cost grid point")
    parser.add_argument("--max-prefill-tokens", type=int, default=2048)
    parser.add_argument("--out", default="runs/bench_serving")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    target, tokenizer = load_default_target()
    sps_cache_dir = None
    if args.prepack:
        from hf_dspark.cpu_kernels import prepack_linears

        target = prepack_linears(target)
        sps_cache_dir = str(out_dir / "sps_prepacked")  # same config, different speed: keep its own SPS cache
    drafter, drafter_name, trained = load_drafter(args.drafter, target)
    gamma = drafter.config.block_size
    levels = [int(c) for c in args.concurrency.split(",")]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    prompts = load_prompts(tokenizer, Path(args.eval_dir), args.prompts_per_benchmark, args.max_prompts,
                           args.max_prompt_tokens)
    sampling = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {}
    print(f"target SmolLM2-135M-Instruct, drafter: {drafter_name}; {len(prompts)} prompts, policies {policies}, "
          f"concurrency {levels}", flush=True)

    # the engine's real step on this machine: drafter pass for R requests + padded verify of R rows × W tokens
    sps = profile_step_cost(target, drafter, max_rows=max(levels), max_width=1 + gamma, repeats=args.sps_repeats,
                            cache_dir=sps_cache_dir)
    slots = max(len(ids) for _, ids in prompts) + args.max_new_tokens + gamma + 1
    DSparkEngine(target, drafter, "fixed", sps=sps).generate([prompts[0][1]], 4)  # warm-up, not measured

    results = []
    for concurrency in levels:
        num_requests = max(args.min_requests, round(args.requests_factor * concurrency))
        reference = None
        for repeat in range(args.repeats):
            # rotate the order each repeat, so no policy always runs first (or right after a warm cache)
            shift = repeat % len(policies)
            for label in policies[shift:] + policies[:shift]:
                name, kwargs = parse_policy(label, args.threshold)
                engine = DSparkEngine(target, drafter if name != "none" else None, name, policy_kwargs=kwargs,
                                      sps=sps, max_running_requests=concurrency, max_batch_tokens=concurrency * slots,
                                      max_prefill_tokens=args.max_prefill_tokens, tokenizer=tokenizer)
                record = run_level(engine, prompts, concurrency, num_requests, args.max_new_tokens, sampling)
                outputs = record.pop("outputs")
                if reference is None:
                    reference = outputs
                elif not sampling:  # greedy: report how often the batched outputs equal the first run's
                    same = sum(outputs[i] == reference[i] for i in reference)
                    record["greedy_agreement"] = same / len(reference)
                record["policy"], record["repeat"] = label, repeat
                results.append(record)
                print(f"C={concurrency:3d} {label:>16s} #{repeat}: {record['throughput']:7.1f} tok/s, per-user "
                      f"{record['per_user_tps'] or 0:6.1f} tok/s, verify budget {record['mean_verify_budget']:.2f}, "
                      f"tau {record['tau']:.2f}, TTFT {record['mean_ttft_s'] or 0:.2f}s", flush=True)
    summary = median_over_repeats(results)
    print_summary(summary, policies, levels)

    report = {"target": "HuggingFaceTB/SmolLM2-135M-Instruct (embedded, fp32)", "drafter": drafter_name,
              "drafter_trained": trained, "block_size": gamma, "threads": args.threads, "prepack": args.prepack,
              "torch": torch.__version__, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
              "num_prompts": len(prompts), "repeats": args.repeats, "step_cost": sps.to_dict(),
              "summary": summary, "results": results}
    (out_dir / "results.json").write_text(json.dumps(report, indent=1))
    title = f"DSparkEngine on SmolLM2-135M ({'trained' if trained else 'UNTRAINED'} drafter, {args.threads} threads)"
    plot_throughput_frontier(summary, out_dir / "frontier.png", title=title)
    print(f"wrote {out_dir / 'results.json'} and {out_dir / 'frontier.png'}")


if __name__ == "__main__":
    main()
