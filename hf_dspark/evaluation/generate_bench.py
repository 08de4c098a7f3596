"""Batch-1 ``generate`` speed with and without a drafter (``hf-dspark bench``, the README's main job).

Every configuration runs on the same prompts, interleaved prompt by prompt (round robin) so the noise of a shared
machine hits all of them alike; results are ratios to plain ``generate`` measured in the same run. Greedy
speculative outputs are checked token for token against plain greedy of the same model.

By default three configurations, the comparison a newcomer asks for (:func:`headline_table`): plain ``generate``,
transformers' prompt lookup and hf-dspark. The variants (``GenerateBenchSettings.variants``, or any setting that
names one) add plain fp32 with the skinny CPU linears hf-dspark's loop runs and with oneDNN-prepacked linears
(``cpu_kernels``), hf-dspark with stock linears and prepacked (each divided by plain with the same kernel),
threshold / fixed-γ runs, a second drafter to compare, a DFlash drafter and a bf16 target (:func:`results_table`).
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..cpu_kernels import loop_kernels, prepack_linears
from ..training.prompts import PromptFileError, read_prompts
from .benchmarks import read_benchmark_prompts

BENCHMARKS = ("gsm8k", "humaneval", "mt-bench")
PLAIN = "plain fp32"
PROMPT_LOOKUP = "prompt lookup fp32"
DSPARK = "hf-dspark fp32"
#: the default configurations and the names the headline prints them under
HEADLINE = {PLAIN: "plain generate", PROMPT_LOOKUP: "transformers prompt lookup", DSPARK: "hf-dspark"}
PLAIN_PACKED = "plain fp32 prepacked"
PLAIN_SKINNY = "plain fp32 skinny linears"
#: a configuration's generate kwargs with this key set run plain ``generate`` inside ``loop_kernels`` (the loop's)
SKINNY = "_skinny_linears"


@dataclass
class GenerateBenchSettings:
    """What to run beside the default configurations, and how long. ``variants`` adds the other kernels and dtypes
    (see the module docstring); ``thresholds`` / ``num_tokens`` add prepacked hf-dspark runs with
    ``dspark_confidence_threshold`` / ``dspark_num_tokens`` set; ``unpacked_thresholds`` the same on the stock fp32
    target; ``compare_thresholds`` apply to the comparison drafter. Each of those implies ``variants``."""

    max_new_tokens: int = 128
    temperatures: Sequence[float] = (0.0, 1.0)
    seed: int = 0
    skip_bf16: bool = False
    prepacked_only: bool = False
    thresholds: Sequence[float] = ()
    unpacked_thresholds: Sequence[float] = ()
    num_tokens: Sequence[int] = ()
    compare_thresholds: Sequence[float] = ()
    variants: bool = False

    def runs_variants(self) -> bool:
        """Whether the variants run: asked for, or named by a setting that only a variant uses."""
        return bool(self.variants or self.prepacked_only or self.thresholds or self.unpacked_thresholds
                    or self.num_tokens or self.compare_thresholds)


def benchmark_prompts(eval_dir: str | Path | None, per_benchmark: int, seed: int) -> list[tuple[str, str]]:
    """(benchmark, first turn): ``per_benchmark`` prompts of each of :data:`BENCHMARKS`, shuffled with ``seed``."""
    prompts = []
    for name in BENCHMARKS:
        rows = read_benchmark_prompts(name, eval_dir)
        random.Random(seed).shuffle(rows)
        prompts += [(name, p.first_turn) for p in rows[:per_benchmark]]
    return prompts


def heldout_prompts(path: str | Path, num: int) -> list[tuple[str, str]]:
    """The last ``num`` records of a training-data jsonl: the held-out conversations, for choosing settings
    (e.g. the confidence threshold) on data the benchmarks do not contain."""
    prompts = read_prompts(path)
    if not prompts:  # a bench of no prompts failed later, after the models had loaded
        raise PromptFileError(f"{path} holds no prompts to benchmark on.")
    return [(p.category or "heldout", p.first_turn) for p in prompts[-num:]]


def prepacked_copy(drafter, packed_target):
    """The drafter bound to the prepacked target, its own linears prepacked too (the original stays as it is)."""
    copy_ = type(drafter)(drafter.config).eval()  # the same class: a block drafter or an Eagle3 one
    copy_.load_state_dict(drafter.state_dict())
    return prepack_linears(copy_.bind_target(packed_target))


def build_configs(target, drafter, settings: GenerateBenchSettings, *, compare=None, compare_name: str = "",
                  dflash=None) -> dict[str, tuple[object, dict, str]]:
    """name -> (model, extra generate kwargs, name of the baseline its speed is divided by). Without variants (and
    no drafter to compare) the three of :data:`HEADLINE`, each divided by plain ``generate``."""
    if not (settings.runs_variants() or compare is not None or dflash is not None):
        return {PLAIN: (target, {}, PLAIN), PROMPT_LOOKUP: (target, {"prompt_lookup_num_tokens": 10}, PLAIN),
                DSPARK: (target, {"assistant_model": drafter}, PLAIN)}
    packed = prepack_linears(copy.deepcopy(target))
    packed_drafter = prepacked_copy(drafter, packed)
    configs = {
        PLAIN: (target, {}, PLAIN),
        PLAIN_SKINNY: (target, {SKINNY: True}, PLAIN),
        PLAIN_PACKED: (packed, {}, PLAIN),
        PROMPT_LOOKUP: (target, {"prompt_lookup_num_tokens": 10}, PLAIN),
        # hf-dspark's loop runs the skinny kernel: its baseline is plain decoding with that kernel
        DSPARK: (target, {"assistant_model": drafter}, PLAIN_SKINNY),
        "hf-dspark fp32, stock linears": (target, {"assistant_model": drafter, "dspark_cpu_linears": False}, PLAIN),
        "hf-dspark fp32 prepacked": (packed, {"assistant_model": packed_drafter}, PLAIN_PACKED),
    }
    if settings.prepacked_only:
        configs = {name: config for name, config in configs.items() if "prepacked" in name}
    for threshold in settings.thresholds:
        configs[f"hf-dspark fp32 prepacked, threshold {threshold:g}"] = (
            packed, {"assistant_model": packed_drafter, "dspark_confidence_threshold": threshold}, PLAIN_PACKED)
    for threshold in settings.unpacked_thresholds:
        configs[f"hf-dspark fp32, threshold {threshold:g}"] = (
            target, {"assistant_model": drafter, "dspark_confidence_threshold": threshold}, PLAIN)
    for num in settings.num_tokens:
        configs[f"hf-dspark fp32 prepacked, γ={num}"] = (
            packed, {"assistant_model": packed_drafter, "dspark_num_tokens": num}, PLAIN_PACKED)
    if compare is not None:
        other = prepacked_copy(compare, packed)
        configs[f"compare {compare_name}, threshold {other.config.confidence_threshold:g}"] = (
            packed, {"assistant_model": other}, PLAIN_PACKED)
        for threshold in settings.compare_thresholds:
            configs[f"compare {compare_name}, threshold {threshold:g}"] = (
                packed, {"assistant_model": other, "dspark_confidence_threshold": threshold}, PLAIN_PACKED)
    if not settings.prepacked_only:
        if not settings.skip_bf16:
            configs["plain bf16"] = (copy.deepcopy(target).to(torch.bfloat16), {}, "plain bf16")
        if dflash is not None:
            configs["hf-dflash fp32"] = (target, {"assistant_model": dflash}, PLAIN)
    return configs


def _timed_generate(model, ids, **kwargs):
    skinny = kwargs.pop(SKINNY, False)
    start = time.perf_counter()
    with loop_kernels(model) if skinny else nullcontext():
        out = model.generate(ids, **kwargs)
    return out, time.perf_counter() - start


def run_generate_bench(tokenizer, configs: dict[str, tuple[object, dict, str]], prompts: list[tuple[str, str]],
                       settings: GenerateBenchSettings, progress: bool = True) -> list[dict]:
    """One result row per (temperature, configuration): tok/s, ratios, greedy identity, τ and the cost split;
    ``progress``: a bar over (temperature, prompt) pairs on stderr."""
    results = []
    bar = tqdm(total=len(settings.temperatures) * len(prompts), desc="bench", unit="prompt", disable=not progress)
    for temperature in settings.temperatures:
        sampling = {"do_sample": False} if temperature == 0 else {"do_sample": True, "temperature": temperature}
        runs = {name: {"seconds": [], "tokens": [], "stats": [], "identical": True} for name in configs}
        for _, text in prompts:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)["input_ids"]
            reference = {}
            for name, (model, extra, _) in configs.items():
                if temperature > 0 and "prompt_lookup_num_tokens" in extra:
                    continue
                torch.manual_seed(settings.seed)
                out, seconds = _timed_generate(model, ids, max_new_tokens=settings.max_new_tokens, **sampling,
                                               **extra)
                new = out[0, ids.shape[1]:]
                run = runs[name]
                run["seconds"].append(seconds)
                run["tokens"].append(len(new))
                drafter = extra.get("assistant_model")
                if drafter is not None and hasattr(drafter, "stats"):
                    run["stats"].append(drafter.stats)
                if temperature == 0:
                    reference.setdefault(id(model), new)
                    run["identical"] &= torch.equal(reference[id(model)], new)
            bar.update()
        results += [_result_row(name, base, runs, temperature) for name, (_, _, base) in configs.items()
                    if runs[name]["seconds"]]
    bar.close()
    return results


def _tokens_per_second(run: dict) -> float:
    return sum(run["tokens"]) / sum(run["seconds"])


def _result_row(name: str, base: str, runs: dict, temperature: float) -> dict:
    run = runs[name]
    base = base if runs.get(base, {}).get("seconds") else name  # its baseline was filtered out (--prepacked-only)
    tps, base_tps = _tokens_per_second(run), _tokens_per_second(runs[base])
    plain_tps, lookup_tps = (_tokens_per_second(runs[other]) if runs.get(other, {}).get("seconds") else None
                             for other in (PLAIN, PROMPT_LOOKUP))
    row = {"temperature": temperature, "config": name, "seconds": sum(run["seconds"]), "tokens": sum(run["tokens"]),
           "tok_s": tps, "ratio_vs_baseline": tps / base_tps, "baseline": base,
           "ratio_vs_plain_fp32": tps / plain_tps if plain_tps else None,
           "ratio_vs_prompt_lookup": tps / lookup_tps if lookup_tps else None,
           "identical_to_plain_greedy": run["identical"] if temperature == 0 else None}
    merged = None
    for stats in run["stats"]:
        merged = stats if merged is None else merged.merge(stats)
    if merged is not None and merged.rounds and sum(runs[base]["tokens"]):  # no round ran: no τ to report
        per_token = sum(runs[base]["seconds"]) / sum(runs[base]["tokens"])  # baseline seconds per token
        c_draft = merged.draft_seconds / merged.rounds / per_token
        v_gamma = merged.verify_seconds / merged.rounds / per_token
        row.update(tau=merged.tau, c_draft=c_draft, v_gamma=v_gamma, bound_speedup=merged.tau / (c_draft + v_gamma),
                   conditional_acceptance=merged.conditional_acceptance)
    return row


def _same(result: dict) -> str:
    return {True: "yes", False: "NO", None: "–"}[result["identical_to_plain_greedy"]]


def _ratio(result: dict, key: str) -> str:
    return f"{result[key]:.2f}" if result.get(key) is not None else "–"


def headline_table(results: list[dict]) -> str:
    """The table ``hf-dspark bench`` prints: plain ``generate``, transformers' prompt lookup and hf-dspark — seconds
    and new tokens over all prompts, speed (new tokens per second) relative to plain and to prompt lookup, and
    whether the greedy output is plain's token for token. Prompt lookup runs greedy only."""
    header = ("| T | configuration | seconds | new tokens | speed × plain | speed × prompt lookup "
              "| identical to plain |")
    lines = [header, "|---" * 7 + "|"]
    for r in results:
        if r["config"] not in HEADLINE:
            continue
        name = f"**{HEADLINE[r['config']]}**" if r["config"] == DSPARK else HEADLINE[r["config"]]
        lines.append(f"| {r['temperature']:g} | {name} | {r['seconds']:.1f} | {r['tokens']} | "
                     f"{_ratio(r, 'ratio_vs_plain_fp32')} | {_ratio(r, 'ratio_vs_prompt_lookup')} | {_same(r)} |")
    return "\n".join(lines)


def results_table(results: list[dict]) -> str:
    """The table of every configuration, which ``hf-dspark bench --variants`` prints after the headline."""
    lines = ["| T | config | tok/s | × baseline | × plain fp32 | τ | c_draft | v(γ) | τ/(c+v) | greedy identical |",
             "|---" * 10 + "|"]
    for r in results:
        lines.append(f"| {r['temperature']:g} | {r['config']} | {r['tok_s']:.1f} | {r['ratio_vs_baseline']:.2f} "
                     f"({r['baseline']}) | {_ratio(r, 'ratio_vs_plain_fp32')} | {_ratio(r, 'tau')} | "
                     f"{_ratio(r, 'c_draft')} | {_ratio(r, 'v_gamma')} | {_ratio(r, 'bound_speedup')} | {_same(r)} |")
    return "\n".join(lines)
