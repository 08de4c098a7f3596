"""Evaluation harness: τ, per-position acceptance, threshold sweep, calibration and speedup per benchmark.

Protocol (DeepSpec's, see ``benchmarks.py``): first turn of each benchmark prompt, the target's chat template,
no system prompt, DeepSpec's caps and seeded subsampling, every prompt re-seeded with ``seed + index``,
T = 0 and T = 1, chain drafting of γ tokens at confidence threshold 0. Everything is measured through the
public path ``target.generate(..., assistant_model=draft)`` with a :class:`RoundRecorder` attached:

* τ pooled over rounds, Σ committed / rounds (bonus included; an EOS round counts only what it committed);
* conditional and unconditional acceptance per position (``DSparkStats`` over the recorded rounds);
* a static confidence-threshold sweep (paper Fig. 5), derived offline from the threshold-0 rounds;
* ECE / AUC of the joint survival a_k per position, raw and with the drafter's STS calibration (Fig. 6);
* wall-clock tok/s of plain ``target.generate`` vs speculative on the same prompts, batch by batch side by side.

The library logs; the CLI (``hf-dspark eval``) prints.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from ..training.calibration import PositionCalibration, calibrated_confidence, calibration_report
from ..metrics import DSparkStats
from .benchmarks import (DEEPSPEC_SAMPLE_CAPS, DEEPSPEC_SEED, DEFAULT_BENCHMARKS, Benchmark, encode_chat_prompt,
                         left_pad, load_benchmark)
from ..modeling.architectures import method_label
from ..scheduling.policies import PolicyInputs, ThresholdPolicy
from .recorder import RoundRecorder, RoundTrace

# Every round proposes all γ drafts (threshold 0): calibration and the offline threshold sweep need complete rounds
# (a higher threshold is derived from them afterwards: the per-position rule is non-anticipating), and passing it
# per call leaves the caller's drafter config untouched.
FULL_PROPOSALS = {"dspark_confidence_threshold": 0.0}

logger = logging.getLogger(__name__)

DEFAULT_THRESHOLDS = tuple(round(0.1 * i, 1) for i in range(9))  # 0.0 .. 0.8, as in paper Fig. 5


# ---------------------------------------------------------------------------------------------------------
# Metrics over recorded rounds
# ---------------------------------------------------------------------------------------------------------
@dataclass
class ThresholdSweep:
    """Per static threshold t: acceptance rate of the verified drafts, drafts verified per round, and τ."""

    thresholds: list[float]
    acceptance_rate: list[float]
    drafts_per_round: list[float]
    tau: list[float]


def threshold_sweep(trace: RoundTrace, thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
                    temperatures: Sequence[float] | None = None,
                    offsets: Sequence[float] | None = None) -> ThresholdSweep:
    """Derive a static-threshold run from threshold-0 rounds, round by round.

    The drafter stops at the first slot whose own c_k = σ(z_k / T_k + b_k) is below t, and c_k depends only on
    drafts < k, so the same round at threshold t would have verified m_t = min(proposed, first k with c_k < t)
    of the very same drafts: accepted_t = min(accepted, m_t). A round that the threshold does not cut short
    (m_t ≥ accepted) commits what it committed; a cut one commits its m_t accepted drafts plus the bonus.
    (Later rounds would start elsewhere; like the paper's Fig. 5 this is a per-round view.)"""
    if not len(trace):  # checked first: an empty trace has no confidence logits either, but that is not why
        raise ValueError("a threshold sweep needs at least one recorded round; the trace is empty (no prompts, or "
                         "max_new_tokens too small for a verification round)")
    if not trace.has_confidence:
        raise ValueError("a threshold sweep needs confidence logits in every round (a drafter with a confidence "
                         "head); DFlash-style drafters have none")
    confidence = calibrated_confidence(trace.confidence_logits, temperatures, offsets)
    rounds = len(trace)
    out = ThresholdSweep([], [], [], [])
    for t in thresholds:
        # the library's one threshold rule (what generate and the engine run): verify up to the first c_k < t
        verified = ThresholdPolicy(float(t), max_threshold=math.inf).choose(
            PolicyInputs(confidence, trace.num_proposed)).numpy()
        accepted = np.minimum(trace.num_accepted, verified)
        committed = np.where(verified >= trace.num_accepted, trace.num_committed,
                             np.minimum(trace.num_committed, verified + 1))
        out.thresholds.append(float(t))
        out.acceptance_rate.append(float(accepted.sum() / verified.sum()) if verified.sum() else float("nan"))
        out.drafts_per_round.append(float(verified.sum() / rounds))
        out.tau.append(float(committed.sum() / rounds))
    return out


def calibration_of(trace: RoundTrace, temperatures: Sequence[float] | None,
                   offsets: Sequence[float] | None = None) -> list[PositionCalibration] | None:
    """ECE/AUC per position of the joint survival, raw (T = 1) and with ``temperatures`` / ``offsets`` (None:
    T = 1 / b = 0, so without either 'after' equals 'before'). None when the rounds carry no confidence logits."""
    if not trace.has_confidence:
        return None
    temps = list(temperatures) if temperatures is not None else [1.0] * trace.block_size
    return calibration_report(trace.confidence_logits, trace.num_accepted, trace.num_proposed, temperatures=temps,
                              offsets=offsets)


# ---------------------------------------------------------------------------------------------------------
# Generation runs
# ---------------------------------------------------------------------------------------------------------
def sampling_kwargs(temperature: float) -> dict:
    """Pure temperature sampling (no top-k / top-p, as DeepSpec evaluates), greedy at T = 0."""
    if temperature > 0:
        return {"do_sample": True, "temperature": float(temperature), "top_k": 0, "top_p": 1.0}
    return {"do_sample": False}


def _eos_ids(target) -> set[int]:
    eos = getattr(target.generation_config, "eos_token_id", None)
    return set() if eos is None else {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def count_new_tokens(sequences: torch.Tensor, prompt_width: int, eos_ids: set[int]) -> int:
    """Generated tokens per row up to and including the first EOS (what follows is padding)."""
    total = 0
    for row in sequences[:, prompt_width:].tolist():
        ends = [i for i, tok in enumerate(row) if tok in eos_ids]
        total += ends[0] + 1 if ends else len(row)
    return total


def _ensure_bound(drafter, target) -> None:
    try:
        bound = drafter.target
    except RuntimeError:
        bound = None
    if bound is not target:
        drafter.bind_target(target)  # also installs the generate wrapper on the target


def _timed_generate(target, input_ids, attention_mask, *, seed: int, gen_kwargs: dict, **extra) -> tuple[int, float]:
    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.no_grad():
        out = target.generate(input_ids=input_ids, attention_mask=attention_mask, **gen_kwargs, **extra)
    seconds = time.perf_counter() - start
    return count_new_tokens(out, input_ids.shape[1], _eos_ids(target)), seconds


@dataclass
class _Throughput:
    tokens: int = 0
    seconds: float = 0.0
    stats: DSparkStats | None = None  # draft.stats merged over the calls (draft / verify seconds)

    def add(self, tokens: int, seconds: float, stats: DSparkStats | None = None) -> None:
        self.tokens += tokens
        self.seconds += seconds
        if stats is not None:
            self.stats = stats if self.stats is None else self.stats.merge(stats)


def _batches(n: int, batch_size: int) -> list[range]:
    return [range(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]


def record_rounds(target, tokenizer, drafter, prompts: Sequence[str], *, temperature: float, max_new_tokens: int,
                  batch_size: int = 1, seed: int = DEEPSPEC_SEED, tag: str = "", progress: bool = False) -> RoundTrace:
    """Run the drafter on chat-rendered ``prompts`` at threshold 0 and return every verification round."""
    recorder = RoundRecorder(drafter.config.block_size, tag=tag)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    encoded = [encode_chat_prompt(tokenizer, p) for p in prompts]
    gen_kwargs = {"max_new_tokens": max_new_tokens, "pad_token_id": pad, **sampling_kwargs(temperature)}
    _ensure_bound(drafter, target)
    for rows in tqdm(_batches(len(encoded), batch_size), desc=f"rounds {tag}".strip(), disable=not progress):
        ids, mask = left_pad([encoded[i] for i in rows], pad)
        _timed_generate(target, ids, mask, seed=seed + rows[0], gen_kwargs=gen_kwargs, assistant_model=drafter,
                        dspark_recorder=recorder, **FULL_PROPOSALS)
    return recorder.trace()


# ---------------------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------------------
@dataclass
class BenchmarkResult:
    """One drafter on one benchmark at one temperature."""

    drafter: str
    benchmark: str
    category: str
    temperature: float
    num_prompts: int
    stats: dict  # DSparkStats.to_dict() of the recorded rounds (tau, per-position rates, ...)
    generated_tokens: int
    speculative_seconds: float
    plain_tokens: int | None = None
    plain_seconds: float | None = None
    threshold_sweep: ThresholdSweep | None = None
    calibration: list[PositionCalibration] | None = None

    @property
    def tau(self) -> float:
        """Pooled τ; NaN when the benchmark gave no rounds (no prompts, or ``max_new_tokens`` too small for one), so
        tables show "–" and the macro means leave it out instead of averaging in a τ of 0."""
        return self.stats["tau"] if self.stats["rounds"] else float("nan")

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed drafts; NaN when the benchmark gave no rounds (for the same reason as :attr:`tau`)."""
        return self.stats["acceptance_rate"] if self.stats["rounds"] else float("nan")

    @property
    def speculative_tokens_per_second(self) -> float:
        return self.generated_tokens / self.speculative_seconds if self.speculative_seconds else float("nan")

    @property
    def plain_tokens_per_second(self) -> float | None:
        if self.plain_tokens is None or not self.plain_seconds:
            return None
        return self.plain_tokens / self.plain_seconds

    @property
    def speedup(self) -> float | None:
        plain = self.plain_tokens_per_second
        return self.speculative_tokens_per_second / plain if plain else None

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(tau=self.tau, acceptance_rate=self.acceptance_rate,
                   speculative_tokens_per_second=self.speculative_tokens_per_second,
                   plain_tokens_per_second=self.plain_tokens_per_second, speedup=self.speedup)
        return out


@dataclass
class EvalResult:
    """All results of :func:`evaluate`; ``calibration`` and ``traces`` are pooled over benchmarks per
    (drafter, temperature)."""

    settings: dict
    drafters: list[str]
    results: list[BenchmarkResult]
    calibration: dict[tuple[str, float], list[PositionCalibration]] = field(default_factory=dict)
    traces: dict[tuple[str, float], RoundTrace] = field(default_factory=dict)

    def get(self, drafter: str, benchmark: str, temperature: float) -> BenchmarkResult:
        for r in self.results:
            if (r.drafter, r.benchmark, r.temperature) == (drafter, benchmark, float(temperature)):
                return r
        raise KeyError(f"no result for drafter {drafter!r}, benchmark {benchmark!r}, T={temperature}")

    def to_dict(self) -> dict:
        return {"settings": self.settings, "drafters": self.drafters,
                "results": [r.to_dict() for r in self.results],
                "calibration": [{"drafter": d, "temperature": t, "positions": [p.to_dict() for p in report]}
                                for (d, t), report in self.calibration.items()]}

    def to_markdown(self) -> str:
        from .report import markdown_report

        return markdown_report(self)

    def save(self, out_dir: str | os.PathLike, plots: bool = True) -> dict[str, str]:
        """Write ``results.md``, ``results.json``, the rounds (``rounds_*.npz``) and PNG plots to ``out_dir``."""
        from .report import write_report

        return write_report(self, out_dir, plots=plots)


# ---------------------------------------------------------------------------------------------------------
# evaluate
# ---------------------------------------------------------------------------------------------------------
def drafter_label(drafter) -> str:
    """'DSpark' for a drafter with a sequential head, 'DFlash' for the head-less block baseline, 'Eagle3' for the
    autoregressive one (the architecture registry's label)."""
    return method_label(drafter.config)


def label_drafters(drafters: Sequence, names: Sequence[str] | None = None) -> dict[str, object]:
    """``{label: drafter}`` for :func:`evaluate`: ``names`` when given (one per drafter), else
    :func:`drafter_label`; repeated labels (two DSpark drafters) get ``#1``, ``#2`` so results stay apart."""
    labels = list(names) if names else [drafter_label(d) for d in drafters]
    if len(labels) != len(drafters):
        raise ValueError(f"{len(drafters)} drafters need {len(drafters)} names, got {len(labels)}: {labels}")
    if len(set(labels)) < len(labels):
        labels = [f"{label}#{i + 1}" for i, label in enumerate(labels)]
    return dict(zip(labels, drafters))


def _named_drafters(drafter) -> dict[str, object]:
    if isinstance(drafter, Mapping):
        if not drafter:
            raise ValueError("evaluate needs at least one drafter")
        return dict(drafter)
    return {drafter_label(drafter): drafter}


def evaluate(target, tokenizer, drafter, *, benchmarks: Sequence[str | Benchmark] = DEFAULT_BENCHMARKS,
             eval_dir: str | os.PathLike | None = None, temperatures: Sequence[float] = (0.0, 1.0),
             max_new_tokens: int = 2048, max_samples: int | None = None,
             sample_caps: Mapping[str, int] | None = None, seed: int = DEEPSPEC_SEED, batch_size: int = 1,
             measure_speedup: bool = True, thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
             progress: bool = True) -> EvalResult:
    """Evaluate one drafter, or several given as ``{name: drafter}`` (e.g. DSpark vs DFlash), on the benchmarks.

    ``max_samples`` lowers every benchmark's cap (CPU runs); ``sample_caps`` overrides caps per benchmark.
    Each call is seeded with ``seed + index of its first prompt`` (per prompt at batch size 1, as DeepSpec).
    The drafters run at confidence threshold 0 (their setting is restored afterwards); other thresholds are
    derived from those rounds by :func:`threshold_sweep`.
    With ``measure_speedup`` each batch also runs through plain ``target.generate`` (same prompts, seed,
    dtype and settings) right before the speculative runs, so both see the same machine load."""
    _raise_if_nothing_to_evaluate(benchmarks, temperatures)
    named = _named_drafters(drafter)
    for d in named.values():
        _ensure_bound(d, target)
    selected = [b if isinstance(b, Benchmark) else load_benchmark(b, eval_dir, _cap(b, max_samples, sample_caps),
                                                                   seed) for b in benchmarks]
    settings = {"benchmarks": [b.name for b in selected], "temperatures": [float(t) for t in temperatures],
                "max_new_tokens": max_new_tokens, "max_samples": max_samples, "seed": seed,
                "batch_size": batch_size, "thresholds": list(thresholds), "measure_speedup": measure_speedup,
                "target": getattr(target.config, "_name_or_path", ""), "dtype": str(target.dtype),
                "num_prompts": {b.name: len(b.prompts) for b in selected},
                "confidence_temperatures": {n: d.config.confidence_temperatures for n, d in named.items()},
                "confidence_offsets": {n: d.config.confidence_offsets for n, d in named.items()},
                "greedy_confidence_temperatures": {n: getattr(d.config, "greedy_confidence_temperatures", None)
                                                   for n, d in named.items()},
                "greedy_confidence_offsets": {n: getattr(d.config, "greedy_confidence_offsets", None)
                                              for n, d in named.items()}}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    encoded = {b.name: [encode_chat_prompt(tokenizer, p) for p in b.prompts] for b in selected}
    result = EvalResult(settings=settings, drafters=list(named), results=[])
    total = len(temperatures) * sum(len(_batches(len(v), batch_size)) for v in encoded.values())
    with tqdm(total=total, desc="evaluate", disable=not progress) as bar:
        if measure_speedup and selected and selected[0].prompts:
            _warm_up(target, named, encoded[selected[0].name][0], pad)
        for temperature in temperatures:
            gen_kwargs = {"max_new_tokens": max_new_tokens, "pad_token_id": pad, **sampling_kwargs(temperature)}
            recorders = {n: RoundRecorder(d.config.block_size) for n, d in named.items()}
            for bench in selected:
                timings = _run_benchmark(target, named, recorders, encoded[bench.name], bench.name, gen_kwargs,
                                         seed=seed, batch_size=batch_size, measure_speedup=measure_speedup, bar=bar)
                for name, d in named.items():
                    trace = recorders[name].trace().select(bench.name)
                    result.results.append(_benchmark_result(name, d, bench, temperature, trace, timings,
                                                            thresholds))
            for name, d in named.items():
                trace = recorders[name].trace()
                result.traces[(name, float(temperature))] = trace
                report = calibration_of(trace, *d.config.calibration_for(greedy=float(temperature) == 0.0))
                if report is not None:
                    result.calibration[(name, float(temperature))] = report
    return result


def _raise_if_nothing_to_evaluate(benchmarks: Sequence, temperatures: Sequence[float]) -> None:
    """Without a benchmark or a temperature there is no result to report (the report's tables would be empty and
    the per-position one has no width), so say which argument is empty before any model runs."""
    if not list(benchmarks):
        raise ValueError("evaluate needs at least one benchmark: pass benchmarks=, e.g. DEFAULT_BENCHMARKS")
    if not list(temperatures):
        raise ValueError("evaluate needs at least one temperature: pass temperatures=, e.g. (0.0, 1.0)")


def _cap(name: str, max_samples: int | None, sample_caps: Mapping[str, int] | None) -> int | None:
    cap = (sample_caps or {}).get(name, DEEPSPEC_SAMPLE_CAPS.get(name))
    if max_samples is not None:
        cap = max_samples if cap is None else min(cap, max_samples)
    return cap


def _warm_up(target, named: Mapping[str, object], prompt: list[int], pad: int) -> None:
    """One short call per path first, so one-off costs (kernel selection, allocator growth) are not timed."""
    ids, mask = left_pad([prompt], pad)
    kwargs = {"max_new_tokens": 4, "pad_token_id": pad, "do_sample": False}
    _timed_generate(target, ids, mask, seed=0, gen_kwargs=kwargs)
    for d in named.values():
        _timed_generate(target, ids, mask, seed=0, gen_kwargs=kwargs, assistant_model=d, **FULL_PROPOSALS)


def _run_benchmark(target, named, recorders, encoded, name, gen_kwargs, *, seed, batch_size, measure_speedup,
                   bar) -> dict[str, _Throughput]:
    """Plain then each drafter, batch by batch; returns tokens and seconds per path ('' = plain generate)."""
    timings = {key: _Throughput() for key in ["", *named]}
    pad = gen_kwargs["pad_token_id"]
    for rows in _batches(len(encoded), batch_size):
        ids, mask = left_pad([encoded[i] for i in rows], pad)
        if measure_speedup:
            timings[""].add(*_timed_generate(target, ids, mask, seed=seed + rows[0], gen_kwargs=gen_kwargs))
        for key, d in named.items():
            recorders[key].tag = name
            tokens, seconds = _timed_generate(target, ids, mask, seed=seed + rows[0], gen_kwargs=gen_kwargs,
                                              assistant_model=d, dspark_recorder=recorders[key], **FULL_PROPOSALS)
            timings[key].add(tokens, seconds, d.stats)
        bar.update(1)
    return timings


def _benchmark_result(name: str, drafter, bench: Benchmark, temperature: float, trace: RoundTrace,
                      timings: Mapping[str, _Throughput], thresholds: Sequence[float]) -> BenchmarkResult:
    temps, offsets = drafter.config.calibration_for(greedy=float(temperature) == 0.0)
    plain = timings[""]
    stats = trace.stats().to_dict()
    timed = timings[name].stats
    if timed is not None:  # the recorder has no clock: time split from draft.stats of the same calls
        stats.update(prefill_seconds=timed.prefill_seconds, draft_seconds=timed.draft_seconds,
                     verify_seconds=timed.verify_seconds)
    result = BenchmarkResult(
        drafter=name, benchmark=bench.name, category=bench.category, temperature=float(temperature),
        num_prompts=len(bench.prompts), stats=stats, generated_tokens=timings[name].tokens,
        speculative_seconds=timings[name].seconds, plain_tokens=plain.tokens if plain.seconds else None,
        plain_seconds=plain.seconds if plain.seconds else None,
        threshold_sweep=threshold_sweep(trace, thresholds, temps, offsets) if trace.has_confidence else None,
        calibration=calibration_of(trace, temps, offsets))
    logger.info("%s %s T=%.1f: tau %.2f over %d rounds, speedup %s", name, bench.name, temperature, result.tau,
                len(trace), f"{result.speedup:.2f}x" if result.speedup else "n/a")
    return result


__all__ = [
    "DEFAULT_THRESHOLDS",
    "BenchmarkResult",
    "EvalResult",
    "ThresholdSweep",
    "calibration_of",
    "count_new_tokens",
    "drafter_label",
    "evaluate",
    "record_rounds",
    "sampling_kwargs",
    "threshold_sweep",
]
