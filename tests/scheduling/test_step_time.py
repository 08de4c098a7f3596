"""The step-time correction alone: ρ per row count from plain steps, κ per kind of step relative to them, and the
per-width factors the width walk prices steps with."""

from __future__ import annotations

import pytest

from hf_dspark.scheduling.step_time import StepTimeCorrection


def timed_plain_steps(correction: StepTimeCorrection, rows: int = 4, ratio: float = 1.0, steps: int | None = None):
    for _ in range(correction.min_plain_steps if steps is None else steps):
        correction.observe(False, predicted_seconds=0.1, seconds=0.1 * ratio, rows=rows)


def test_nothing_timed_prices_every_kind_as_the_table_says_plus_the_margin():
    correction = StepTimeCorrection(speculation_margin=1.05)
    assert set(correction.kind_ratios.values()) == {1.0} and correction.plain_ratios == {}
    assert not correction.wants_plain_step()  # no step timed at all: no reference is needed yet
    # width 0 of a lookup-only step is a plain step (no margin); a drafted step carries it at every width
    assert correction.factors(2, drafted=False).tolist() == pytest.approx([1.0, 1.05, 1.05])
    assert correction.factors(2, drafted=True).tolist() == pytest.approx([1.05, 1.05, 1.05])


def test_plain_steps_set_their_row_counts_own_ratio():
    """ρ is the plain mean of the first 1/(1 - momentum) plain steps of a row count, a decayed mean after."""
    correction = StepTimeCorrection(momentum=0.5)
    correction.observe(False, predicted_seconds=0.1, seconds=0.2, rows=4)
    correction.observe(False, predicted_seconds=0.1, seconds=0.1, rows=4)
    correction.observe(False, predicted_seconds=0.1, seconds=0.05, rows=16)
    assert correction.plain_ratios == {"4 rows": pytest.approx(1.5), "16 rows": pytest.approx(0.5)}
    correction.observe(False, predicted_seconds=0.1, seconds=0.2, rows=4)  # third step: weight 0.5, not 1/3
    assert correction.plain_ratios["4 rows"] == pytest.approx(1.75)
    correction.observe(False, predicted_seconds=0.1, seconds=0.1, rows=4, sampled=True)
    assert correction.plain_ratios["4 rows, sampled"] == pytest.approx(1.0)


def test_one_hiccup_moves_a_ratio_at_most_fourfold_and_untimed_steps_are_ignored():
    correction = StepTimeCorrection()
    correction.observe(False, predicted_seconds=0.1, seconds=100.0, rows=1)
    correction.observe(False, predicted_seconds=0.0, seconds=0.1, rows=2)
    correction.observe(False, predicted_seconds=0.1, seconds=0.0, rows=2)
    assert correction.plain_ratios == {"1 rows": pytest.approx(4.0)}


def test_a_kind_is_corrected_relative_to_plain_steps_of_its_row_count():
    correction = StepTimeCorrection()
    timed_plain_steps(correction, rows=16, ratio=1.2, steps=40)
    for _ in range(40):
        correction.observe(True, predicted_seconds=0.2, seconds=0.2 * 1.2 * 1.5, wide=True, rows=16)
    assert correction.kind_ratio(wide=True, drafted=True, rows=16) == pytest.approx(1.5, rel=0.01)
    # a row count never timed borrows the nearest one's, a kind never timed the nearest kind's (same width first)
    assert correction.kind_ratio(wide=True, drafted=True, rows=64) == pytest.approx(1.5, rel=0.01)
    assert correction.kind_ratio(wide=True, drafted=False, rows=16) == pytest.approx(1.5, rel=0.01)
    assert correction.kind_ratio(wide=False, drafted=False, rows=16) == 1.0  # a plain step is the reference
    assert correction.factors(3, drafted=True, rows=16).tolist() == pytest.approx(
        [1.5 * correction.speculation_margin] * 4, rel=0.01)


def test_before_any_plain_step_a_speculative_step_times_the_machine_and_asks_for_a_plain_step():
    correction = StepTimeCorrection()
    correction.observe(True, predicted_seconds=0.2, seconds=0.3, wide=True, rows=8)
    assert correction.plain_ratios == {"8 rows": pytest.approx(1.5)} and correction.kind_ratios_at(8)["drafted"] == 1.0
    assert correction.wants_plain_step()
    timed_plain_steps(correction, rows=8, steps=correction.min_plain_steps - 1)
    assert correction.wants_plain_step()  # one plain step is one sample: min_plain_steps before κ is trusted
    timed_plain_steps(correction, rows=8, steps=1)
    assert not correction.wants_plain_step()


def test_plain_steps_are_re_timed_ever_more_rarely():
    correction = StepTimeCorrection()
    timed_plain_steps(correction)
    for interval in (correction.plain_refresh_interval, 2 * correction.plain_refresh_interval):
        for _ in range(interval):
            assert not correction.wants_plain_step()
            correction.observe(True, predicted_seconds=0.2, seconds=0.2, wide=True, rows=4)
        assert correction.wants_plain_step()
        timed_plain_steps(correction, steps=1)
        assert not correction.wants_plain_step()


def test_evidence_that_a_kind_is_cheaper_is_believed_more_slowly_than_that_it_is_dearer():
    def after(relative: float, steps: int) -> float:
        correction = StepTimeCorrection()
        timed_plain_steps(correction)
        for _ in range(steps):
            correction.observe(True, predicted_seconds=0.2, seconds=0.2 * relative, wide=True, rows=4)
        return correction.kind_ratios_at(4)["drafted"]

    # one step: weight 1/2 against the borrowed 1.0 when dearer, 1/(1 + cheap_evidence_steps) when cheaper
    assert after(1.4, 1) == pytest.approx(1.2)
    assert after(0.55, 1) == pytest.approx(1.0 - 0.45 / (1 + StepTimeCorrection.cheap_evidence_steps))
