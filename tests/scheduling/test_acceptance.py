"""The drafter-acceptance estimators alone: the online correction of its confidences and its mean survival."""

from __future__ import annotations

import numpy as np
import pytest

from hf_dspark.scheduling.acceptance import AcceptanceCorrection, DrafterSurvival, survival_per_row


# ---------------------------------------------------------------------------------------------------------
# AcceptanceCorrection
# ---------------------------------------------------------------------------------------------------------
def test_no_correction_before_any_round():
    correction = AcceptanceCorrection()
    conf = np.full((2, 3), 0.4)
    assert correction.factors(3).tolist() == [1.0, 1.0, 1.0]
    assert correction.apply(conf) is conf


def test_factor_is_realised_over_predicted_with_a_prior_in_drafts():
    """Without decay: position 1 predicted 0.2 on 8 reached drafts, 3 accepted -> (3 + 16·0.2) / (1.6 + 16·0.2)."""
    correction = AcceptanceCorrection(decay=1.0, prior=16.0)
    conf = np.full((4, 3), 0.2)
    correction.observe(conf, np.ones(4, dtype=np.int64), np.array([1, 0, 0, 1]))
    correction.observe(conf, np.ones(4, dtype=np.int64), np.array([0, 1, 0, 0]))
    prior = 16 * 0.2
    assert correction.factors(3)[0] == pytest.approx((3 + prior) / (8 * 0.2 + prior))
    assert correction.factors(3)[1:].tolist() == [1.0, 1.0]  # verified only up to ℓ = 1: never reached
    assert correction.factors(5)[3:].tolist() == [1.0, 1.0]  # positions never observed


def test_only_verified_and_reached_drafts_count():
    """Row 0 verified 3 drafts and accepted 1: drafts 1, 2 were reached (2 was rejected), draft 3 was not. Row 1
    verified none. So position 1 saw 1 of 1 accepted, position 2 0 of 1, position 3 nothing (with a prior of one
    draft at the mean prediction 0.5: (1 + 0.5) / (0.5 + 0.5), (0 + 0.5) / (0.5 + 0.5), and 1)."""
    correction = AcceptanceCorrection(decay=1.0, prior=1.0)
    correction.observe(np.full((2, 3), 0.5), np.array([3, 0]), np.array([1, 0]))
    assert correction.factors(3).tolist() == pytest.approx([1.5, 0.5, 1.0])


def test_corrected_confidences_stay_probabilities():
    correction = AcceptanceCorrection(decay=1.0, prior=0.0)
    correction.observe(np.full((1, 2), 0.5), np.array([2]), np.array([2]))  # everything accepted: factor 2
    np.testing.assert_allclose(correction.apply(np.array([[0.7, 0.2]])), [[1.0, 0.4]])


def test_old_rounds_fade_with_the_decay():
    correction = AcceptanceCorrection(decay=0.5, prior=0.0)
    conf = np.full((1, 1), 0.5)
    correction.observe(conf, np.array([1]), np.array([0]))  # rejected
    correction.observe(conf, np.array([1]), np.array([1]))  # accepted, weighs twice the first now
    assert correction.factors(1)[0] == pytest.approx((0.5 * 0 + 1) / (0.5 * 0.5 + 0.5))


def test_a_disabled_correction_learns_nothing():
    correction = AcceptanceCorrection(enabled=False)
    correction.observe(np.full((2, 2), 0.9), np.array([2, 2]), np.array([0, 0]))
    conf = np.full((2, 2), 0.9)
    assert correction.factors(2).tolist() == [1.0, 1.0] and correction.apply(conf) is conf


# ---------------------------------------------------------------------------------------------------------
# DrafterSurvival
# ---------------------------------------------------------------------------------------------------------
def test_learning_is_counted_in_rows_and_the_first_rounds_are_a_plain_mean_over_rows():
    survival = DrafterSurvival(momentum=0.9, min_learning_rows=4)
    assert survival.is_learning and survival.mean is None
    survival.observe(np.full((3, 2), 0.5))
    assert survival.is_learning and survival.rows == 3 and survival.rounds == 1
    survival.observe(np.full((1, 2), 0.9))
    assert not survival.is_learning and survival.rows == 4 and survival.rounds == 2
    assert survival.mean.tolist() == pytest.approx([(3 * 0.5 + 0.9) / 4] * 2)  # per row, not (0.5 + 0.9) / 2


def test_later_rounds_weigh_at_least_one_minus_the_momentum():
    survival = DrafterSurvival(momentum=0.9, min_learning_rows=1)
    for _ in range(20):
        survival.observe(np.array([[1.0]]))
    survival.observe(np.array([[0.0]]))  # 1/21 of the rows, but weighs 0.1
    assert survival.mean[0] == pytest.approx(0.9)


def test_rounds_of_other_widths_align_by_zero_padding():
    survival = DrafterSurvival(momentum=0.0, min_learning_rows=1)
    survival.observe(np.array([[0.5, 0.25]]))
    survival.observe(np.array([[0.5, 0.25, 0.0, 0.0]]))  # widened by a long lookup proposal in the round
    assert survival.rounds == 2 and survival.mean.tolist() == pytest.approx([0.5, 0.25, 0.0, 0.0])
    survival.observe(np.array([[0.5]]))
    assert survival.mean.tolist() == pytest.approx([0.5, 0.0, 0.0, 0.0])


def test_the_best_is_kept_only_past_the_learning_rows():
    survival = DrafterSurvival(momentum=0.0, min_learning_rows=2)
    survival.observe(np.array([[0.9, 0.8]]))
    assert survival.best is None  # one row is no evidence of what the drafter can do
    survival.observe(np.array([[0.6, 0.3]]))
    assert survival.best.tolist() == pytest.approx([0.6, 0.3])
    survival.observe(np.array([[0.1, 0.0]]))
    assert survival.mean.tolist() == pytest.approx([0.1, 0.0]) and survival.best.tolist() == pytest.approx([0.6, 0.3])


def test_optimistic_survival_raises_each_conditional_acceptance_up_to_one():
    survival = DrafterSurvival(momentum=0.0, min_learning_rows=1)
    survival.observe(np.array([[0.8, 0.4, 0.1]]))  # conditionals 0.8, 0.5, 0.25
    assert survival.optimistic(1.0).tolist() == pytest.approx([0.8, 0.4, 0.1])
    assert survival.optimistic(1.5).tolist() == pytest.approx([1.0, 0.75, 0.75 * 0.375])
    survival.observe(np.array([[0.2, 0.0, 0.0]]))  # the text changed: the best shown still sets the aim
    assert survival.optimistic(1.0).tolist() == pytest.approx([0.8, 0.4, 0.1])


def test_survival_per_row_is_zero_past_each_rows_cap():
    rows = survival_per_row(np.array([0.9, 0.5, 0.2]), 3, np.array([3, 1, 0]))
    np.testing.assert_array_equal(rows, [[0.9, 0.5, 0.2], [0.9, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert survival_per_row(np.array([0.9]), 2, None).tolist() == [[0.9], [0.9]]
