"""bench_fusion's A/B summary: geometric means over workloads of the ratios a drafter comparison is judged by."""

from __future__ import annotations

import math

import pytest
from test_wrappers import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_fusion")


def rows_of(speeds: dict[tuple[str, str], float], temperature: float = 0.0) -> list[dict]:
    return [{"T": temperature, "workload": w, "arm": a, "tok_s": v} for (w, a), v in speeds.items()]


def test_ratio_lines_are_geometric_means_over_workloads(bench):
    speeds = {("chat", "plain"): 10.0, ("chat", "fused"): 20.0, ("chat", "fused, compared drafter"): 10.0,
              ("code", "plain"): 10.0, ("code", "fused"): 10.0, ("code", "fused, compared drafter"): 20.0,
              ("chat", "lookup only"): 16.0, ("code", "lookup only"): 25.0}
    lines = bench.ratio_lines(rows_of(speeds))
    # 2.0 and 0.5: the geometric mean is 1, where an arithmetic mean would claim +25 %
    assert lines[0] == "T = 0: fused ÷ fused, compared drafter: 1.000 (0.50-2.00) over 2 workloads"
    expected = math.sqrt(20 / 16 * 10 / 25)
    assert lines[1] == f"T = 0: fused ÷ lookup only: {expected:.3f} (0.40-1.25) over 2 workloads"
    assert len(lines) == 2  # pairs whose arms did not run are left out


def test_ratio_lines_keep_temperatures_apart(bench):
    rows = rows_of({("chat", "fused"): 30.0, ("chat", "lookup only"): 15.0}, 0.0)
    rows += rows_of({("chat", "fused"): 10.0, ("chat", "lookup only"): 20.0}, 1.0)
    assert bench.ratio_lines(rows) == ["T = 0: fused ÷ lookup only: 2.000 (2.00-2.00) over 1 workload",
                                       "T = 1: fused ÷ lookup only: 0.500 (0.50-0.50) over 1 workload"]
