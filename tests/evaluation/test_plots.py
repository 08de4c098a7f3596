"""Each figure writer produces a non-empty PNG from small data (and rejects malformed input by message)."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from hf_dspark.evaluation import (  # noqa: E402
    plot_position_acceptance,
    plot_reliability,
    plot_threshold_sweep,
    plot_throughput_frontier,
)
from hf_dspark.training.calibration import calibration_report  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 2000


def test_plot_reliability(tmp_path):
    logits = [[3.0, 2.0], [-1.0, 4.0], [2.0, -3.0], [0.5, 0.5], [4.0, 4.0], [-2.0, 1.0]]
    report = calibration_report(logits, [2, 0, 1, 1, 2, 0], temperatures=[2.0, 2.0], bins=5)
    path = plot_reliability([r.curve_before for r in report], [r.curve_after.__dict__ for r in report],
                            tmp_path / "fig6" / "reliability.png", title="tiny", min_count=1)
    assert_png(path)
    assert_png(plot_reliability([report[0].curve_before], None, tmp_path / "raw_only.png"))
    with pytest.raises(ValueError, match="one 'after' curve per 'before' curve"):
        plot_reliability([report[0].curve_before], [], tmp_path / "bad.png")


def test_plot_threshold_sweep(tmp_path):
    thresholds = [0.0, 0.2, 0.4, 0.6, 0.8]
    path = plot_threshold_sweep(thresholds, {"math": [0.77, 0.8, 0.85, 0.9, 0.93], "chat": [0.46, 0.6, 0.75, 0.9, 0.96]},
                                {"math": [7, 6.5, 5.8, 4.9, 3.5], "chat": [7, 5, 3.6, 2.2, 1.1]},
                                tmp_path / "sweep.png", tau={"math": [5.2, 5.1, 4.9, 4.3, 3.4], "chat": [3, 3, 2.8, 2.1, 1.5]})
    assert_png(path)
    with pytest.raises(ValueError, match="'chat' has 2 points but there are 5 x values"):
        plot_threshold_sweep(thresholds, {"chat": [0.5, 0.6]}, {}, tmp_path / "bad.png")


def test_plot_throughput_frontier(tmp_path):
    results = [{"policy": policy, "concurrency": c, "throughput": c * base / (1 + c / 16),
                "per_user_tps": base / (1 + c / 16), "mean_verify_budget": budget / c ** 0.5}
               for policy, base, budget in (("none", 40, 0), ("fixed-3", 70, 3), ("scheduled", 90, 7))
               for c in (1, 2, 4, 8, 16)]
    assert_png(plot_throughput_frontier(results, tmp_path / "frontier.png", title="tiny"))
    no_budget = [{k: v for k, v in r.items() if k != "mean_verify_budget"} for r in results]
    assert_png(plot_throughput_frontier(no_budget, tmp_path / "frontier_only.png"))
    with pytest.raises(ValueError, match="at least one result"):
        plot_throughput_frontier([], tmp_path / "bad.png")


def test_plot_position_acceptance(tmp_path):
    conditional = {"DSpark": [0.9, 0.85, 0.8, 0.78], "DFlash": [0.9, 0.75, 0.65, 0.6]}
    unconditional = {"DSpark": [0.9, 0.77, 0.61, 0.48], "DFlash": [0.9, 0.68, 0.44, 0.26]}
    assert_png(plot_position_acceptance(conditional, tmp_path / "acc.png", unconditional=unconditional))
    assert_png(plot_position_acceptance(conditional, tmp_path / "acc_cond.png"))


def test_plot_training_curve(tmp_path):
    from hf_dspark.evaluation.plots import plot_training_curve

    rows = [{"train_tokens": t, "heldout": {"chat": {"tau_greedy": 1.3 + t / 1e7}, "code": {"tau_greedy": 1.4}}}
            for t in (0, 2e5, 4e5)]
    cooled = {"train_tokens": 5e5, "cool_down_steps": 150, "heldout": {"chat": {"tau_greedy": 1.36},
                                                                         "code": {"tau_greedy": 1.43}}}
    widened = {"train_tokens": 6e5, "draft_vocab_size": 12, "heldout": {"chat": {"tau_greedy": 1.37},
                                                                        "code": {"tau_greedy": 1.44}}}
    out = plot_training_curve(rows + [cooled, widened], tmp_path / "curve.png",
                              reference={"chat": 1.42, "code": 1.45}, title="held-out τ")
    assert_png(out)


def test_draft_vocabulary_changes_mark_where_a_wider_vocabulary_starts():
    from hf_dspark.evaluation.plots import draft_vocabulary_changes

    rows = [{"train_tokens": 1}, {"train_tokens": 2}, {"train_tokens": 3, "draft_vocab_size": 12},
            {"train_tokens": 4, "draft_vocab_size": 12}, {"train_tokens": 5, "draft_vocab_size": 16}]
    assert draft_vocabulary_changes(rows) == [(3, 12), (5, 16)]
    assert draft_vocabulary_changes(rows[2:4]) == []
