"""The probe schedule alone: when a skipped drafter is drafted once anyway to re-measure it."""

from __future__ import annotations

from hf_dspark.scheduling.probes import ProbeSchedule


def decisions(schedule: ProbeSchedule, steps: int, **kwargs) -> list[bool]:
    """Whether each of ``steps`` steps where drafting does not pay is a probe (a step that is not one counts as
    skipped)."""
    out = []
    for _ in range(steps):
        probe = schedule.due(**kwargs)
        if not probe:
            schedule.note_decision(False)
        out.append(probe)
    return out


def test_a_probe_follows_each_interval_of_skipped_steps_and_backs_off_to_a_cap():
    schedule = ProbeSchedule(interval=2, backoff=2.0, max_interval=8)
    probes = [i for i, probe in enumerate(decisions(schedule, 30)) if probe]
    assert probes == [2, 7, 16, 25]  # after 2, 4, 8, then 8 (the cap) skipped steps


def test_a_step_where_drafting_pays_resets_the_interval():
    schedule = ProbeSchedule(interval=3, backoff=2.0)
    assert decisions(schedule, 4) == [False, False, False, True]
    schedule.note_decision(True)
    assert decisions(schedule, 4) == [False, False, False, True]  # 3 again, not 6


def test_no_backoff_keeps_a_fixed_interval():
    schedule = ProbeSchedule(interval=3, backoff=1.0)
    assert decisions(schedule, 8) == [False, False, False, True] * 2


def test_an_implausible_probe_waits_once_the_estimate_rests_on_enough_rows():
    """Before ``min_evidence`` drafted rows back the drafter's estimate a due probe runs whatever it could find (and
    ``plausible`` is not even asked); after, only where it could find drafting paying — and once it can, the overdue
    probe runs at once."""
    asked = []

    def never() -> bool:
        asked.append(1)
        return False

    early = ProbeSchedule(interval=2, backoff=1.0)
    assert decisions(early, 6, plausible=never, evidence_rows=ProbeSchedule.min_evidence - 1) == [False, False,
                                                                                                   True] * 2
    assert not asked
    late = ProbeSchedule(interval=2, backoff=1.0)
    assert not any(decisions(late, 10, plausible=never, evidence_rows=ProbeSchedule.min_evidence))
    assert len(asked) == 8  # asked at every step once the interval had passed
    assert late.due(lambda: True, evidence_rows=ProbeSchedule.min_evidence)
