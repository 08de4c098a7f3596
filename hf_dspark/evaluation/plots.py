"""PNG figures in the style of the paper: reliability diagrams (Fig. 6), the static threshold sweep (Fig. 5),
the serving throughput/latency frontier (Figs. 7–8) and per-position acceptance.

matplotlib is an optional extra (``pip install hf-dspark[plots]``) and is imported only when a plot is drawn.
We build figures with the object-oriented API on an Agg canvas and never import ``pyplot``: no global figure
state, safe from worker threads, and the caller's interactive backend is left alone.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..training.calibration import ReliabilityCurve

logger = logging.getLogger(__name__)


def _new_figure(num_panels: int, *, panel_size: tuple[float, float] = (4.0, 3.6), max_columns: int = 4):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("plots need matplotlib: pip install 'hf-dspark[plots]'") from err
    columns = min(num_panels, max_columns)
    rows = math.ceil(num_panels / columns)
    fig = Figure(figsize=(panel_size[0] * columns, panel_size[1] * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax in axes[num_panels:]:
        ax.set_visible(False)
    return fig, list(axes[:num_panels])


def _save(fig, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=120)
    logger.info("wrote %s", path)
    return path


def _legend(ax, **kwargs) -> None:
    if ax.get_legend_handles_labels()[0]:  # an empty legend only draws a warning
        ax.legend(**kwargs)


def _as_curve(curve: ReliabilityCurve | Mapping) -> ReliabilityCurve:
    return curve if isinstance(curve, ReliabilityCurve) else ReliabilityCurve(**curve)


def _curve_ece(curve: ReliabilityCurve) -> float:
    total = sum(curve.counts)
    return sum(n * abs(p - o) for n, p, o in zip(curve.counts, curve.mean_predicted, curve.observed_rate)
               if n) / total if total else float("nan")


def _draw_curve(ax, curve: ReliabilityCurve, label: str, color: str, marker: str, min_count: int) -> None:
    # Bins with very few rounds are noise (a single round plots at 0 or 1); they still count in the ECE.
    points = [(p, o) for n, p, o in zip(curve.counts, curve.mean_predicted, curve.observed_rate)
              if n >= max(min_count, 1)]
    if points:
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker=marker, color=color, label=f"{label} (ECE {100 * _curve_ece(curve):.1f}%)")


def plot_reliability(curves_before: Sequence[ReliabilityCurve | Mapping],
                     curves_after: Sequence[ReliabilityCurve | Mapping] | None, path: str | os.PathLike, *,
                     positions: Sequence[int] | None = None, title: str | None = None,
                     min_count: int = 5) -> Path:
    """Reliability diagrams of the joint survival a_k, one panel per draft position, raw vs after STS
    (paper Fig. 6). Curves come from ``training.calibration.reliability_curve`` (or their dict form);
    bins with fewer than ``min_count`` rounds are not drawn."""
    before = [_as_curve(c) for c in curves_before]
    after = [_as_curve(c) for c in curves_after] if curves_after is not None else [None] * len(before)
    if len(after) != len(before) or not before:
        raise ValueError(f"need one 'after' curve per 'before' curve, got {len(before)} and {len(after)}")
    positions = list(positions) if positions is not None else list(range(1, len(before) + 1))
    fig, axes = _new_figure(len(before))
    for ax, pos, raw, calibrated in zip(axes, positions, before, after):
        ax.plot([0, 1], [0, 1], linestyle="--", color="grey", linewidth=1)
        _draw_curve(ax, raw, "raw", "tab:red", "o", min_count)
        if calibrated is not None:
            _draw_curve(ax, calibrated, "STS", "tab:blue", "s", min_count)
        ax.set(xlim=(0, 1), ylim=(0, 1), title=f"position {pos}", xlabel="predicted prefix survival",
               ylabel="observed acceptance")
        _legend(ax, loc="upper left", fontsize="small")
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_threshold_sweep(thresholds: Sequence[float], acceptance_rate: Mapping[str, Sequence[float]],
                         verified_per_step: Mapping[str, Sequence[float]], path: str | os.PathLike, *,
                         tau: Mapping[str, Sequence[float]] | None = None, title: str | None = None) -> Path:
    """Static confidence-threshold sweep per benchmark (paper Fig. 5): acceptance rate of verified drafts and
    drafts verified per step (and τ when given) as the threshold rises."""
    panels = [("acceptance rate of verified drafts", acceptance_rate),
              ("drafts verified per step", verified_per_step)]
    if tau is not None:
        panels.append(("τ (tokens per step, incl. bonus)", tau))
    fig, axes = _new_figure(len(panels))
    for ax, (label, series) in zip(axes, panels):
        for name, values in series.items():
            _check_aligned(name, values, thresholds)
            ax.plot(list(thresholds), list(values), marker="o", label=name)
        ax.set(xlabel="confidence threshold", ylabel=label)
        ax.grid(alpha=0.3)
        _legend(ax, fontsize="small")
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def _check_aligned(name: str, values: Sequence, reference: Sequence) -> None:
    if len(values) != len(reference):
        raise ValueError(f"series {name!r} has {len(values)} points but there are {len(reference)} x values")


def _get(record: Any, key: str, default: Any = None) -> Any:
    return record.get(key, default) if isinstance(record, Mapping) else getattr(record, key, default)


def plot_throughput_frontier(results: Sequence[Mapping | Any], path: str | os.PathLike, *,
                             title: str | None = None) -> Path:
    """Serving frontier (paper Figs. 7–8). ``results``: one record per (policy, concurrency) with keys
    ``policy``, ``concurrency``, ``throughput`` (tok/s), ``per_user_tps`` and optionally ``mean_verify_budget``
    (drafts verified per request per step). Left: per-user tok/s against total throughput, one line per
    policy through increasing concurrency (up-right is better). Right: mean verify budget vs concurrency."""
    if not results:
        raise ValueError("plot_throughput_frontier needs at least one result")
    by_policy: dict[str, list] = {}
    for record in results:
        by_policy.setdefault(str(_get(record, "policy")), []).append(record)
    has_budget = any(_get(r, "mean_verify_budget") is not None for r in results)
    fig, axes = _new_figure(2 if has_budget else 1, panel_size=(5.0, 4.0))
    for policy, records in by_policy.items():
        records = sorted(records, key=lambda r: _get(r, "concurrency"))
        xs = [_get(r, "throughput") for r in records]
        ys = [_get(r, "per_user_tps") for r in records]
        line = axes[0].plot(xs, ys, marker="o", label=policy)[0]
        for r, x, y in zip(records, xs, ys):
            axes[0].annotate(str(_get(r, "concurrency")), (x, y), textcoords="offset points", xytext=(3, 3),
                             fontsize="x-small", color=line.get_color())
        if has_budget:
            budget = [(_get(r, "concurrency"), _get(r, "mean_verify_budget")) for r in records
                      if _get(r, "mean_verify_budget") is not None]
            if budget:
                axes[1].plot(*zip(*budget), marker="o", label=policy, color=line.get_color())
    axes[0].set(xlabel="throughput (tok/s)", ylabel="per-user tok/s")
    axes[0].grid(alpha=0.3)
    _legend(axes[0], fontsize="small")
    if has_budget:
        axes[1].set(xlabel="concurrency", ylabel="mean verify budget (drafts / request / step)")
        axes[1].set_xscale("log", base=2)
        axes[1].grid(alpha=0.3)
        _legend(axes[1], fontsize="small")
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_position_acceptance(conditional: Mapping[str, Sequence[float]], path: str | os.PathLike, *,
                             unconditional: Mapping[str, Sequence[float]] | None = None,
                             title: str | None = None) -> Path:
    """Acceptance per draft position for each series (benchmark or drafter): conditional P(k accepted | < k
    accepted) and, when given, unconditional P(1..k accepted)."""
    panels = [("conditional acceptance", conditional)]
    if unconditional is not None:
        panels.append(("unconditional (prefix) acceptance", unconditional))
    fig, axes = _new_figure(len(panels))
    for ax, (label, series) in zip(axes, panels):
        for name, values in series.items():
            ax.plot(range(1, len(values) + 1), list(values), marker="o", label=name)
        ax.set(xlabel="draft position", ylabel=label, ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        _legend(ax, fontsize="small")
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def _curve_kind(row: Mapping) -> str:
    if row.get("cool_down_steps"):
        return "cooled"
    return "whole" if row.get("sequential_top_k") == 0 else "top-64"


def draft_vocabulary_changes(rows: Sequence[Mapping]) -> list[tuple[float, int]]:
    """(training tokens, new size) wherever a curve row records a draft vocabulary other than the row before it
    (a row without ``draft_vocab_size`` predates the field): where a widened vocabulary starts."""
    return [(row["train_tokens"], row["draft_vocab_size"]) for before, row in zip(rows, rows[1:])
            if row.get("draft_vocab_size") is not None and row["draft_vocab_size"] != before.get("draft_vocab_size")]


def plot_training_curve(rows: Sequence[Mapping], path: str | os.PathLike, *,
                        reference: Mapping[str, float] | None = None, title: str | None = None) -> Path:
    """Held-out τ (greedy, full block) against training tokens, one line per prompt set: the record of a continuous
    training run (rows of its ``curve.jsonl``). Cooled-down copies are stars; rows scored with the sequential bias
    over the whole draft vocabulary (``sequential_top_k`` 0; rows without the field used the base top-64) are their
    own line, so a change of scoring is not read as training; a dotted vertical line marks each change of draft
    vocabulary. ``reference``: τ per prompt set of a drafter to beat (dashed)."""
    fig, (ax,) = _new_figure(1, panel_size=(6.0, 3.8))
    sets = sorted({name for row in rows for name in row["heldout"]})
    for name, color in zip(sets, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        kinds = (("top-64", name, {"marker": "o"}),
                 ("cooled", f"{name}: cooled-down copy", {"marker": "*", "markersize": 11, "linestyle": ""}),
                 ("whole", f"{name}: bias over the whole vocabulary", {"marker": "D", "linestyle": ":"}))
        for kind, label, style in kinds:
            points = [(row["train_tokens"] / 1e6, row["heldout"][name]["tau_greedy"]) for row in rows
                      if name in row["heldout"] and _curve_kind(row) == kind]
            if points:
                ax.plot([x for x, _ in points], [y for _, y in points], color=color, label=label, **style)
        if reference and name in reference:
            ax.axhline(reference[name], color=color, linestyle="--", alpha=0.6, label=f"{name}: shipped drafter")
    for tokens, size in draft_vocabulary_changes(rows):
        ax.axvline(tokens / 1e6, color="gray", linestyle=":", alpha=0.8)
        ax.annotate(f"draft vocab. {size:,}", (tokens / 1e6, 0.02), xycoords=("data", "axes fraction"),
                    rotation=90, fontsize="x-small", color="gray", ha="right", va="bottom")
    ax.set(xlabel="training tokens (millions, all sessions)", ylabel="held-out τ (greedy, full block)")
    ax.grid(alpha=0.3)
    _legend(ax, fontsize="small")
    if title:
        ax.set_title(title)
    return _save(fig, path)


__all__ = ["draft_vocabulary_changes", "plot_position_acceptance", "plot_reliability", "plot_threshold_sweep",
           "plot_throughput_frontier", "plot_training_curve"]
