"""The scheduled policy on the padded step: the width walk, whether the drafter runs, lookup against drafter
proposals, and the online corrections it composes (each estimator alone: test_acceptance.py, test_step_time.py,
test_probes.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_dspark.scheduling import PolicyInputs, SPSProfile, StepCostProfile, make_policy
from hf_dspark.scheduling.algorithm1 import padded_width_path, prefix_survival


def choose(name, conf, max_lengths, cost, **kwargs):
    policy = make_policy(name, **kwargs)
    inputs = PolicyInputs(torch.tensor(conf, dtype=torch.float64), torch.tensor(max_lengths), cost)
    return policy.choose(inputs).tolist()


# ---------------------------------------------------------------------------------------------------------
# The engine's padded step: walk over widths, drafter cost, skipping the drafter
# ---------------------------------------------------------------------------------------------------------
def learned(policy, confidences, max_lengths, cost):
    """``policy`` after the drafting rounds it always drafts to learn its drafter's acceptance (the estimate it
    then decides by: ``min_learning_rows`` drafted rows), each with these confidences."""
    for _ in range(-(-policy.min_learning_rows // len(confidences))):
        policy.choose(PolicyInputs(confidences, max_lengths, cost))
    return policy


def step_cost(verify_per_token: float, fixed: float, draft: float, rows=(1, 2, 4, 8), max_width: int = 6):
    """verify(R, W) = fixed + verify_per_token · R · W seconds, draft(R) = draft seconds."""
    widths = tuple(range(1, max_width + 1))
    return StepCostProfile(rows, widths, tuple(tuple(fixed + verify_per_token * r * w for w in widths) for r in rows),
                           tuple(draft for _ in rows))


def test_padded_walk_long_when_verifying_is_free_short_when_it_costs():
    conf = [[0.9, 0.9, 0.8, 0.5, 0.3], [0.7, 0.6, 0.5, 0.5, 0.5]]
    free = step_cost(verify_per_token=0.0, fixed=0.1, draft=0.0)
    assert choose("scheduled", conf, [5, 5], free) == [5, 5]  # every admission adds tokens at no cost
    assert choose("scheduled", conf, [5, 2], free) == [5, 2]  # never beyond what a request may verify
    costly = step_cost(verify_per_token=1.0, fixed=0.0, draft=0.0)
    assert choose("scheduled", conf, [5, 5], costly) == [0, 0]  # each width costs a full plain step per row
    # a fixed drafter price is sunk once drafted: it makes longer widths relatively cheaper
    mid = step_cost(verify_per_token=0.05, fixed=0.1, draft=0.0)
    mid_drafted = step_cost(verify_per_token=0.05, fixed=0.1, draft=1.0)
    assert sum(choose("scheduled", conf, [5, 5], mid_drafted)) >= sum(choose("scheduled", conf, [5, 5], mid))


def test_padded_walk_width_matches_padded_theta():
    conf = torch.tensor([[0.9, 0.8, 0.2, 0.9], [0.95, 0.9, 0.9, 0.1], [0.5, 0.5, 0.5, 0.5]], dtype=torch.float64)
    cost = step_cost(verify_per_token=0.02, fixed=0.1, draft=0.05, max_width=5)
    theta = padded_width_path(prefix_survival(conf.numpy()), cost)
    width = next((w for w in range(4) if theta[w + 1] <= theta[w]), 4)
    assert choose("scheduled", conf.tolist(), [4, 4, 4], cost) == [width] * 3
    assert theta[0] == pytest.approx(3 / (cost.draft(3) + cost.verify(3, 1)))


def test_padded_walk_is_non_anticipating():
    """Losslessness of the width walk: whether request r verifies draft j (ℓ_r ≥ j) may depend on confidences at
    positions ≤ j only (c_{·,≤j} are computed from drafts < j); resampling every c at positions > j must never
    change it, for any request and any j."""
    rng = np.random.default_rng(0)
    smooth = step_cost(verify_per_token=0.01, fixed=0.05, draft=0.02, max_width=7)
    # a jagged curve (a cliff at W=3, flat after): where a global argmax over widths would peek ahead
    jagged = StepCostProfile((1, 8), tuple(range(1, 8)), ((0.1, 0.1, 0.2, 0.2, 0.2, 0.2, 0.2),) * 2, (0.0, 0.0))
    for trial in range(300):
        cost = (smooth, jagged)[trial % 2]
        num_requests = int(rng.integers(1, 6))
        conf = rng.uniform(0.05, 1.0, size=(num_requests, 6))
        lengths = np.array(choose("scheduled", conf.tolist(), [6] * num_requests, cost))
        for j in range(1, 7):
            other = conf.copy()
            other[:, j:] = rng.uniform(0.05, 1.0, size=(num_requests, 6 - j))
            again = np.array(choose("scheduled", other.tolist(), [6] * num_requests, cost))
            assert ((lengths >= j) == (again >= j)).all()


def test_wants_drafts_follows_load_and_probes():
    """Drafting 4 rows whose drafts survive 0.8 per position pays with a 1 ms drafter pass, not with a 0.35 s one
    (Θ 34 vs 38 tokens/s plain), though it would if the drafter did better (perfect drafts: 51): there the policy
    skips the drafter and probes it after 3 skipped steps, then after 6 (each probe that finds drafting still not
    paying doubles the interval: ``probe_backoff``); a step where drafting pays resets it."""
    policy = make_policy("scheduled", probe_interval=3)
    cheap = step_cost(verify_per_token=0.001, fixed=0.1, draft=0.001)
    dear = step_cost(verify_per_token=0.001, fixed=0.1, draft=0.35)
    assert policy.wants_drafts(4, dear)  # nothing known yet: draft to learn the confidences
    learned(policy, torch.full((4, 5), 0.8, dtype=torch.float64), torch.full((4,), 5), cheap)
    assert policy.wants_drafts(4, cheap)
    decisions = [policy.wants_drafts(4, dear) for _ in range(11)]
    assert decisions == [False] * 3 + [True] + [False] * 6 + [True]  # probes after 3, then 6 skipped steps
    assert policy.wants_drafts(4, cheap)  # drafting pays again: the interval is back to 3
    assert [policy.wants_drafts(4, dear) for _ in range(4)] == [False, False, False, True]
    fixed = make_policy("scheduled", probe_interval=3, probe_backoff=1.0)
    learned(fixed, torch.full((4, 5), 0.8, dtype=torch.float64), torch.full((4,), 5), cheap)
    assert [fixed.wants_drafts(4, dear) for _ in range(8)] == [False, False, False, True] * 2
    # an SPS table (no step cost) gives no basis for skipping
    assert policy.wants_drafts(4, SPSProfile.from_user_table({1: 1.0}))


def test_learning_is_counted_in_drafted_rows_not_rounds():
    """The drafter's estimate needs ``min_learning_rows`` drafted rows: one round of 4 rows, four rounds of one row.
    Until then the policy drafts even where drafting cannot pay; after, it stops (a busy engine paid a drafter pass
    and a wide verify for every learning round). The mean over the learning rounds is a mean over their rows."""
    dear = step_cost(verify_per_token=0.001, fixed=0.1, draft=0.35)
    one_row, four_rows = make_policy("scheduled", probe_interval=100), make_policy("scheduled", probe_interval=100)
    learning = []
    for _ in range(one_row.min_learning_rows):
        learning.append(one_row.wants_drafts(1, dear))
        one_row.choose(PolicyInputs(torch.full((1, 5), 0.8, dtype=torch.float64), torch.full((1,), 5), dear))
    assert learning == [True] * 4 and not one_row.wants_drafts(1, dear)
    assert four_rows.wants_drafts(4, dear)
    four_rows.choose(PolicyInputs(torch.full((4, 5), 0.8, dtype=torch.float64), torch.full((4,), 5), dear))
    assert not four_rows.wants_drafts(4, dear)  # 4 rows drafted once: as much evidence as 4 rounds of one
    weighted = make_policy("scheduled")
    weighted.choose(PolicyInputs(torch.full((3, 2), 0.5, dtype=torch.float64), torch.full((3,), 2), dear))
    weighted.choose(PolicyInputs(torch.full((1, 2), 0.9, dtype=torch.float64), torch.full((1,), 2), dear))
    assert weighted.survival.mean[0] == pytest.approx((3 * 0.5 + 0.9) / 4)  # per row, not (0.5 + 0.9) / 2


def test_online_calibration_corrects_over_confidence():
    """Confidences of 0.9 that are never accepted: after some observed rounds the policy scales position 1 down
    (only verified, reached drafts count), verifies less, and without it (online_calibration=False) it doesn't."""
    cost = step_cost(verify_per_token=0.02, fixed=0.1, draft=0.0)
    conf = torch.full((4, 5), 0.9, dtype=torch.float64)
    online, offline = make_policy("scheduled"), make_policy("scheduled", online_calibration=False)
    before = online.choose(PolicyInputs(conf, torch.full((4,), 5), cost)).tolist()
    assert before == offline.choose(PolicyInputs(conf, torch.full((4,), 5), cost)).tolist() and before[0] > 0
    for _ in range(50):
        for policy in (online, offline):
            policy.observe(conf, torch.tensor([3, 3, 0, 5]), torch.tensor([0, 0, 0, 0]))
    factors = online.acceptance.factors(5)
    assert factors[0] < 0.2 and factors[1:] == pytest.approx(1.0)  # positions ≥ 2 were never reached
    assert online.choose(PolicyInputs(conf, torch.full((4,), 5), cost)).tolist() == [0, 0, 0, 0]
    assert offline.choose(PolicyInputs(conf, torch.full((4,), 5), cost)).tolist() == before
    # accepted drafts count as realised: all accepted at confidence 0.5 -> factor > 1 (clipped c ≤ 1)
    under = make_policy("scheduled")
    for _ in range(50):
        under.observe(torch.full((2, 3), 0.5, dtype=torch.float64), torch.tensor([3, 3]), torch.tensor([3, 3]))
    assert (under.acceptance.factors(3) > 1.5).all()


