"""Write an :class:`~hf_dspark.evaluation.harness.EvalResult` as markdown tables, JSON and PNG figures.

Tables: τ / acceptance / speedup per benchmark × temperature (with the τ ratio of the first drafter to each other
one, e.g. DSpark vs DFlash and vs Eagle3), per-position acceptance, the static threshold sweep and per-position calibration.
JSON holds every number (NaN written as null); ``rounds_<drafter>_T<t>.npz`` hold the raw rounds.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path

from ..training.calibration import PositionCalibration

logger = logging.getLogger(__name__)


def _fmt(x, spec: str = ".2f", suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:{spec}}{suffix}"


def _pct(x) -> str:
    return _fmt(None if x is None else 100 * x, ".1f", "%")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _mean(values) -> float | None:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else None


def _tau_table(result) -> str:
    names = result.drafters
    header = ["benchmark", "T", "prompts"] + [f"τ {n}" for n in names]
    header += [f"τ {names[0]}/{n}" for n in names[1:]]
    header += [f"accept {n}" for n in names] + ["tok/s plain"] + [f"tok/s {n}" for n in names] \
        + [f"speedup {n}" for n in names]
    rows = []
    for temperature in result.settings["temperatures"]:
        per_bench = [[result.get(n, b, temperature) for n in names] for b in result.settings["benchmarks"]]
        for group in per_bench:
            rows.append(_row(group, group[0].benchmark, temperature, str(group[0].num_prompts)))
        if len(per_bench) > 1:
            rows.append(_mean_row(per_bench, temperature))
    return _table(header, rows)


def _row(group, benchmark: str, temperature: float, prompts: str) -> list[str]:
    row = [benchmark, _fmt(temperature, "g"), prompts] + [_fmt(r.tau) for r in group]
    row += [_fmt(group[0].tau / other.tau if other.tau else None) for other in group[1:]]
    row += [_pct(r.acceptance_rate) for r in group] + [_fmt(group[0].plain_tokens_per_second, ".1f")]
    row += [_fmt(r.speculative_tokens_per_second, ".1f") for r in group]
    row += [_fmt(r.speedup, ".2f", "×") for r in group]
    return row


def _mean_row(per_bench, temperature: float) -> list[str]:
    """Macro average over benchmarks (each benchmark weighs the same, as the paper's averages)."""
    n = len(per_bench[0])
    taus = [_mean([g[i].tau for g in per_bench]) for i in range(n)]
    row = ["**mean**", _fmt(temperature, "g"), str(sum(g[0].num_prompts for g in per_bench))]
    row += [_fmt(t) for t in taus]
    row += [_fmt(taus[0] / other if taus[0] and other else None) for other in taus[1:]]
    row += [_pct(_mean([g[i].acceptance_rate for g in per_bench])) for i in range(n)]
    row += [_fmt(_mean([g[0].plain_tokens_per_second for g in per_bench]), ".1f")]
    row += [_fmt(_mean([g[i].speculative_tokens_per_second for g in per_bench]), ".1f") for i in range(n)]
    row += [_fmt(_mean([g[i].speedup for g in per_bench]), ".2f", "×") for i in range(n)]
    return row


def _position_table(result) -> str:
    gamma = max(len(r.stats["conditional_acceptance"]) for r in result.results)
    header = ["drafter", "benchmark", "T", "rate"] + [f"k={k}" for k in range(1, gamma + 1)]
    rows = []
    for r in result.results:
        for label, key in (("conditional", "conditional_acceptance"), ("unconditional", "unconditional_acceptance")):
            rows.append([r.drafter, r.benchmark, _fmt(r.temperature, "g"), label]
                        + [_fmt(v) for v in r.stats[key]])
    return _table(header, rows)


def _sweep_table(result) -> str | None:
    swept = [r for r in result.results if r.threshold_sweep is not None]
    if not swept:
        return None
    thresholds = swept[0].threshold_sweep.thresholds
    header = ["drafter", "benchmark", "T"] + [f"t={t:g}" for t in thresholds]
    rows = [[r.drafter, r.benchmark, _fmt(r.temperature, "g")]
            + [f"{_pct(a)} · {_fmt(d, '.1f')}" for a, d in zip(r.threshold_sweep.acceptance_rate,
                                                              r.threshold_sweep.drafts_per_round)]
            for r in swept]
    return _table(header, rows)


def calibration_table(reports: dict[str, list[PositionCalibration]]) -> str:
    """One row per (label, position): rounds, realised prefix acceptance, ECE and AUC raw vs STS, T_k (and b_k when
    any position has an offset; and the ECE noise floor of the STS confidences when it was computed)."""
    with_offsets = any(p.offset for report in reports.values() for p in report)
    with_floor = any(math.isfinite(p.ece_noise_floor) for report in reports.values() for p in report)
    header = ["run", "position", "rounds", "acceptance", "ECE raw", "ECE STS"] + (["ECE floor"] if with_floor else [])
    header += ["AUC raw", "AUC STS", "T_k"] + (["b_k"] if with_offsets else [])
    rows = []
    for label, report in reports.items():
        for p in report:
            rows.append([label, str(p.position), str(p.num_rounds), _pct(p.acceptance_rate), _pct(p.ece_before),
                         _pct(p.ece_after)] + ([_pct(p.ece_noise_floor)] if with_floor else [])
                        + [_fmt(p.auc_before, ".3f"), _fmt(p.auc_after, ".3f"), _fmt(p.temperature, ".3f")]
                        + ([f"{p.offset:+.2f}"] if with_offsets else []))
    return _table(header, rows)


def markdown_report(result) -> str:
    s = result.settings
    parts = ["## Accepted length τ and speedup",
             f"τ = tokens committed per verification round **including** the bonus token, pooled over rounds; "
             f"max_new_tokens {s['max_new_tokens']}, batch size {s['batch_size']}, seed {s['seed']}, "
             f"confidence threshold 0 (full γ), target dtype {s['dtype']}. Speedup = speculative tok/s ÷ plain "
             f"`generate` tok/s on the same prompts.", "", _tau_table(result), "",
             "## Per-position acceptance", "", _position_table(result)]
    sweep = _sweep_table(result)
    if sweep:
        parts += ["", "## Static confidence-threshold sweep (acceptance of verified drafts · drafts per round)",
                  "", sweep]
    if result.calibration:
        parts += ["", "## Confidence calibration (joint survival a_k; 'STS' = the drafter's temperatures and offsets)", "",
                  calibration_table({f"{d} T={t:g}": rep for (d, t), rep in result.calibration.items()})]
    return "\n".join(parts) + "\n"


def to_json_safe(obj):
    """NaN / inf become null: strict JSON readers (browsers, jq) reject NaN."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): to_json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json_safe(v) for v in obj]
    return obj


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


def write_report(result, out_dir: str | os.PathLike, plots: bool = True) -> dict[str, str]:
    """results.md, results.json, rounds_*.npz and (``plots``) PNGs; returns {name: path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {"markdown": out / "results.md", "json": out / "results.json"}
    written["markdown"].write_text(markdown_report(result), encoding="utf-8")
    written["json"].write_text(json.dumps(to_json_safe(result.to_dict()), indent=2), encoding="utf-8")
    for (name, t), trace in result.traces.items():
        written[f"rounds {name} T={t:g}"] = trace.save(out / f"rounds_{_slug(name)}_T{t:g}.npz")
    if plots:
        written.update(_write_plots(result, out))
    logger.info("evaluation written to %s", out)
    return {k: str(v) for k, v in written.items()}


def _write_plots(result, out: Path) -> dict[str, Path]:
    from .plots import plot_position_acceptance, plot_threshold_sweep

    written = {}
    for t in result.settings["temperatures"]:
        rows = [r for r in result.results if r.temperature == t]
        multi = len(result.drafters) > 1
        label = (lambda r: f"{r.drafter} {r.benchmark}") if multi else (lambda r: r.benchmark)
        written[f"position acceptance T={t:g}"] = plot_position_acceptance(
            {label(r): r.stats["conditional_acceptance"] for r in rows}, out / f"position_acceptance_T{t:g}.png",
            unconditional={label(r): r.stats["unconditional_acceptance"] for r in rows},
            title=f"per-position acceptance, T={t:g}")
        for name in result.drafters:
            swept = [r for r in rows if r.drafter == name and r.threshold_sweep is not None]
            if swept:
                thresholds = swept[0].threshold_sweep.thresholds
                written[f"threshold sweep {name} T={t:g}"] = plot_threshold_sweep(
                    thresholds, {r.benchmark: r.threshold_sweep.acceptance_rate for r in swept},
                    {r.benchmark: r.threshold_sweep.drafts_per_round for r in swept},
                    out / f"threshold_sweep_{_slug(name)}_T{t:g}.png",
                    tau={r.benchmark: r.threshold_sweep.tau for r in swept},
                    title=f"{name}: static confidence threshold, T={t:g}")
            report = result.calibration.get((name, t))
            if report:
                written[f"reliability {name} T={t:g}"] = write_reliability(
                    report, out / f"reliability_{_slug(name)}_T{t:g}.png", title=f"{name}, T={t:g}")
    return written


def write_reliability(report: Sequence[PositionCalibration], path: str | os.PathLike, title: str | None = None):
    """Reliability diagrams raw vs STS; the STS curves are left out when every T_k is 1 and b_k 0 (nothing
    calibrated)."""
    from .plots import plot_reliability

    calibrated = any(abs(p.temperature - 1.0) > 1e-12 or p.offset for p in report)
    return plot_reliability([p.curve_before for p in report], [p.curve_after for p in report] if calibrated
                            else None, path, positions=[p.position for p in report], title=title)


__all__ = ["calibration_table", "markdown_report", "to_json_safe", "write_reliability", "write_report"]
