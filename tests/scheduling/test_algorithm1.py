"""Algorithm 1's walks on hand-made tables: the admission walk on SPS(B), the width walk on the padded step cost."""

from __future__ import annotations

import numpy as np
import pytest

from hf_dspark.scheduling import SPSProfile, StepCostProfile
from hf_dspark.scheduling.algorithm1 import (
    admission_order,
    padded_width_path,
    prefix_survival,
    throughput_path,
    walk_admissions,
    walk_widths,
)

HAND_CONF = [[0.9, 0.8, 0.5], [0.6, 0.5, 0.9]]  # a = [[.9, .72, .36], [.6, .3, .27]]
HAND_SPS = SPSProfile.from_user_table({2: 1.0, 3: 0.95, 4: 0.9, 5: 0.7, 6: 0.6, 7: 0.5, 8: 0.45})


def test_the_admission_walk_stops_at_the_first_admission_that_does_not_improve_theta():
    # Θ0..Θ6 = 2, 2.755, 3.258, 2.954, ...: (0,1) and (0,2) go in, (1,1) would lower Θ
    lengths, theta = walk_admissions(prefix_survival(np.array(HAND_CONF)), HAND_SPS)
    assert lengths.tolist() == [2, 0] and theta == pytest.approx(3.258)
    _, _, values = admission_order(prefix_survival(np.array(HAND_CONF)))
    assert theta == throughput_path(values, 2, HAND_SPS).max()


def test_the_width_walk_breaks_at_a_dip_unless_every_row_is_greedy():
    theta = np.array([1.0, 0.9, 1.5, 1.2])  # verifying one draft costs a dip that two drafts more than repay
    assert walk_widths(theta) == 0  # the break: lossless for sampled rows
    assert walk_widths(theta, all_greedy=True) == 2  # greedy rows verify exactly: the best width outright
    assert walk_widths(np.array([1.0, 1.1, 1.2])) == 2  # improving all the way: the widest


def test_the_padded_path_covers_only_the_widths_the_table_measured():
    cost = StepCostProfile((1, 4), (1, 2, 3), ((0.1, 0.1, 0.2), (0.2, 0.2, 0.4)), (0.0, 0.0))
    survival = prefix_survival(np.full((2, 6), 0.9))
    path = padded_width_path(survival, cost)
    assert path.shape == (3,)  # widths 1..3: up to 2 drafts, whatever the rows proposed
    np.testing.assert_array_equal(path, padded_width_path(survival[:, :2], cost))
    tau = 2 + np.concatenate([[0.0], np.cumsum(survival[:, :2].sum(axis=0))])
    assert path == pytest.approx(tau / cost.verify_widths(2))
    factors = np.array([1.0, 2.0, 2.0, 2.0, 2.0])  # longer than the path: read as far as it goes
    assert padded_width_path(survival, cost, step_factors=factors) == pytest.approx(path / factors[:3])