def test_measured_step_times_steer_the_drafting_decision():
    """The profile says drafting pays; measured drafted steps take 3× their prediction (overheads the bare
    forwards do not show), so after a few observed steps the policy stops drafting."""
    cost = step_cost(verify_per_token=0.001, fixed=0.1, draft=0.01)
    policy = make_policy("scheduled", probe_interval=100)
    learned(policy, torch.full((4, 5), 0.6, dtype=torch.float64), torch.full((4,), 5), cost)
    assert policy.wants_drafts(4, cost)
    for _ in range(30):
        policy.observe_step(True, predicted_seconds=0.12, seconds=0.36)
        policy.observe_step(False, predicted_seconds=0.1, seconds=0.1)
    assert policy.step_time.kind_ratios["drafted"] == pytest.approx(3.0, rel=0.1)
    # (the plain kind's first step moved the ratio it borrowed from the drafted kind, 1.2, towards 1.0)
    assert policy.step_time.kind_ratios["plain"] == pytest.approx(1.0, rel=0.02)
    assert not policy.wants_drafts(4, cost)


def test_sampled_and_greedy_rounds_have_their_own_step_time_corrections():
    """Sampled drafted rounds take 3× their (greedy-forward) prediction, greedy ones as predicted: the policy stops
    drafting for sampled rounds only, and greedy calls on the same target keep drafting."""
    cost = step_cost(verify_per_token=0.001, fixed=0.1, draft=0.01)
    policy = make_policy("scheduled", probe_interval=100)
    learned(policy, torch.full((4, 5), 0.6, dtype=torch.float64), torch.full((4,), 5), cost)
    for _ in range(40):
        policy.observe_step(True, predicted_seconds=0.12, seconds=0.36, sampled=True)
        policy.observe_step(True, predicted_seconds=0.12, seconds=0.12)
        policy.observe_step(False, predicted_seconds=0.1, seconds=0.1, sampled=True)
    ratios = policy.step_time.kind_ratios
    # (a kind's first step moves the ratio it borrowed from the nearest kind timed so far; the greedy kind borrowed
    # the sampled one's dear ratio, and evidence that a kind is cheaper is believed slowly: 40 steps settle it)
    assert ratios["drafted, sampled"] == pytest.approx(3.0, rel=0.1)
    assert ratios["drafted"] == pytest.approx(1.0, rel=0.02)
    assert ratios["plain, sampled"] == pytest.approx(1.0, rel=0.02) and ratios["plain"] == pytest.approx(1.0, rel=0.02)
    assert not policy.wants_drafts(4, cost, sampled=True)
    assert policy.wants_drafts(4, cost)
    lookup = np.zeros((4, 2))  # no lookup proposal: the drafter is the only source
    assert policy.plan_sources(lookup, cost, drafter_available=True)[1]
    assert not policy.plan_sources(lookup, cost, drafter_available=True, sampled=True)[1]


