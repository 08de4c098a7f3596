"""Markdown report: the τ table's rows and macro means, checked on hand-built results."""

from __future__ import annotations

import math

import pytest

from hf_dspark.evaluation.harness import BenchmarkResult, EvalResult, evaluate
from hf_dspark.evaluation.recorder import RoundTrace
from hf_dspark.evaluation.report import markdown_report

SETTINGS = {"benchmarks": ["gsm8k", "mt-bench"], "temperatures": [0.0], "max_new_tokens": 8, "batch_size": 1,
            "seed": 0, "dtype": "float32"}


def _tau_rows(markdown: str) -> dict[str, list[str]]:
    table = markdown.split("## Per-position acceptance")[0]
    rows = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells] for cells in rows[1:]}


def test_a_benchmark_without_rounds_has_no_tau_and_stays_out_of_the_mean():
    # gsm8k: rounds accepting 2 of 3 and 0 of 3 drafts -> τ = (3 + 1) / 2 = 2.00, acceptance 2 / 6 = 33.3 %.
    # mt-bench: no prompts, so no rounds: its τ is unknown, not 0, and the macro mean is gsm8k's alone.
    rounds = RoundTrace.from_rounds([3, 3], [2, 0], block_size=3).stats().to_dict()
    none = RoundTrace.from_rounds([], [], block_size=3).stats().to_dict()
    results = [BenchmarkResult("DSpark", "gsm8k", "math", 0.0, 2, rounds, 8, 1.0, 8, 2.0),
               BenchmarkResult("DSpark", "mt-bench", "chat", 0.0, 0, none, 0, 0.0)]
    assert math.isnan(results[1].tau) and math.isnan(results[1].acceptance_rate)
    rows = _tau_rows(markdown_report(EvalResult(SETTINGS, ["DSpark"], results)))
    # benchmark | T | prompts | τ | accept | tok/s plain | tok/s DSpark | speedup
    assert rows["gsm8k"][3:5] == ["2.00", "33.3%"]
    assert rows["mt-bench"][3:5] == ["–", "–"]
    assert rows["**mean**"][3:5] == ["2.00", "33.3%"]
    assert results[1].to_dict()["tau"] != results[1].to_dict()["tau"]  # NaN, written as null in results.json


def test_evaluate_refuses_empty_benchmarks_or_temperatures():
    # Checked before any model is touched: an empty run used to end in "max() arg is an empty sequence" when the
    # report was written.
    with pytest.raises(ValueError, match="at least one benchmark"):
        evaluate(None, None, object(), benchmarks=[])
    with pytest.raises(ValueError, match="at least one temperature"):
        evaluate(None, None, object(), benchmarks=["gsm8k"], temperatures=())
