"""``hf-dspark calibrate``, ``eval``, ``bench`` and ``serve-bench``: how well and how fast a drafter drafts.

The work is in ``hf_dspark.evaluation``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .arguments import (non_negative_float, non_negative_floats, non_negative_int, non_negative_ints,
                        output_folder, positive_float, positive_int, positive_ints)

DTYPE_CHOICES = ["bfloat16", "float16", "float32"]
EVAL_DIR_HELP = "folder of <benchmark>.jsonl (default: $HF_DSPARK_EVAL_DIR, else ../shared/eval_datasets)"


def _device_default() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


# -------------------------------------------------------------------------------------------------------
# calibrate
# -------------------------------------------------------------------------------------------------------
def add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", allow_abbrev=False,
                       help="STS-calibrate a drafter's confidence head on held-out prompts.",
                       description="Runs the drafter at the serving temperature on prompts the trainer did not see "
                                   "(default: the last --num-prompts records of the training data), refuses any that "
                                   "overlap the evaluation sets, fits a temperature (and offset) per position and "
                                   "writes the calibrated drafter, calibration.md / .json, reliability.png and the "
                                   "rounds. At --temperature 0 it writes the greedy fit and keeps the sampling one.")
    p.add_argument("--drafter", required=True, help="drafter directory to calibrate")
    p.add_argument("--out", type=output_folder, required=True, help="where the calibrated drafter and the report go")
    p.add_argument("--prompts", default="data/smollm2/train.jsonl",
                   help="held-out prompt file (jsonl/json: turns, messages, conversations, prompt, ...); default: "
                        "%(default)s, whose tail the SmolLM2 recipe keeps out of its cache (hf-dspark cache --limit)")
    p.add_argument("--num-prompts", type=non_negative_int, default=64,
                   help="use the last N records (0 = the whole file)")
    p.add_argument("--temperature", type=non_negative_float, default=1.0, help="serving temperature to calibrate for")
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    p.add_argument("--batch-size", type=positive_int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-dir", default=None,
                   help="evaluation prompts to refuse (default: $HF_DSPARK_EVAL_DIR, else ../shared/eval_datasets)")
    p.add_argument("--target", default=None, help="target model path / id (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--rounds", default=None,
                   help="refit from a calibration_rounds.npz written by an earlier run instead of generating (the "
                        "drafter must be the one that recorded them: its raw confidence logits are reused)")
    p.add_argument("--rounds-temperature", type=non_negative_float, default=None,
                   help="with --rounds: the serving temperature they were recorded at (for the report)")
    p.add_argument("--temperatures-only", action="store_true",
                   help="fit the paper's per-position temperatures only (default: temperature + offset)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.set_defaults(func=cmd_calibrate, default_log_level="info", quiet_generate_summaries=True)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from ..evaluation.calibration_run import (calibrate, fit_from_trace, held_out_prompts, load_rounds_for,
                                              save_calibrated)
    from ..loading import ModelLoadError, load_drafter, load_target, raise_if_bad_paths

    raise_if_bad_paths(args.target, [args.drafter])
    for path in [args.rounds] if args.rounds else [args.prompts]:
        if not Path(path).is_file():
            raise FileNotFoundError(f"{'--rounds' if args.rounds else '--prompts'} {path!r}: no such file.")
    _set_threads(args.threads)
    if args.rounds:  # no generation: the target is needed only to bind the drafter (no tokenizer)
        target, _ = load_target(args.target, args.dtype, tokenizer=False)
        drafter = _calibratable(load_drafter(args.drafter, target).model, args.drafter)
        try:
            trace = load_rounds_for(drafter, args.rounds)
        except ValueError as err:  # rounds of another drafter: the user passed the wrong file
            raise ModelLoadError(str(err)) from err
        run = fit_from_trace(trace, serving_temperature=args.rounds_temperature, offsets=not args.temperatures_only)
    else:
        prompts = held_out_prompts(args.prompts, args.num_prompts or None)
        target, tokenizer = load_target(args.target, args.dtype, device=args.device or _device_default())
        drafter = _calibratable(load_drafter(args.drafter, target).model, args.drafter)
        run = calibrate(target, tokenizer, drafter, prompts, temperature=args.temperature,
                        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
                        eval_dir=args.eval_dir, offsets=not args.temperatures_only)
    written = save_calibrated(drafter, run, args.out, plots=not args.no_plots)
    print(run.to_markdown())
    print("temperatures: " + " ".join(f"{t:.3f}" for t in run.temperatures))
    if run.offsets is not None:
        print("offsets:      " + " ".join(f"{b:+.3f}" for b in run.offsets))
    print(f"calibrated drafter written to {written['drafter']}")
    return 0


def _calibratable(drafter, path: str):
    from ..loading import ModelLoadError

    if drafter.confidence_head is None:
        raise ModelLoadError(f"cannot calibrate the drafter {path!r}: it has no confidence head, so there is nothing "
                             "to calibrate (DFlash-style drafters verify every draft).")
    return drafter


# -------------------------------------------------------------------------------------------------------
# eval
# -------------------------------------------------------------------------------------------------------
def add_eval(sub) -> None:
    from ..evaluation.benchmarks import DEEPSPEC_SEED, DEFAULT_BENCHMARKS
    from ..evaluation.harness import DEFAULT_THRESHOLDS

    p = sub.add_parser("eval", allow_abbrev=False,
                       help="Measure τ and speedup per benchmark (DeepSpec's protocol), one or more drafters.",
                       description="Writes results.md, results.json, the raw rounds and PNG plots to --out and "
                                   "prints the markdown tables. DeepSpec's caps and 2048 new tokens by default; on a "
                                   "CPU pass smaller --max-samples / --max-new-tokens.")
    p.add_argument("--drafter", required=True, help="drafter directory (any supported checkpoint dialect)")
    p.add_argument("--baseline-drafter", nargs="+", default=None,
                   help="drafters to compare with (e.g. DFlash, Eagle3), scored on the same prompts")
    p.add_argument("--names", nargs="+", default=None, help="labels for the drafters (default: DSpark / DFlash)")
    p.add_argument("--out", type=output_folder, required=True, help="output folder")
    p.add_argument("--target", default=None, help="target model path / id (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--eval-dir", default=None, help=EVAL_DIR_HELP)
    p.add_argument("--benchmarks", nargs="+", default=list(DEFAULT_BENCHMARKS))
    p.add_argument("--temperatures", type=non_negative_float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--max-new-tokens", type=positive_int, default=2048)
    p.add_argument("--max-samples", type=positive_int, default=None, help="lower every benchmark's cap (CPU runs)")
    p.add_argument("--batch-size", type=positive_int, default=1)
    p.add_argument("--seed", type=int, default=DEEPSPEC_SEED)
    p.add_argument("--thresholds", type=non_negative_float, nargs="+", default=list(DEFAULT_THRESHOLDS))
    p.add_argument("--no-speedup", action="store_true", help="skip the plain-generate timing runs")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.set_defaults(func=cmd_eval, default_log_level="info", quiet_generate_summaries=True, parser=p)


def cmd_eval(args: argparse.Namespace) -> int:
    from ..evaluation.benchmarks import read_benchmark_prompts
    from ..evaluation.harness import evaluate, label_drafters
    from ..loading import load_drafter, load_target, raise_if_bad_paths

    paths = [args.drafter, *(args.baseline_drafter or [])]
    if args.names and len(args.names) != len(paths):
        args.parser.error(f"--names needs {len(paths)} labels (one per drafter), got {len(args.names)}")
    raise_if_bad_paths(args.target, paths)
    for name in args.benchmarks:  # a missing or empty file fails before the models load, not after
        read_benchmark_prompts(name, args.eval_dir)
    _set_threads(args.threads)
    target, tokenizer = load_target(args.target, args.dtype, device=args.device or _device_default())
    drafters = label_drafters([load_drafter(path, target).model for path in paths], args.names)
    result = evaluate(target, tokenizer, drafters, benchmarks=args.benchmarks, eval_dir=args.eval_dir,
                      temperatures=args.temperatures, max_new_tokens=args.max_new_tokens,
                      max_samples=args.max_samples, seed=args.seed, batch_size=args.batch_size,
                      measure_speedup=not args.no_speedup, thresholds=args.thresholds)
    written = result.save(args.out, plots=not args.no_plots)
    print(result.to_markdown())
    print(f"written: {written['markdown']}, {written['json']} (+ {len(written) - 2} rounds/plot files)")
    return 0


# -------------------------------------------------------------------------------------------------------
# bench
# -------------------------------------------------------------------------------------------------------
def add_bench(sub) -> None:
    p = sub.add_parser("bench", allow_abbrev=False,
                       help="Benchmark batch-1 generate with and without the drafter (the README's main job).",
                       description="Plain generate, transformers' prompt lookup and hf-dspark on the same prompts, "
                                   "interleaved prompt by prompt: seconds, speed relative to plain and to prompt "
                                   "lookup measured in the same run, greedy outputs checked token for token against "
                                   "plain. --variants adds other kernels, dtypes and settings. Writes "
                                   "<out>/results.json and prints the table.")
    p.add_argument("--drafter", help="trained DSpark drafter dir (default: the shipped one, else UNTRAINED)")
    p.add_argument("--target", default=None, help="target dir / Hub id (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dflash-drafter", help="trained DFlash drafter dir, for the DSpark/DFlash comparison")
    p.add_argument("--eval-dir", default=None, help=EVAL_DIR_HELP)
    p.add_argument("--per-benchmark", type=positive_int, default=3)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--temperatures", type=non_negative_floats, default="0,1", help="comma list")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", action="store_true",
                   help="also run plain generate with hf-dspark's CPU kernels and prepacked, hf-dspark with stock "
                        "linears and prepacked, and a bf16 target, and print every configuration's table (τ, cost "
                        "split); each option below implies it")
    p.add_argument("--skip-bf16", action="store_true", help="with --variants: no bf16 target")
    p.add_argument("--thresholds", type=non_negative_floats, default="",
                   help="comma list: also run hf-dspark (prepacked) with dspark_confidence_threshold=each")
    p.add_argument("--unpacked-thresholds", type=non_negative_floats, default="",
                   help="comma list: also run hf-dspark on the stock (not prepacked) fp32 target with "
                        "dspark_confidence_threshold=each")
    p.add_argument("--compare-drafter", default=None,
                   help="a second DSpark drafter dir, run prepacked side by side (at its own threshold and at each "
                        "of --compare-thresholds), e.g. the shipped drafter against a new one")
    p.add_argument("--compare-thresholds", type=non_negative_floats, default="",
                   help="comma list for --compare-drafter")
    p.add_argument("--num-tokens", type=non_negative_ints, default="",
                   help="comma list: also run hf-dspark (prepacked) with dspark_num_tokens=each (fixed γ)")
    p.add_argument("--prompts", default=None,
                   help="jsonl of held-out records to use instead of --eval-dir (the last --num-prompts records)")
    p.add_argument("--num-prompts", type=positive_int, default=8)
    p.add_argument("--prepacked-only", action="store_true",
                   help="only the prepacked plain / hf-dspark configurations (and threshold / γ variants)")
    p.add_argument("--out", type=output_folder, default="runs/bench_generate")
    p.set_defaults(func=cmd_bench, default_log_level="warning")


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from ..evaluation.benchmarks import default_eval_dir
    from ..evaluation.generate_bench import (BENCHMARKS, HEADLINE, GenerateBenchSettings, benchmark_prompts,
                                             build_configs, headline_table, heldout_prompts, results_table,
                                             run_generate_bench)
    from ..loading import load_drafter, load_target, raise_if_bad_paths

    raise_if_bad_paths(args.target, [args.drafter, args.compare_drafter, args.dflash_drafter])
    torch.set_num_threads(args.threads)
    settings = GenerateBenchSettings(
        max_new_tokens=args.max_new_tokens, temperatures=args.temperatures, seed=args.seed,
        skip_bf16=args.skip_bf16, prepacked_only=args.prepacked_only, thresholds=args.thresholds,
        unpacked_thresholds=args.unpacked_thresholds, num_tokens=args.num_tokens,
        compare_thresholds=args.compare_thresholds, variants=args.variants)
    prompts = (heldout_prompts(args.prompts, args.num_prompts) if args.prompts
               else benchmark_prompts(args.eval_dir, args.per_benchmark, args.seed))  # fails before loading models
    target, tokenizer = load_target(args.target)
    drafter = load_drafter(args.drafter, target)
    compare = load_drafter(args.compare_drafter, target).model if args.compare_drafter else None
    dflash = load_drafter(args.dflash_drafter, target, head="none").model if args.dflash_drafter else None
    configs = build_configs(target, drafter.model, settings, compare=compare, compare_name=args.compare_drafter or "",
                            dflash=dflash)
    results = run_generate_bench(tokenizer, configs, prompts, settings)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps({
        "drafter": drafter.source, "prompts": len(prompts),
        "prompt_source": args.prompts or str(args.eval_dir or default_eval_dir()),
        "max_new_tokens": args.max_new_tokens, "threads": args.threads, "results": results}, indent=2))
    source = f"last {args.num_prompts} of {args.prompts}" if args.prompts else ", ".join(BENCHMARKS)
    print(f"drafter: {drafter.source}; {len(prompts)} prompts ({source}), {args.max_new_tokens} new tokens, "
          f"{args.threads} threads")
    shows_headline = any(name in HEADLINE for name in configs)  # not with --prepacked-only
    if shows_headline:
        print(headline_table(results))
        print("speed: new tokens per second over all prompts. hf-dspark's loop runs CPU kernels plain generate does "
              "not (--variants adds plain generate with them).")
    if set(configs) != set(HEADLINE):
        print(("\nEvery configuration:\n" if shows_headline else "") + results_table(results))
    print(f"wrote {out_dir / 'results.json'}")
    return 0


# -------------------------------------------------------------------------------------------------------
# serve-bench
# -------------------------------------------------------------------------------------------------------
def policy_labels(text: str) -> list[str]:
    """``--policies``: a comma list of serve-bench's labels (a registered policy, ``fixedN``, ``lookup-only``,
    ``scheduled-nolookup``), refused while parsing: an unknown one failed after the models had loaded."""
    import argparse

    from ..evaluation.serving_bench import parse_policy
    from ..scheduling import available_policies

    labels = [label.strip() for label in text.split(",") if label.strip()]
    unknown = [label for label in labels if parse_policy(label, 0.0)[0] not in available_policies()]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown policy {unknown[0]!r}: choose from {', '.join(available_policies())}"
                                         ", fixedN, lookup-only, scheduled-nolookup")
    if not labels:
        raise argparse.ArgumentTypeError("no policy given")
    return labels


def add_serve_bench(sub) -> None:
    from ..evaluation.serving_bench import DEFAULT_POLICIES

    p = sub.add_parser("serve-bench", allow_abbrev=False,
                       help="Benchmark the continuous-batching engine: throughput vs per-user speed under load.",
                       description="For each concurrency C every policy serves the same closed-loop request stream "
                                   "(C requests always in flight). Writes results.json and frontier.png. Smoke run "
                                   "(< 2 min): --concurrency 1,2 --max-prompts 2 --max-new-tokens 16 "
                                   "--min-requests 2 --requests-factor 1.")
    p.add_argument("--drafter", help="trained drafter dir (default: the shipped one, else UNTRAINED)")
    p.add_argument("--target", default=None, help="target dir / Hub id (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--eval-dir", default=None, help=EVAL_DIR_HELP)
    p.add_argument("--concurrency", type=positive_ints, default="1,2,4,8,16,32,64", help="comma list")
    p.add_argument("--policies", type=policy_labels, default=DEFAULT_POLICIES,
                   help="comma list: none, fixedN, fixed, threshold, scheduled (lookup + drafter), scheduled-nolookup, "
                        "lookup-only (no drafter), scheduled-async")
    p.add_argument("--threshold", type=non_negative_float, default=0.5,
                   help="confidence threshold of the threshold policy")
    p.add_argument("--prompts-per-benchmark", type=positive_int, default=8)
    p.add_argument("--max-prompts", type=positive_int, default=None,
                   help="cap on the total number of distinct prompts")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=512)
    p.add_argument("--min-new-tokens", type=positive_int, default=None,
                   help="request i asks for a number of new tokens drawn from [this, --max-new-tokens] (seeded by i, "
                        "the same stream for every policy): traffic whose answers end at different steps, as real "
                        "answers do (default: every request asks for --max-new-tokens)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--requests-factor", type=positive_float, default=2.0,
                   help="requests per level = factor × C ...")
    p.add_argument("--min-requests", type=positive_int, default=8, help="... but at least this many")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="runs per (concurrency, policy), order rotated; the summary, table and plot use medians")
    p.add_argument("--prepack", action="store_true", help="oneDNN-prepacked linears (hf_dspark.cpu_kernels)")
    p.add_argument("--stock-linears", action="store_true",
                   help="engines run stock F.linear (DSparkEngine(cpu_linears=False)) instead of the skinny kernel")
    p.add_argument("--sps-repeats", type=positive_int, default=3, help="timed repeats per step-cost grid point")
    p.add_argument("--step-cost", choices=("engine", "shared"), default="engine",
                   help="engine: every engine measures its own step cost (cached on disk) and corrects it by wall "
                        "time, as DSparkEngine does by default; shared: one table measured up front, fixed for "
                        "every engine (decisions independent of the machine's load during the run)")
    p.add_argument("--max-prefill-tokens", type=positive_int, default=2048)
    p.add_argument("--interleave", choices=("steps", "runs"), default="steps",
                   help="steps: the policies of one concurrency level run in lock-step, one engine step each in "
                        "turn, each timed on its own clock (a shared machine's drift hits all alike); runs: one "
                        "policy's run after another")
    p.add_argument("--workload", choices=("prompts", "agents"), default="prompts",
                   help="prompts: the benchmarks' first turns, C requests in flight; agents: C scripted tool-calling "
                        "agents (hf_dspark.evaluation.agent_script), each sending its next generation on its growing "
                        "conversation as soon as the last one is answered, one cache salt per agent")
    p.add_argument("--agent-turns", type=positive_int, default=2, help="user turns per agent (4 generations each)")
    p.add_argument("--out", type=output_folder, default="runs/bench_serving")
    p.set_defaults(func=cmd_serve_bench, default_log_level="info", parser=p)


def cmd_serve_bench(args: argparse.Namespace) -> int:
    import torch

    from ..evaluation.benchmarks import read_benchmark_prompts
    from ..evaluation.plots import plot_throughput_frontier
    from ..evaluation.serving_bench import (BENCHMARKS, ServingBenchSettings, median_over_repeats, run_serving_bench,
                                            serving_prompts, step_kind_table, summary_table)
    from ..loading import load_drafter, load_target, raise_if_bad_paths
    from ..scheduling import profile_step_cost
    from ..serving import DSparkEngine
    from ..speculation.shared_state import LONG_MATCH_TOKENS

    if args.min_new_tokens is not None and args.min_new_tokens > args.max_new_tokens:
        args.parser.error(f"--min-new-tokens {args.min_new_tokens} is above --max-new-tokens {args.max_new_tokens}")
    raise_if_bad_paths(args.target, [args.drafter])
    for name in BENCHMARKS if args.workload == "prompts" else ():  # before the models load, not after
        read_benchmark_prompts(name, args.eval_dir)
    torch.set_num_threads(args.threads)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    target, tokenizer = load_target(args.target)
    sps_cache_dir = None
    if args.prepack:
        from ..cpu_kernels import prepack_linears

        target = prepack_linears(target)
        sps_cache_dir = str(out_dir / "sps_prepacked")  # same config, different speed: keep its own SPS cache
    drafter = load_drafter(args.drafter, target)
    settings = ServingBenchSettings(
        levels=args.concurrency, policies=args.policies,
        threshold=args.threshold, max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens,
        requests_factor=args.requests_factor, min_requests=args.min_requests, temperature=args.temperature,
        repeats=args.repeats, max_prefill_tokens=args.max_prefill_tokens,
        cpu_linears=False if args.stock_linears else None,
        interleave=args.interleave, workload=args.workload, agent_turns=args.agent_turns)
    prompts = [] if args.workload == "agents" else serving_prompts(tokenizer, args.eval_dir, args.prompts_per_benchmark,
                                                                   args.max_prompts, args.max_prompt_tokens)
    gamma = drafter.model.config.block_size
    target_name = args.target or "HuggingFaceTB/SmolLM2-135M-Instruct (embedded, fp32)"
    stream = (f"{len(prompts)} prompts" if args.workload == "prompts" else
              f"C scripted agents × {args.agent_turns} turns × 4 generations")
    print(f"target {target_name}, drafter: {drafter.source}; {stream}, policies "
          f"{list(settings.policies)}, concurrency {list(settings.levels)}", flush=True)
    # the engine's real step on this machine: drafter pass for R requests + padded verify of R rows × W tokens
    sps = None
    if args.step_cost == "shared":
        from ..cpu_kernels import loop_linears

        with loop_linears(settings.cpu_linears, target, drafter.model):  # the kernel the engines' steps run
            sps = profile_step_cost(target, drafter.model, max_rows=max(settings.levels),
                                    max_width=1 + max(gamma, LONG_MATCH_TOKENS), repeats=args.sps_repeats,
                                    cache_dir=sps_cache_dir)
    DSparkEngine(target, drafter.model, "fixed", sps=sps, cpu_linears=settings.cpu_linears).generate(
        [prompts[0][1] if prompts else tokenizer("Hello")["input_ids"]], 4)  # warm-up, not measured
    results = run_serving_bench(target, drafter.model, tokenizer, prompts, sps, settings,
                                sps_cache_dir=sps_cache_dir)
    summary = median_over_repeats(results)
    print("\n" + summary_table(summary, settings.policies, settings.levels))
    print("\n" + step_kind_table(summary, settings.policies, settings.levels))
    report = {"target": target_name, "drafter": drafter.source, "drafter_trained": drafter.trained,
              "block_size": gamma, "threads": args.threads, "prepack": args.prepack,
              "cpu_linears": settings.cpu_linears, "torch": torch.__version__,
              "max_new_tokens": args.max_new_tokens, "min_new_tokens": args.min_new_tokens,
              "temperature": args.temperature, "num_prompts": len(prompts), "workload": args.workload,
              "agent_turns": args.agent_turns if args.workload == "agents" else None,
              "repeats": args.repeats, "interleave": args.interleave,
              "step_cost": sps.to_dict() if sps is not None else "measured by each engine",
              "summary": summary, "results": results}
    (out_dir / "results.json").write_text(json.dumps(report, indent=1))
    title = (f"DSparkEngine on {args.target or 'SmolLM2-135M'} ({'trained' if drafter.trained else 'UNTRAINED'} "
             f"drafter, {args.threads} threads)")
    plot_throughput_frontier(summary, out_dir / "frontier.png", title=title)
    print(f"wrote {out_dir / 'results.json'} and {out_dir / 'frontier.png'}")
    return 0