def test_wide_and_one_token_steps_have_their_own_step_time_corrections():
    """The profile says verifying 3 lookup drafts per row pays (Θ 57 vs 37 tokens/s); in the engine wide steps
    take 2× their prediction while 1-token steps take what it says (a gap one factor per kind of round cannot
    see: it scales both widths alike). Once timed, the policy verifies nothing."""
    cost = step_cost(verify_per_token=0.002, fixed=0.1, draft=0.01)
    conf = torch.full((4, 4), 0.5, dtype=torch.float64)
    lookup_rows = dict(drafter_rows=np.zeros(4, dtype=bool), drafted=False, all_greedy=True)
    policy = make_policy("scheduled", probe_interval=100)
    assert policy.choose(PolicyInputs(conf, torch.full((4,), 4), cost, **lookup_rows)).tolist() == [3, 3, 3, 3]
    assert policy.step_time.kind_ratios["lookup"] == 1.0  # nothing timed yet
    for _ in range(30):
        policy.observe_step(False, predicted_seconds=0.14, seconds=0.28, wide=True)
        policy.observe_step(False, predicted_seconds=0.108, seconds=0.108, wide=False)
    ratios = policy.step_time.kind_ratios
    assert ratios["lookup"] == pytest.approx(2.0, rel=0.05) and ratios["plain"] == pytest.approx(1.0, rel=0.05)
    assert ratios["drafted"] == pytest.approx(2.0, rel=0.05)  # a kind not timed yet borrows its width class's
    assert policy.choose(PolicyInputs(conf, torch.full((4,), 4), cost, **lookup_rows)).tolist() == [0, 0, 0, 0]
    factors = policy.step_time.factors(3, drafted=False)
    margin = policy.step_time.speculation_margin
    assert factors[0] == pytest.approx(1.0, rel=0.05) and factors[1:] == pytest.approx([2.0 * margin] * 3, rel=0.05)


