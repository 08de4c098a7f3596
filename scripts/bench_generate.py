"""Batch-1 generation benchmark on the embedded SmolLM2-135M-Instruct target (issue: generate drop-in).

Every configuration runs on the same prompts, interleaved prompt by prompt (round robin) so the noise of a
shared machine hits all of them alike; results are reported as ratios to plain ``generate`` measured in the
same run. Greedy speculative outputs are checked token for token against plain greedy of the same model.

    python scripts/bench_generate.py --drafter path/to/dspark [--dflash-drafter path] --per-benchmark 3 \
        --max-new-tokens 128 --out runs/bench_generate
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import random
import statistics
import time
from pathlib import Path

import torch

from hf_dspark import DSparkDraftModel, load_default_target
from hf_dspark.cpu_kernels import prepack_linears
from hf_dspark.training.prompts import read_prompts

BENCHMARKS = ("gsm8k", "humaneval", "mt-bench")


def load_prompts(eval_dir: Path, per_benchmark: int, seed: int) -> list[tuple[str, str]]:
    prompts = []
    for name in BENCHMARKS:
        rows = read_prompts(eval_dir / f"{name}.jsonl")
        random.Random(seed).shuffle(rows)
        prompts += [(name, p.first_turn) for p in rows[:per_benchmark]]
    return prompts


def load_heldout_prompts(path: Path, num: int) -> list[tuple[str, str]]:
    """The last ``num`` records of a training-data jsonl: the held-out conversations, for choosing settings
    (e.g. the confidence threshold) on data the benchmarks do not contain."""
    return [(p.category or "heldout", p.first_turn) for p in read_prompts(path)[-num:]]


def load_drafter(path: str | None, target, head: str):
    if path:
        return DSparkDraftModel.from_pretrained(path, target=target).eval(), f"{head} ({path})"
    torch.manual_seed(0)
    return DSparkDraftModel.from_target(target, head=head).eval(), f"{head} (UNTRAINED: shows overhead only)"


def prepacked_copy(drafter, packed_target):
    """The drafter bound to the prepacked target, its own linears prepacked too (the original stays as it is)."""
    copy_ = type(drafter)(drafter.config).eval()  # the same class: a block drafter or an Eagle3 one
    copy_.load_state_dict(drafter.state_dict())
    return prepack_linears(copy_.bind_target(packed_target))


def timed_generate(model, ids, **kwargs):
    start = time.perf_counter()
    out = model.generate(ids, **kwargs)
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", help="trained DSpark drafter dir (default: hf_dspark.load_default_drafter)")
    parser.add_argument("--dflash-drafter", help="trained DFlash drafter dir, for the DSpark/DFlash comparison")
    parser.add_argument("--eval-dir", default=str(Path(__file__).resolve().parents[1].parent / "shared" / "eval_datasets"))
    parser.add_argument("--per-benchmark", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-bf16", action="store_true")
    parser.add_argument("--thresholds", default="",
                        help="comma list: also run hf-dspark (prepacked) with dspark_confidence_threshold=each")
    parser.add_argument("--unpacked-thresholds", default="",
                        help="comma list: also run hf-dspark on the stock (not prepacked) fp32 target with "
                             "dspark_confidence_threshold=each")
    parser.add_argument("--compare-drafter", default=None,
                        help="a second DSpark drafter dir, run prepacked side by side (at its own threshold and at "
                             "each of --compare-thresholds), e.g. the shipped drafter against a new one")
    parser.add_argument("--compare-thresholds", default="", help="comma list for --compare-drafter")
    parser.add_argument("--num-tokens", default="",
                        help="comma list: also run hf-dspark (prepacked) with dspark_num_tokens=each (fixed γ)")
    parser.add_argument("--prompts", default=None, help="jsonl of held-out records to use instead of --eval-dir "
                        "(the last --num-prompts records)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prepacked-only", action="store_true",
                        help="only the prepacked plain / hf-dspark configurations (and threshold / γ variants)")
    parser.add_argument("--out", default="runs/bench_generate")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)

    target, tok = load_default_target()
    packed = prepack_linears(copy.deepcopy(target))
    bf16 = None if args.skip_bf16 or args.prepacked_only else copy.deepcopy(target).to(torch.bfloat16)
    drafter_path = args.drafter
    if drafter_path is None:
        try:
            from hf_dspark import load_default_drafter

            drafter, drafter_name = load_default_drafter(target).eval(), "dspark (default drafter)"
        except (ImportError, FileNotFoundError):
            drafter, drafter_name = load_drafter(None, target, "markov")
    else:
        drafter, drafter_name = load_drafter(drafter_path, target, "markov")
    packed_drafter = prepacked_copy(drafter, packed)
    other = prepacked_copy(load_drafter(args.compare_drafter, target, "markov")[0], packed) if (
        args.compare_drafter) else None
    dflash = load_drafter(args.dflash_drafter, target, "none")[0] if args.dflash_drafter else None

    configs = {  # name -> (model, generate kwargs, baseline name)
        "plain fp32": (target, {}, "plain fp32"),
        "plain fp32 prepacked": (packed, {}, "plain fp32"),
        "prompt lookup fp32": (target, {"prompt_lookup_num_tokens": 10}, "plain fp32"),
        "hf-dspark fp32": (target, {"assistant_model": drafter}, "plain fp32"),
        "hf-dspark fp32 prepacked": (packed, {"assistant_model": packed_drafter}, "plain fp32 prepacked"),
    }
    if args.prepacked_only:
        configs = {name: config for name, config in configs.items() if "prepacked" in name}
    for threshold in filter(None, args.thresholds.split(",")):
        configs[f"hf-dspark fp32 prepacked, threshold {threshold}"] = (
            packed, {"assistant_model": packed_drafter, "dspark_confidence_threshold": float(threshold)},
            "plain fp32 prepacked")
    for threshold in filter(None, args.unpacked_thresholds.split(",")):
        configs[f"hf-dspark fp32, threshold {threshold}"] = (
            target, {"assistant_model": drafter, "dspark_confidence_threshold": float(threshold)}, "plain fp32")
    for num in filter(None, args.num_tokens.split(",")):
        configs[f"hf-dspark fp32 prepacked, γ={num}"] = (
            packed, {"assistant_model": packed_drafter, "dspark_num_tokens": int(num)}, "plain fp32 prepacked")
    if other is not None:
        configs[f"compare {args.compare_drafter}, threshold {other.config.confidence_threshold:g}"] = (
            packed, {"assistant_model": other}, "plain fp32 prepacked")
        for threshold in filter(None, args.compare_thresholds.split(",")):
            configs[f"compare {args.compare_drafter}, threshold {threshold}"] = (
                packed, {"assistant_model": other, "dspark_confidence_threshold": float(threshold)},
                "plain fp32 prepacked")
    if bf16 is not None and not args.prepacked_only:
        configs["plain bf16"] = (bf16, {}, "plain bf16")
    if dflash is not None and not args.prepacked_only:
        configs["hf-dflash fp32"] = (target, {"assistant_model": dflash}, "plain fp32")

    prompts = (load_heldout_prompts(Path(args.prompts), args.num_prompts) if args.prompts
               else load_prompts(Path(args.eval_dir), args.per_benchmark, args.seed))
    results = []
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        sampling = {"do_sample": False} if temperature == 0 else {"do_sample": True, "temperature": temperature}
        times = {name: [] for name in configs}
        tokens = {name: [] for name in configs}
        stats = {name: [] for name in configs}
        identical = {name: True for name in configs}
        for bench, text in prompts:
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
            reference = {}
            for name, (model, extra, base) in configs.items():
                if temperature > 0 and "prompt_lookup_num_tokens" in extra:
                    continue
                torch.manual_seed(args.seed)
                out, seconds = timed_generate(model, ids, max_new_tokens=args.max_new_tokens, **sampling, **extra)
                new = out[0, ids.shape[1]:]
                times[name].append(seconds)
                tokens[name].append(len(new))
                drafter_used = extra.get("assistant_model")
                if drafter_used is not None and hasattr(drafter_used, "stats"):
                    stats[name].append(drafter_used.stats)
                if temperature == 0:
                    reference.setdefault(id(model), new)
                    identical[name] &= torch.equal(reference[id(model)], new)
        for name, (model, extra, base) in configs.items():
            if not times[name]:
                continue
            base = base if times.get(base) else name  # its baseline was filtered out (--prepacked-only)
            tps = sum(tokens[name]) / sum(times[name])
            base_tps = sum(tokens[base]) / sum(times[base])
            plain_tps = (sum(tokens["plain fp32"]) / sum(times["plain fp32"])) if times.get("plain fp32") else None
            row = {"temperature": temperature, "config": name, "tok_s": tps, "ratio_vs_baseline": tps / base_tps,
                   "baseline": base, "ratio_vs_plain_fp32": tps / plain_tps if plain_tps else None,
                   "identical_to_plain_greedy": identical[name] if temperature == 0 else None}
            if stats[name]:
                merged = stats[name][0]
                for s in stats[name][1:]:
                    merged = merged.merge(s)
                per_token = sum(times[base]) / sum(tokens[base])  # baseline seconds per token, same model
                c_draft = merged.draft_seconds / merged.rounds / per_token
                v_gamma = merged.verify_seconds / merged.rounds / per_token
                row.update(tau=merged.tau, c_draft=c_draft, v_gamma=v_gamma,
                           bound_speedup=merged.tau / (c_draft + v_gamma),
                           conditional_acceptance=merged.conditional_acceptance)
            results.append(row)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps({"drafter": drafter_name, "prompts": len(prompts),
                                                      "prompt_source": args.prompts or args.eval_dir,
                                                      "max_new_tokens": args.max_new_tokens,
                                                      "threads": args.threads, "results": results}, indent=2))
    source = f"last {args.num_prompts} of {args.prompts}" if args.prompts else ", ".join(BENCHMARKS)
    print(f"drafter: {drafter_name}; {len(prompts)} prompts ({source}), "
          f"{args.max_new_tokens} new tokens, {args.threads} threads")
    print("| T | config | tok/s | × baseline | × plain fp32 | τ | c_draft | v(γ) | τ/(c+v) | greedy identical |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        fmt = lambda k: f"{r[k]:.2f}" if r.get(k) is not None else "–"  # noqa: E731
        same = {True: "yes", False: "NO", None: "–"}[r["identical_to_plain_greedy"]]
        print(f"| {r['temperature']:g} | {r['config']} | {r['tok_s']:.1f} | {r['ratio_vs_baseline']:.2f} "
              f"({r['baseline']}) | {fmt('ratio_vs_plain_fp32')} | {fmt('tau')} | {fmt('c_draft')} | "
              f"{fmt('v_gamma')} | {fmt('bound_speedup')} | {same} |")


if __name__ == "__main__":
    main()
