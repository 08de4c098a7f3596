"""STS calibration and the ECE / AUC / reliability metrics on hand cases and synthetic over-confident heads."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from hf_dspark.training.calibration import (
    auc,
    calibration_report,
    cumulative_confidence,
    default_temperature_grid,
    ece_noise_floor,
    expected_calibration_error,
    fit_sts,
    fit_sts_with_offsets,
    prefix_labels,
    reliability_curve,
    split_half_ece,
)


def brute_force_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_ece_by_hand():
    # bin [0.1, 0.2): mean p .1 vs freq .5 -> .4·2/4; bin [0.9, 1.0]: .9 vs 1 -> .1·2/4
    assert expected_calibration_error([0.1, 0.1, 0.9, 0.9], [0, 1, 1, 1], bins=10) == pytest.approx(0.25)
    assert expected_calibration_error([1.0, 1.0, 0.0], [1, 1, 0]) == pytest.approx(0.0)  # p = 1 in the last bin
    assert expected_calibration_error([0.3] * 10, [1] * 3 + [0] * 7) == pytest.approx(0.0)
    assert expected_calibration_error([0.95, 0.85], [0, 0], bins=1) == pytest.approx(0.9)
    assert np.isnan(expected_calibration_error([], []))


def test_reliability_curve_by_hand():
    curve = reliability_curve([0.1, 0.15, 0.9, 0.95], [0, 1, 1, 1], bins=2)
    assert curve.bin_edges == [0.0, 0.5, 1.0] and curve.counts == [2, 2] and curve.num_samples == 4
    assert curve.mean_predicted == pytest.approx([0.125, 0.925]) and curve.observed_rate == pytest.approx([0.5, 1.0])
    empty = reliability_curve([0.9], [1], bins=4)
    assert np.isnan(empty.mean_predicted[0]) and empty.counts == [0, 0, 0, 1]


def test_auc_by_hand_and_against_pair_counting():
    assert auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert auc([0.5, 0.5], [0, 1]) == pytest.approx(0.5)
    assert auc([0.2, 0.5, 0.5, 0.9], [0, 0, 1, 1]) == pytest.approx(0.875)
    assert auc([0.9, 0.1], [1, 0]) == 1.0 and auc([0.9, 0.1], [0, 1]) == 0.0
    assert np.isnan(auc([0.3, 0.4], [1, 1]))
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 6, 60) / 5.0  # many ties
    labels = rng.integers(0, 2, 60)
    assert auc(scores, labels) == pytest.approx(brute_force_auc(scores, labels), abs=1e-12)


def test_metric_input_checks():
    with pytest.raises(ValueError, match="same length"):
        expected_calibration_error([0.1, 0.2], [1])
    with pytest.raises(ValueError, match=r"probabilities in \[0, 1\]"):
        expected_calibration_error([1.5], [1])
    with pytest.raises(ValueError, match="labels must be 0/1"):
        auc([0.1, 0.2], [0, 2])


def test_prefix_labels_and_cumulative_confidence():
    labels, valid = prefix_labels([0, 2, 3], [3, 2, 3], gamma=3)
    assert labels.tolist() == [[False, False, False], [True, True, False], [True, True, True]]
    assert valid.tolist() == [[True, True, True], [True, True, False], [True, True, True]]
    z = torch.tensor([[0.0, 0.0], [2.0, -2.0]])
    s2 = 1 / (1 + np.exp(-1.0))  # σ(2 / 2)
    assert cumulative_confidence(z, [1.0, 1.0])[0].tolist() == pytest.approx([0.5, 0.25])
    assert cumulative_confidence(z, [2.0, 2.0])[1].tolist() == pytest.approx([s2, s2 * (1 - s2)])


def synthetic_rounds(num_rounds=20000, gamma=4, inflate=3.0, seed=0):
    """True conditional survival c_k = σ(u_k); drafts are accepted left to right ~ Bernoulli(c_k) until the
    first rejection; the 'head' reports z = inflate · u (over-confident). Some rounds propose fewer drafts."""
    rng = np.random.default_rng(seed)
    true_logits = rng.normal(1.0, 1.2, size=(num_rounds, gamma))
    accepted_each = rng.random((num_rounds, gamma)) < 1 / (1 + np.exp(-true_logits))
    prefix = np.cumprod(accepted_each, axis=1).sum(1)
    proposed = np.where(rng.random(num_rounds) < 0.3, rng.integers(1, gamma + 1, num_rounds), gamma)
    return torch.tensor(inflate * true_logits), torch.tensor(np.minimum(prefix, proposed)), torch.tensor(proposed)


def test_sts_recovers_inflation_and_lowers_ece():
    logits, accepted, proposed = synthetic_rounds()
    temperatures = fit_sts(logits, accepted, proposed)
    assert len(temperatures) == 4
    assert temperatures == pytest.approx([3.0] * 4, rel=0.2)  # the inflation factor, position by position
    report = calibration_report(logits, accepted, proposed, temperatures)
    for row in report:
        assert row.ece_before > 0.05, row
        assert row.ece_after < 0.02, row
        assert row.ece_after < row.ece_before / 3
        assert row.mean_confidence_after == pytest.approx(row.acceptance_rate, abs=0.02)
    # position 1: one logit rescaled -> order preserved -> AUC identical; later: products of rescaled logits
    assert report[0].auc_after == report[0].auc_before
    for row in report[1:]:
        assert row.auc_after == pytest.approx(row.auc_before, abs=0.02)
    assert [row.num_rounds for row in report][0] == 20000 and report[-1].num_rounds < 20000


def test_sts_keeps_a_calibrated_head_and_handles_unproposed_positions():
    logits, accepted, proposed = synthetic_rounds(num_rounds=20000, gamma=3, inflate=1.0, seed=1)
    temperatures = fit_sts(logits, accepted, proposed)
    assert temperatures == pytest.approx([1.0] * 3, rel=0.2)
    proposed = torch.where(proposed > 2, 2, proposed)  # position 3 never offered
    accepted = torch.minimum(accepted, proposed)
    assert fit_sts(logits, accepted, proposed)[2] == 1.0
    report = calibration_report(logits, accepted, proposed, [1.0, 1.0, 1.0])
    assert report[2].num_rounds == 0 and np.isnan(report[2].ece_after)


def test_offsets_fix_a_shifted_head_that_temperatures_cannot():
    """A head whose logits are shifted by +2 (over-confident on every round, the way a drafter trained where
    acceptance was higher behaves): no temperature moves the mean to the realised rate, a temperature plus an
    offset does — and the offset is the shift, undone left to right."""
    logits, accepted, proposed = synthetic_rounds(num_rounds=10000, gamma=3, inflate=1.0, seed=2)
    shifted = logits + 2.0
    grid, offset_grid = default_temperature_grid(61), np.linspace(-4, 4, 41)  # coarser than the default: fast
    temps_only = calibration_report(shifted, accepted, proposed, fit_sts(shifted, accepted, proposed, grid=grid))
    temps, offsets = fit_sts_with_offsets(shifted, accepted, proposed, grid=grid, offset_grid=offset_grid)
    report = calibration_report(shifted, accepted, proposed, temps, offsets=offsets)
    # position 1 alone identifies the shift; later positions trade T against b on the joint (ECE is flat there)
    assert temps[0] == pytest.approx(1.0, rel=0.25) and offsets[0] == pytest.approx(-2.0, abs=0.35)
    truth = calibration_report(logits, accepted, proposed, [1.0] * 3)  # the unshifted head: sampling-noise ECE
    for plain, affine, best in zip(temps_only, report, truth):
        assert plain.ece_after > 0.08, plain
        assert affine.ece_after < best.ece_after + 0.005, (affine, best.ece_after)
        assert affine.offset == offsets[affine.position - 1]
    assert report[0].auc_after == report[0].auc_before  # still order-preserving at position 1
    # offsets never hurt in-sample (0 is on the grid), and a calibrated head keeps b = 0 within a grid step or two
    assert all(a.ece_after <= p.ece_after + 1e-12 for p, a in zip(temps_only, report))
    _, calibrated_b = fit_sts_with_offsets(logits, accepted, proposed, grid=grid, offset_grid=offset_grid)
    assert calibrated_b[0] == pytest.approx(0.0, abs=0.25)
    with pytest.raises(ValueError, match="offset_grid"):
        fit_sts_with_offsets(logits, accepted, proposed, offset_grid=[])


def test_drafter_reports_offset_confidences(tiny_drafter):
    z = torch.tensor([[0.5, -1.0, 2.0, 0.0]])
    gamma = tiny_drafter.config.block_size
    tiny_drafter.config.confidence_temperatures = [2.0] * gamma
    tiny_drafter.config.confidence_offsets = [-1.0] * gamma
    expected = torch.sigmoid(z / 2.0 - 1.0)
    torch.testing.assert_close(tiny_drafter.confidence_from_logits(z), expected)
    torch.testing.assert_close(tiny_drafter.confidence_from_logits(z[:, 1:], first_position=1), expected[:, 1:])
    assert cumulative_confidence(z.numpy(), [2.0] * 4, [-1.0] * 4)[0].tolist() == pytest.approx(
        np.cumprod(expected[0].numpy()).tolist())


def test_grid_default_and_input_validation():
    grid = default_temperature_grid()
    assert grid[0] == pytest.approx(0.1) and grid[-1] == pytest.approx(10.0) and np.isclose(grid, 1.0).any()
    logits = torch.zeros(3, 2)
    with pytest.raises(ValueError, match="same rounds"):
        fit_sts(logits, [0, 1], [2, 2])
    with pytest.raises(ValueError, match=r"accepted_prefix_len must lie in \[0, num_proposed\]"):
        fit_sts(logits, [0, 2, 1], [2, 1, 2])
    with pytest.raises(ValueError, match="positive temperatures"):
        fit_sts(logits, [0, 1, 1], grid=[0.0, 1.0])
    with pytest.raises(ValueError, match="need 2 temperatures"):
        calibration_report(logits, [0, 1, 1], temperatures=[1.0])


def test_report_serialises():
    logits, accepted, proposed = synthetic_rounds(num_rounds=500, gamma=2)
    row = calibration_report(logits, accepted, proposed)[0].to_dict()
    assert {"position", "ece_before", "ece_after", "auc_before", "temperature", "curve_after"} <= set(row)
    assert len(row["curve_after"]["counts"]) == 20


def test_positions_with_too_few_events_keep_the_identity():
    """A late position of a weak drafter: a handful of accepted drafts, where every (T, b) scores ECE ≈ 0."""
    logits, accepted, proposed = synthetic_rounds(num_rounds=4000, gamma=3, inflate=2.0, seed=3)
    logits[:, 2] -= 8.0  # position 3 almost never accepted ...
    accepted = torch.minimum(accepted, torch.full_like(accepted, 2))
    accepted[:5] = 3  # ... except in 5 rounds
    proposed[:5] = 3
    temps, offsets = fit_sts_with_offsets(logits, accepted, proposed)
    assert temps[2] == 1.0 and offsets[2] == 0.0
    assert fit_sts(logits, accepted, proposed)[2] == 1.0
    assert temps[0] != 1.0  # the well-populated positions are still fitted


def test_ece_noise_floor_matches_binomial_noise_and_separates_miscalibration():
    # certain predictions: labels drawn from them equal them, so a perfect head scores exactly 0
    assert ece_noise_floor([0.0, 1.0, 1.0, 0.0]) == 0.0
    assert np.isnan(ece_noise_floor([]))
    with pytest.raises(ValueError):
        ece_noise_floor([1.5])
    # one bin at p = 0.5, n rounds: E|mean(y) - p| = sqrt(2 / pi) * sqrt(p (1 - p) / n)
    n = 4000
    expected = np.sqrt(2 / np.pi) * np.sqrt(0.25 / n)
    assert ece_noise_floor(np.full(n, 0.5), draws=400) == pytest.approx(expected, rel=0.1)
    assert ece_noise_floor(np.full(n, 0.5), seed=3) == ece_noise_floor(np.full(n, 0.5), seed=3)  # deterministic
    # a calibrated head's measured ECE sits at the floor; a shifted one sits far above it
    rng = np.random.default_rng(0)
    p = rng.uniform(0.05, 0.6, 3000)
    y = (rng.random(p.size) < p).astype(float)
    floor = ece_noise_floor(p)
    assert expected_calibration_error(p, y) < 2.5 * floor
    assert expected_calibration_error(np.clip(p + 0.1, 0, 1), y) > 4 * floor


def test_split_half_noise_floor_and_report_field():
    rng = np.random.default_rng(1)
    u = rng.normal(0.0, 1.5, size=(2000, 3))
    accepted_each = rng.random(u.shape) < 1 / (1 + np.exp(-u))  # a calibrated head: z = u
    prefix = np.cumprod(accepted_each, axis=1).sum(1)
    ece, floor = split_half_ece(u, prefix, offsets=False, return_noise_floor=True)
    assert ece.shape == floor.shape == (3,)
    assert np.all(floor > 0) and np.all(ece < floor + 0.03)
    assert split_half_ece(u, prefix, offsets=False) == pytest.approx(ece)  # the old return value is unchanged
    report = calibration_report(u, prefix, temperatures=[1.0, 1.0, 1.0])
    assert all(np.isfinite(r.ece_noise_floor) and r.ece_noise_floor > 0 for r in report)
    skipped = calibration_report(u, prefix, temperatures=[1.0, 1.0, 1.0], noise_floor_draws=0)
    assert all(np.isnan(r.ece_noise_floor) for r in skipped)


def test_a_fit_shorter_than_the_recorded_positions_is_refused():
    """One temperature for three positions was broadcast to all of them (two gave a numpy broadcasting error): a
    fit made for another block size scored these rounds as if it were theirs."""
    from hf_dspark.training.calibration import calibrated_confidence

    logits = np.zeros((4, 3))
    for temps, offsets in (([2.0], None), ([2.0, 1.0], None), (None, [0.1])):
        with pytest.raises(ValueError, match="3 positions"):
            calibrated_confidence(logits, temps, offsets)
    assert calibrated_confidence(logits, [1.0] * 5, [0.0] * 5).shape == (4, 3)  # a longer fit: its first γ