def test_the_drafter_must_beat_the_rows_lookup_proposal_not_a_plain_step():
    """One row: its lookup proposal survives 0.5, the drafter's first draft 0.6 but its pass costs 30 ms on a
    ~0.1 s step. Drafting beats a plain step (Θ 12.1 vs 9.9) but not the lookup proposal it would replace
    (14.7): the drafter stays off and the row keeps its lookup proposal."""
    cost = step_cost(verify_per_token=0.001, fixed=0.1, draft=0.03)
    policy = make_policy("scheduled", probe_interval=100)
    learned(policy, torch.tensor([[0.6, 0.0, 0.0]], dtype=torch.float64), torch.tensor([3]), cost)
    use_lookup, run_drafter = policy.plan_sources(np.array([[0.5, 0.0, 0.0]]), cost, drafter_available=True)
    assert not run_drafter and use_lookup.tolist() == [True]
    # a cheap drafter pass does beat it: the row goes to the drafter
    cheap = step_cost(verify_per_token=0.001, fixed=0.1, draft=0.001)
    use_lookup, run_drafter = policy.plan_sources(np.array([[0.5, 0.0, 0.0]]), cheap, drafter_available=True)
    assert run_drafter and use_lookup.tolist() == [False]


def test_the_drafter_must_clear_the_speculation_margin_over_a_lookup_step():
    """Two rows, one with a lookup proposal (0.5), the other only the drafter's (mean survival s). Against the lookup
    step the drafter must gain more than ``speculation_margin``: a 3 % better estimate (s = 0.1) is a bet on noise
    and stays a lookup step, 11 % (s = 0.3) drafts. Against a plain step (no lookup proposal anywhere) the drafted
    step's price already carries the margin, so 2 % over it still drafts."""
    cost = step_cost(verify_per_token=0.001, fixed=0.1, draft=0.001)
    one_proposal = np.array([[0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])

    def decide(survival: float, lookup: np.ndarray) -> tuple[bool, float]:
        policy = make_policy("scheduled", probe_interval=100)
        learned(policy, torch.tensor([[survival, 0.0, 0.0]] * 2, dtype=torch.float64), torch.tensor([3, 3]), cost)
        use_lookup, run_drafter = policy.plan_sources(lookup, cost, drafter_available=True)
        assert use_lookup.tolist() == (lookup[:, 0] > survival).tolist()
        return run_drafter, policy.last_drafter_gain

    margin = make_policy("scheduled").step_time.speculation_margin
    run_drafter, gain = decide(0.1, one_proposal)
    assert 1.0 < gain < margin and not run_drafter
    run_drafter, gain = decide(0.3, one_proposal)
    assert gain > margin and run_drafter
    run_drafter, gain = decide(0.1, np.zeros((2, 3)))
    assert 1.0 < gain < margin and run_drafter


def test_probes_back_off_while_drafting_keeps_not_paying():
    policy = make_policy("scheduled", probe_interval=2, probe_backoff=2.0, max_probe_interval=8)
    cheap = step_cost(verify_per_token=0.001, fixed=0.1, draft=0.001)
    dear = step_cost(verify_per_token=0.001, fixed=0.1, draft=0.35)  # pays only with a better drafter
    learned(policy, torch.full((4, 5), 0.8, dtype=torch.float64), torch.full((4,), 5), cheap)
    decisions = [policy.wants_drafts(4, dear) for _ in range(20)]
    probes = [i for i, d in enumerate(decisions) if d]
    assert probes == [2, 7, 16]  # after 2, then 4, then 8 skipped rounds (the cap)
    assert policy.wants_drafts(4, cheap)  # drafting pays again: the interval is back to 2
    assert [policy.wants_drafts(4, dear) for _ in range(3)] == [False, False, True]


def test_no_probes_where_even_a_much_better_drafter_could_not_pay():
    """A 10 s drafter pass on a 0.1 s step: drafting could not pay even with perfect drafts, so once its estimate
    rests on enough drafting rounds the policy never probes (a probe there only costs). When the load changes to
    one where a better drafter would pay (a 0.35 s pass; see the test above), the overdue probe runs at once; with
    no headroom (1.0) it never does."""
    cheap = step_cost(verify_per_token=0.001, fixed=0.1, draft=0.001)
    hopeless = step_cost(verify_per_token=0.001, fixed=0.1, draft=10.0)
    marginal = step_cost(verify_per_token=0.001, fixed=0.1, draft=0.35)
    for headroom, probes_when_marginal in ((1.5, True), (1.0, False)):
        policy = make_policy("scheduled", probe_interval=3, probe_headroom=headroom, probe_backoff=1.0)
        learned(policy, torch.full((4, 5), 0.8, dtype=torch.float64), torch.full((4,), 5), cheap)
        # one drafting round is no basis for never drafting again: until min_probe_evidence rounds, probes run
        assert sum(policy.wants_drafts(4, hopeless) for _ in range(8)) == 2
        for _ in range(policy.probes.min_evidence):
            policy.choose(PolicyInputs(torch.full((4, 5), 0.8, dtype=torch.float64), torch.full((4,), 5), cheap))
        assert not any(policy.wants_drafts(4, hopeless) for _ in range(50))
        lookup = np.zeros((4, 2))
        assert not any(policy.plan_sources(lookup, hopeless, drafter_available=True)[1] for _ in range(50))
        assert policy.wants_drafts(4, marginal) is probes_when_marginal
    with pytest.raises(ValueError, match="probe_headroom"):
        make_policy("scheduled", probe_headroom=0.5)


def test_rows_that_can_verify_no_draft_do_not_draft():
    """A row with one token left (cap 0) can verify no draft: a round of only such rows never drafts (not even
    to learn, and no probe is spent on it), and the drafter's value counts only the rows that can use it — one
    row of four, here too little for its pass."""
    policy = make_policy("scheduled", probe_interval=100)
    cost = step_cost(verify_per_token=0.001, fixed=0.1, draft=0.1)  # 4 rows: Θ 66 vs 38 plain; 1 row: 30
    none_left = np.zeros(4, dtype=np.int64)
    assert not policy.wants_drafts(4, cost, caps=none_left)  # before anything is known, too
    assert not policy.plan_sources(np.zeros((4, 2)), cost, drafter_available=True, caps=none_left)[1]
    learned(policy, torch.full((4, 5), 0.8, dtype=torch.float64), torch.full((4,), 5), cost)
    assert policy.wants_drafts(4, cost, caps=np.full(4, 5))
    one_row = np.array([0, 0, 0, 5])
    assert not policy.wants_drafts(4, cost, caps=one_row)
    assert not policy.plan_sources(np.zeros((4, 2)), cost, drafter_available=True, caps=one_row)[1]
    assert policy.plan_sources(np.zeros((4, 2)), cost, drafter_available=True, caps=np.full(4, 5))[1]


def test_plain_steps_correct_their_own_row_count_and_other_kinds_compare_with_them():
    """The profile prices 9-row plain steps 40 % cheap and 16-row ones 5 % dear (rows timed at different moments);
    a drafted 16-row step runs 1.25× a plain one's correction. The 9-row plain steps (the drain) must not make
    plain steps look dear at 16 rows (one factor for all plain steps would, and drafting would look cheap there)
    — and the drafted kind is corrected against the plain steps of its own row count."""
    policy = make_policy("scheduled", probe_interval=100)
    for _ in range(40):
        policy.observe_step(False, predicted_seconds=0.075, seconds=0.105, rows=9)
        policy.observe_step(False, predicted_seconds=0.152, seconds=0.145, rows=16)
        policy.observe_step(True, predicted_seconds=0.308, seconds=0.308 * 0.954 * 1.25, wide=True, rows=16)
    rho = policy.step_time.plain_ratios
    assert rho["9 rows"] == pytest.approx(1.4, rel=0.02) and rho["16 rows"] == pytest.approx(0.954, rel=0.02)
    ratios = policy.step_time.kind_ratios
    assert ratios["plain"] == 1.0 and ratios["drafted"] == pytest.approx(1.25, rel=0.02)
    # a kind first seen at a row count whose plain steps were never timed compares with the nearest row count's
    fresh = make_policy("scheduled")
    for _ in range(40):
        fresh.observe_step(False, predicted_seconds=0.1, seconds=0.2, rows=4)
        fresh.observe_step(False, predicted_seconds=0.1, seconds=0.1, rows=16)
    for _ in range(40):
        fresh.observe_step(False, predicted_seconds=0.1, seconds=0.3, wide=True, rows=5)
    assert fresh.step_time.kind_ratios["lookup"] == pytest.approx(1.5, rel=0.02)  # 0.3 / (0.1 · ρ(4) = 2)


def test_wide_step_corrections_are_kept_per_row_count_and_wait_for_a_plain_step():
    """A wide step is 1.1× a plain one at 4 rows and 1.3× at 16 (more padded attention, more logits): each row
    count keeps its own κ. Before any plain step was timed, a drafted step's time says how fast the machine is, not
    how dear drafting is: it sets ρ (which the first plain step then replaces), leaves κ alone, and asks for a
    plain step next."""
    policy = make_policy("scheduled")
    for _ in range(3):
        policy.observe_step(True, predicted_seconds=0.2, seconds=0.16, wide=True, rows=16)  # the machine is fast
    assert policy.step_time.kind_ratios_at(16)["drafted"] == 1.0
    assert policy.step_time.plain_ratios == {"16 rows": pytest.approx(0.8)}
    # so the next step is a plain one, lookup proposals and the drafter both set aside
    cheap = step_cost(verify_per_token=0.001, fixed=0.1, draft=0.001)
    assert not policy.wants_drafts(4, cheap)
    use_lookup, run_drafter = policy.plan_sources(np.full((4, 2), 0.9), cheap, drafter_available=True)
    assert not run_drafter and not use_lookup.any()
    policy.observe_step(False, predicted_seconds=0.1, seconds=0.1, rows=16)
    assert policy.step_time.plain_ratios == {"16 rows": 1.0}  # a real plain step replaces the machine-speed guess
    assert not policy.wants_drafts(4, cheap)  # one plain step is one sample of a noisy machine: more first
    for _ in range(policy.step_time.min_plain_steps - 1):
        policy.observe_step(False, predicted_seconds=0.1, seconds=0.1, rows=16)
    assert policy.wants_drafts(4, cheap)
    for _ in range(60):
        for rows, relative in ((4, 1.1), (16, 1.3)):
            policy.observe_step(False, predicted_seconds=0.1, seconds=0.1, rows=rows)
            policy.observe_step(False, predicted_seconds=0.2, seconds=0.2 * relative, wide=True, rows=rows)
    assert policy.step_time.kind_ratios_at(4)["lookup"] == pytest.approx(1.1, rel=0.01)
    assert policy.step_time.kind_ratios_at(16)["lookup"] == pytest.approx(1.3, rel=0.01)
    assert policy.step_time.kind_ratios_at(12)["lookup"] == pytest.approx(1.3, rel=0.01)  # the nearest row count's
    margin = policy.step_time.speculation_margin  # every kind but a plain step is priced with it
    assert policy.step_time.factors(3, drafted=False, rows=16).tolist() == pytest.approx(
        [1.0] + [1.3 * margin] * 3, rel=0.01)


def test_a_policy_that_keeps_speculating_re_times_plain_steps_ever_more_rarely():
    """κ is learned relative to ρ, which only plain steps time: a policy that speculates every step would keep the
    ρ of its first few plain steps for ever (one slow one would make every other kind look cheap). After
    ``plain_refresh_interval`` timed speculative steps in a row it takes a plain step, and the next refresh comes
    twice as late."""
    policy = make_policy("scheduled")
    cheap = step_cost(verify_per_token=0.001, fixed=0.1, draft=0.001)
    for _ in range(policy.step_time.min_plain_steps):
        policy.observe_step(False, predicted_seconds=0.1, seconds=0.1, rows=4)
    interval = policy.step_time.plain_refresh_interval
    for every in (interval, 2 * interval):
        for _ in range(every):
            assert policy.wants_drafts(4, cheap)
            policy.observe_step(True, predicted_seconds=0.2, seconds=0.2, wide=True, rows=4)
        assert not policy.wants_drafts(4, cheap)
        _, run_drafter = policy.plan_sources(np.full((4, 2), 0.9), cheap, drafter_available=True)
        assert not run_drafter
        policy.observe_step(False, predicted_seconds=0.1, seconds=0.13, rows=4)
        assert policy.wants_drafts(4, cheap)
    assert policy.step_time.plain_ratios["4 rows"] > 1.0  # the refreshes moved ρ


def test_a_kinds_correction_follows_the_current_plain_step_ratio():
    """κ is the kind's measured / predicted ratio over ρ *now*: drafted steps timed at 1.2× their prediction while
    plain steps ran 1.3× (an early, slow stretch) are 1.2 / 1.1 a plain step once plain steps settle at 1.1×, not
    the 0.92 of that stretch."""
    policy = make_policy("scheduled")
    for _ in range(policy.step_time.min_plain_steps):
        policy.observe_step(False, predicted_seconds=0.1, seconds=0.13, rows=16)
    for _ in range(20):
        policy.observe_step(True, predicted_seconds=0.2, seconds=0.24, wide=True, rows=16)
    assert policy.step_time.kind_ratios_at(16)["drafted"] == pytest.approx(1.2 / 1.3, rel=0.02)
    for _ in range(60):
        policy.observe_step(False, predicted_seconds=0.1, seconds=0.11, rows=16)
    assert policy.step_time.kind_ratios_at(16)["drafted"] == pytest.approx(1.2 / 1.1, rel=0.02)


def test_a_kind_is_believed_dearer_at_once_and_cheaper_only_on_more_evidence():
    """Four steps of a kind measuring 1.3× a plain step move its κ most of the way (a dear kind keeps losing while
    it settles); four measuring 0.8× move it only a little (choosing on a few noisy steps favours kinds that
    happened to look cheap). Twenty steps settle either."""
    def learned(relative: float, steps: int) -> float:
        policy = make_policy("scheduled")
        for _ in range(policy.step_time.min_plain_steps):
            policy.observe_step(False, predicted_seconds=0.1, seconds=0.1, rows=4)
        for _ in range(steps):
            policy.observe_step(True, predicted_seconds=0.2, seconds=0.2 * relative, wide=True, rows=4)
        return policy.step_time.kind_ratios_at(4)["drafted"]

    assert learned(1.3, 4) > 1.2
    assert 0.9 < learned(0.8, 4) < 0.96
    assert learned(1.3, 40) == pytest.approx(1.3, rel=0.02) and learned(0.8, 40) == pytest.approx(0.8, rel=0.02)


def test_speculation_needs_its_margin_over_a_plain_step():
    """Verifying drafts of 0.8 survival per position on 4 rows is expected to beat a plain step by ~3 % here; with
    the default margin (each speculating kind priced 1.05× its estimate) the step stays plain, with none it
    speculates. The margin is a fixed factor per kind of step, so the walk stays lossless."""
    cost = step_cost(verify_per_token=0.07, fixed=0.1, draft=0.0)
    conf = torch.full((4, 1), 0.8, dtype=torch.float64)
    theta = padded_width_path(prefix_survival(conf.numpy()), cost, drafted=False)
    assert 1.0 < theta[1] / theta[0] < 1.05
    lookup_rows = dict(drafter_rows=np.zeros(4, dtype=bool), drafted=False, all_greedy=True)
    inputs = PolicyInputs(conf, torch.full((4,), 1), cost, **lookup_rows)
    assert make_policy("scheduled").choose(inputs).tolist() == [0] * 4
    eager = make_policy("scheduled", speculation_margin=1.0)
    assert eager.choose(PolicyInputs(conf, torch.full((4,), 1), cost, **lookup_rows)).tolist() == [1] * 4
    with pytest.raises(ValueError, match="speculation_margin"):
        make_policy("scheduled", speculation_margin=0.9)


def test_probes_aim_at_the_best_the_drafter_has_shown():
    """A drafter that accepted 0.8 per position, then (the text changed) 0.1: at a load where only a much better
    drafter than 0.1 could pay, it is still probed (its earlier best would pay with the headroom), while a drafter
    that never did better than 0.1 is not."""
    dear = step_cost(verify_per_token=0.001, fixed=0.1, draft=0.35)  # pays with perfect drafts, not with 0.8
    cheap = step_cost(verify_per_token=0.001, fixed=0.1, draft=0.001)
    was_good, never_good = (make_policy("scheduled", probe_interval=3, probe_backoff=1.0) for _ in range(2))
    for policy, first in ((was_good, 0.8), (never_good, 0.1)):
        for conf in [first] * 20 + [0.1] * 60:
            policy.choose(PolicyInputs(torch.full((4, 5), conf, dtype=torch.float64), torch.full((4,), 5), cheap))
        assert policy.survival.mean[0] == pytest.approx(0.1, abs=0.01)
    assert sum(was_good.wants_drafts(4, dear) for _ in range(8)) == 2
    assert not any(never_good.wants_drafts(4, dear) for _ in range(8))


def test_rounds_of_other_widths_keep_learning_the_drafter():
    """With lookup in the batch a round is as wide as its longest proposal, wider than the drafter's block: the
    drafter's rows carry zeros there. Such rounds must add to the drafter's estimate, not restart it (a restart
    would keep the policy in its always-drafting learning rounds for good)."""
    policy = make_policy("scheduled")
    cost = step_cost(verify_per_token=0.01, fixed=0.1, draft=0.01, max_width=12)
    for width in (4, 10, 4, 7, 4, 10):  # drafter block 4, lookup proposals of up to 9 drafts widen some rounds
        conf = np.zeros((2, width))
        conf[:, :4] = 0.5
        policy.choose(PolicyInputs(conf, np.array([4, 4]), cost, drafter_rows=np.ones(2, dtype=bool), drafted=True))
    assert policy.survival.rounds == 6 and policy.survival.rows == 12 >= policy.min_learning_rows
    assert policy.survival.mean.size == 10
    assert policy.survival.mean[:4] == pytest.approx(0.5 ** np.arange(1, 5))  # nothing verified: no correction
    assert not policy.survival.mean[4:].any()


def test_an_under_confident_head_is_corrected_within_a_few_dozen_drafts():
    """The head says 0.2 at position 1, the drafts are accepted 3 times in 8 (37.5 %): after 32 verified drafts the
    factor is past 1.5 (the prior is 16 drafts at the mean prediction; counted as 16 units of predicted mass it
    would weigh as much as 80 such drafts, and the factor would still be far from the realised rate)."""
    policy = make_policy("scheduled")
    conf = torch.full((4, 3), 0.2, dtype=torch.float64)
    for accepted in ([1, 0, 0, 1], [0, 1, 0, 0]) * 4:
        policy.observe(conf, torch.ones(4, dtype=torch.long), torch.tensor(accepted))
    factor = policy.acceptance.factors(3)
    realised, predicted, prior = 12.0, 0.2 * 32, 16 * 0.2
    assert factor[0] == pytest.approx((realised + prior) / (predicted + prior), rel=0.02) and factor[0] > 1.5
    assert factor[1:].tolist() == [1.0, 1.0]  # never reached
