"""Verify-length policies on hand-made confidence tables, incl. the paper's App. A counterexample."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from hf_dspark.serving import SPSProfile, StepCostProfile, make_policy, register_policy
from hf_dspark.serving.scheduler import (
    admission_order,
    available_policies,
    expected_throughput,
    fill_confidences,
    lengths_from_admissions,
    padded_width_path,
    prefix_survival,
    throughput_path,
)

APP_A_SPS = SPSProfile.from_user_table({1: 1.0, 2: 0.5, 3: 0.45})


def choose(name, conf, max_lengths, sps, **kwargs):
    policy = make_policy(name, **kwargs)
    return policy.choose(torch.tensor(conf, dtype=torch.float64), torch.tensor(max_lengths), sps).tolist()


def global_argmax_lengths(conf, max_lengths, sps):
    """The *lossy* scheduler of App. A: same admission path, but the global argmax of Θ (no break)."""
    conf = torch.as_tensor(conf, dtype=torch.float64)
    survival = prefix_survival(fill_confidences(conf, torch.as_tensor(max_lengths)))
    rows, _, values = admission_order(survival)
    theta = throughput_path(values, conf.shape[0], sps)
    return lengths_from_admissions(rows, int(theta.argmax()), conf.shape[0])


def first_token_distribution(p_target, p_draft, admits_first_draft):
    """Exact law of the first output token of one speculative round, enumerating the drafted x_1.

    ``admits_first_draft(x1) -> bool`` is the scheduler's decision ℓ ≥ 1 after x_1 was drafted. Admitted
    drafts go through standard rejection sampling (accept w.p. min(1, p/q), else resample from norm(p − q)+);
    a non-admitted draft means the target samples the token itself."""
    vocab = len(p_target)
    residual = [max(p_target[v] - p_draft[v], 0.0) for v in range(vocab)]
    residual = [r / sum(residual) for r in residual]
    out = [0.0] * vocab
    for x1 in range(vocab):
        if admits_first_draft(x1):
            accept = min(1.0, p_target[x1] / p_draft[x1])
            out[x1] += p_draft[x1] * accept
            for v in range(vocab):
                out[v] += p_draft[x1] * (1 - accept) * residual[v]
        else:
            for v in range(vocab):
                out[v] += p_draft[x1] * p_target[v]
    return out


# ---------------------------------------------------------------------------------------------------------
# Paper Appendix A
# ---------------------------------------------------------------------------------------------------------
A, B = 0, 1
P_TARGET, P_DRAFT = (0.7, 0.3), (0.5, 0.5)
C2_GIVEN_X1 = {A: 0.9, B: 0.0}  # the Markov confidence head sees x_1


def app_a_table(x1):
    return [[0.8, C2_GIVEN_X1[x1]]]


def test_app_a_global_argmax_is_biased():
    assert global_argmax_lengths(app_a_table(A), [2], APP_A_SPS).tolist() == [2]  # Θ2 = 1.134 is the max
    assert global_argmax_lengths(app_a_table(B), [2], APP_A_SPS).tolist() == [0]  # Θ0 = 1.0 is the max
    dist = first_token_distribution(P_TARGET, P_DRAFT,
                                    lambda x1: global_argmax_lengths(app_a_table(x1), [2], APP_A_SPS)[0] >= 1)
    assert dist == pytest.approx([0.85, 0.15], abs=1e-12)


def test_app_a_scheduled_with_break_is_lossless():
    # Θ1 = 0.9 < Θ0 = 1.0: the walk stops before it ever looks at c_2.
    for x1 in (A, B):
        assert choose("scheduled", app_a_table(x1), [2], APP_A_SPS) == [0]
    policy = make_policy("scheduled")
    dist = first_token_distribution(
        P_TARGET, P_DRAFT,
        lambda x1: policy.choose(torch.tensor(app_a_table(x1)), torch.tensor([2]), APP_A_SPS)[0].item() >= 1)
    assert dist == pytest.approx([0.7, 0.3], abs=1e-12)


def test_app_a_break_admits_x1_independently_of_x1_when_worth_it():
    # A faster machine (SPS(2) = 0.9): Θ1 = 1.62 > Θ0, so x_1 is verified whatever it is — still exact.
    sps = SPSProfile.from_user_table({1: 1.0, 2: 0.9, 3: 0.45})
    lengths = {x1: choose("scheduled", app_a_table(x1), [2], sps)[0] for x1 in (A, B)}
    assert lengths == {A: 1, B: 1}  # Θ2(A) = 2.52·0.45 < 1.62: stops at 1 for both
    dist = first_token_distribution(P_TARGET, P_DRAFT, lambda x1: lengths[x1] >= 1)
    assert dist == pytest.approx([0.7, 0.3], abs=1e-12)


def test_app_a_async_global_search_on_stale_confidences_is_lossless():
    # scheduled-async searches globally (no break) but only over confidences two steps old, so the budget
    # cannot react to the current x_1. Stale table = case A's (the one that makes the lossy scheduler admit).
    def admitted(x1):
        policy = make_policy("scheduled-async")
        for step in (0, 1):  # history: two earlier steps with the stale table
            policy.choose(torch.tensor(app_a_table(A)), torch.tensor([2]), APP_A_SPS, step=step)
        return policy.choose(torch.tensor(app_a_table(x1)), torch.tensor([2]), APP_A_SPS, step=2)[0].item() >= 1

    assert admitted(A) and admitted(B)  # same budget K = 2 both ways; top-K of the current candidates
    dist = first_token_distribution(P_TARGET, P_DRAFT, admitted)
    assert dist == pytest.approx([0.7, 0.3], abs=1e-12)


# ---------------------------------------------------------------------------------------------------------
# Hand-computed tables
# ---------------------------------------------------------------------------------------------------------
HAND_CONF = [[0.9, 0.8, 0.5], [0.6, 0.5, 0.9]]  # a = [[.9, .72, .36], [.6, .3, .27]]
HAND_SPS = SPSProfile.from_user_table({2: 1.0, 3: 0.95, 4: 0.9, 5: 0.7, 6: 0.6, 7: 0.5, 8: 0.45})


def test_admission_order_and_throughput_path_by_hand():
    survival = prefix_survival(torch.tensor(HAND_CONF, dtype=torch.float64))
    rows, positions, values = admission_order(survival)
    assert list(zip(rows.tolist(), positions.tolist())) == [(0, 1), (0, 2), (1, 1), (0, 3), (1, 2), (1, 3)]
    assert values.tolist() == pytest.approx([0.9, 0.72, 0.6, 0.36, 0.3, 0.27])
    theta = throughput_path(values, 2, HAND_SPS)
    # Θ0 = 2·1, Θ1 = 2.9·.95, Θ2 = 3.62·.9, Θ3 = 4.22·.7, Θ4 = 4.58·.6, Θ5 = 4.88·.5, Θ6 = 5.15·.45
    assert theta.tolist() == pytest.approx([2.0, 2.755, 3.258, 2.954, 2.748, 2.44, 2.3175])


def test_scheduled_by_hand():
    assert choose("scheduled", HAND_CONF, [3, 3], HAND_SPS) == [2, 0]  # stops at Θ3 < Θ2
    assert choose("scheduled", HAND_CONF, [1, 3], HAND_SPS) == [1, 1]  # (0,2) unavailable: .9 then .6
    flat = SPSProfile.from_user_table({1: 1.0})  # SPS(B) = 1 up to B = 1, then falls as 1/B
    assert choose("scheduled", HAND_CONF, [3, 3], flat) == [0, 0]  # τ/B ≤ 1 < Θ0 ratio: never worth it


def test_scheduled_ties_keep_prefixes_contiguous():
    conf = [[1.0, 1.0, 1.0, 0.5], [1.0, 1.0, 0.5, 0.5]]
    survival = prefix_survival(torch.tensor(conf, dtype=torch.float64))
    rows, positions, _ = admission_order(survival)
    seen = {0: 0, 1: 0}
    for r, j in zip(rows.tolist(), positions.tolist()):
        assert j == seen[r] + 1  # each request's candidates come in order 1, 2, 3, ...
        seen[r] = j
    # SPS flat up to 7 tokens: the five a = 1 candidates go in (order (0,1) (1,1) (0,2) (1,2) (0,3)), then
    # the first a < 1 meets the drop and the walk stops.
    sps = SPSProfile.from_user_table({7: 1.0, 8: 0.5})
    assert choose("scheduled", conf, [4, 4], sps) == [3, 2]


def test_scheduled_async_uses_budget_from_two_steps_ago():
    policy = make_policy("scheduled-async")
    old = torch.tensor([[0.9, 0.9, 0.9], [0.9, 0.9, 0.9]])  # confident: big budget
    quiet = torch.full((2, 3), 0.01)  # unconfident: Θ1 = 2.01·SPS(3) < Θ0 = 2 -> budget 0
    sps = SPSProfile.from_user_table({2: 1.0, 8: 0.9})
    lengths = torch.tensor([3, 3])
    policy.choose(old, lengths, sps, step=10)  # no history: synchronous fallback
    policy.choose(quiet, lengths, sps, step=11)
    now = torch.tensor([[0.95, 0.2, 0.9], [0.9, 0.9, 0.8]])  # a = [[.95,.19,.171],[.9,.81,.648]]
    got = policy.choose(now, lengths, sps, step=12)
    # Budget from step 10: all 6 stale candidates are worth it on this nearly flat curve -> K = 6.
    assert policy.last_budget == 6 and got.tolist() == [3, 3]
    got = policy.choose(now, lengths, sps, step=13)  # budget from step 11 (quiet): K = 0
    assert policy.last_budget == 0 and got.tolist() == [0, 0]


def test_scheduled_async_top_k_by_current_confidence():
    policy = make_policy("scheduled-async", delay=1)
    sps = SPSProfile.from_user_table({2: 1.0, 4: 0.99, 5: 0.6})  # cliff after B = 4: budget K = 2
    lengths = torch.tensor([3, 3])
    policy.choose(torch.full((2, 3), 0.9), lengths, sps, step=0)
    got = policy.choose(torch.tensor([[0.5, 0.9, 0.9], [0.95, 0.9, 0.1]]), lengths, sps, step=1)
    assert policy.last_budget == 2 and got.tolist() == [0, 2]  # a: [.5,.45,.405] vs [.95,.855,.0855]


def test_async_global_search_crosses_a_jagged_cliff_the_break_cannot():
    # Θ dips at B = 3 then rises: Algorithm 1 stops (lossless but myopic); the stale global search goes on.
    sps = SPSProfile.from_user_table({1: 1.0, 2: 0.55, 3: 0.55, 4: 0.55})
    conf = torch.tensor([[0.8, 0.99, 0.99]])
    assert choose("scheduled", conf.tolist(), [3], sps) == [0]
    policy = make_policy("scheduled-async")
    for step in range(3):
        got = policy.choose(conf, torch.tensor([3]), sps, step=step)
    assert got.tolist() == [3]
    assert expected_throughput(conf, got, sps) > expected_throughput(conf, torch.tensor([0]), sps)


def test_none_fixed_threshold():
    conf = [[0.9, 0.4, 0.9], [0.3, 0.9, 0.9], [0.8, 0.8, 0.8]]
    assert choose("none", conf, [3, 3, 2], HAND_SPS) == [0, 0, 0]
    assert choose("fixed", conf, [3, 3, 2], HAND_SPS) == [3, 3, 2]
    assert choose("fixed", conf, [3, 3, 2], HAND_SPS, num_tokens=1) == [1, 1, 1]
    assert choose("threshold", conf, [3, 3, 2], HAND_SPS, threshold=0.5) == [1, 0, 2]
    assert choose("threshold", conf, [3, 3, 3], HAND_SPS, threshold=0.0) == [3, 3, 3]


def test_missing_confidences():
    nan = float("nan")
    conf = torch.tensor([[nan, nan, nan], [0.2, 0.9, 0.9]])
    assert choose("threshold", conf.tolist(), [3, 3], HAND_SPS, threshold=0.5) == [3, 0]  # no score: no pruning
    policy = make_policy("threshold", threshold=0.5)
    assert policy.choose(None, torch.tensor([2, 3]), HAND_SPS).tolist() == [2, 3]
    # scheduled treats unknown c as the prior: with prior 0 nothing is worth verifying, with 1 everything is
    flat = SPSProfile.from_user_table({16: 1.0})
    assert make_policy("scheduled", missing_confidence=0.0).choose(conf, torch.tensor([3, 3]), flat).tolist() == [0, 3]
    assert make_policy("scheduled", missing_confidence=1.0).choose(None, torch.tensor([3, 2]), flat).tolist() == [3, 2]
    per_position = torch.tensor([0.9, 0.0, 0.0])
    got = make_policy("scheduled", missing_confidence=per_position).choose(None, torch.tensor([3, 3]), flat)
    assert got.tolist() == [1, 1]


def test_max_lengths_and_empty_batch():
    conf = torch.ones(3, 4)
    flat = SPSProfile.from_user_table({64: 1.0})
    for name in ("fixed", "threshold", "scheduled", "scheduled-async"):
        assert make_policy(name).choose(conf, torch.tensor([4, 0, 2]), flat).tolist() == [4, 0, 2]
        assert make_policy(name).choose(torch.ones(0, 4), torch.zeros(0, dtype=torch.long), flat).numel() == 0
    with pytest.raises(ValueError, match="max_lengths must be >= 0"):
        make_policy("fixed").choose(conf, torch.tensor([1, -1, 2]), flat)
    with pytest.raises(ValueError, match=r"confidences must be \[R, γ\]"):
        make_policy("scheduled").choose(conf, torch.tensor([1, 2]), flat)


# ---------------------------------------------------------------------------------------------------------
# Load awareness and optimality
# ---------------------------------------------------------------------------------------------------------
def latency_plus_compute_sps(max_tokens=1024, latency=32.0):
    """A smooth curve like a real accelerator's: flat while latency-bound, ∝ 1/B once compute-bound."""
    return SPSProfile.from_user_table({b: 1.0 / (latency + b) for b in range(1, max_tokens + 1)})


def test_light_load_long_prefixes_heavy_load_short_ones():
    torch.manual_seed(0)
    sps = latency_plus_compute_sps()
    policy = make_policy("scheduled")
    light = policy.choose(torch.full((2, 7), 0.8), torch.full((2,), 7), sps)
    heavy = policy.choose(torch.full((256, 7), 0.8), torch.full((256,), 7), sps)
    assert light.tolist() == [7, 7]
    assert heavy.float().mean() <= 1.0
    means = [policy.choose(torch.full((r, 7), 0.8), torch.full((r,), 7), sps).float().mean().item()
             for r in (1, 4, 16, 64, 256)]
    assert means == sorted(means, reverse=True) and means[0] > means[-1]


def test_scheduled_never_below_none_and_matches_brute_force_on_smooth_sps():
    generator = torch.Generator().manual_seed(0)
    sps = latency_plus_compute_sps(max_tokens=64, latency=6.0)  # Θ unimodal along the path: break is optimal
    for _ in range(40):
        num_requests, gamma = int(torch.randint(1, 4, (1,), generator=generator)), 3
        conf = torch.rand(num_requests, gamma, generator=generator, dtype=torch.float64) ** 0.3
        max_lengths = torch.randint(0, gamma + 1, (num_requests,), generator=generator)
        got = make_policy("scheduled").choose(conf, max_lengths, sps)
        best = max(expected_throughput(conf, torch.tensor(ell), sps)
                   for ell in itertools.product(*(range(int(m) + 1) for m in max_lengths)))
        theta = expected_throughput(conf, got, sps)
        assert theta >= expected_throughput(conf, torch.zeros_like(max_lengths), sps)
        assert theta == pytest.approx(best, rel=1e-12)


def test_scheduled_handles_hundreds_of_requests():
    """Hundreds of requests × γ=16 give valid, contiguous per-request lengths (speed is benchmarked, not asserted)."""
    sps = latency_plus_compute_sps(max_tokens=4096)
    conf = torch.rand(300, 16, generator=torch.Generator().manual_seed(0))
    lengths = torch.full((300,), 16)
    for name in ("scheduled", "scheduled-async"):
        policy = make_policy(name)
        for step in range(3):
            chosen = policy.choose(conf, lengths, sps, step=step)
            assert chosen.shape == (300,) and bool(((chosen >= 0) & (chosen <= 16)).all())
            assert expected_throughput(conf, chosen, sps) >= expected_throughput(conf, torch.zeros_like(chosen), sps)


def test_registry():
    assert {"none", "fixed", "threshold", "scheduled", "scheduled-async"} <= set(available_policies())
    with pytest.raises(ValueError, match="unknown verify policy 'greedy'"):
        make_policy("greedy")
    with pytest.raises(ValueError, match="already registered"):
        register_policy("fixed")(type("Other", (), {"choose": lambda self, *a, **k: None}))
    with pytest.raises(TypeError, match="has no choose"):
        register_policy("broken-policy")(type("Broken", (), {}))
    with pytest.raises(ValueError, match="threshold must be in"):
        make_policy("threshold", threshold=1.5)


# ---------------------------------------------------------------------------------------------------------
# The engine's padded step: walk over widths, drafter cost, skipping the drafter
# ---------------------------------------------------------------------------------------------------------
def learned(policy, confidences, max_lengths, cost):
    """``policy`` after the drafting rounds it always drafts to learn its drafter's acceptance (the estimate it
    then decides by: ``min_learning_rows`` drafted rows), each with these confidences."""
    for _ in range(-(-policy.min_learning_rows // len(confidences))):
        policy.choose(confidences, max_lengths, cost)
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
        one_row.choose(torch.full((1, 5), 0.8, dtype=torch.float64), torch.full((1,), 5), dear)
    assert learning == [True] * 4 and not one_row.wants_drafts(1, dear)
    assert four_rows.wants_drafts(4, dear)
    four_rows.choose(torch.full((4, 5), 0.8, dtype=torch.float64), torch.full((4,), 5), dear)
    assert not four_rows.wants_drafts(4, dear)  # 4 rows drafted once: as much evidence as 4 rounds of one
    weighted = make_policy("scheduled")
    weighted.choose(torch.full((3, 2), 0.5, dtype=torch.float64), torch.full((3,), 2), dear)
    weighted.choose(torch.full((1, 2), 0.9, dtype=torch.float64), torch.full((1,), 2), dear)
    assert weighted.mean_survival[0] == pytest.approx((3 * 0.5 + 0.9) / 4)  # per row, not (0.5 + 0.9) / 2


def test_online_calibration_corrects_over_confidence():
    """Confidences of 0.9 that are never accepted: after some observed rounds the policy scales position 1 down
    (only verified, reached drafts count), verifies less, and without it (online_calibration=False) it doesn't."""
    cost = step_cost(verify_per_token=0.02, fixed=0.1, draft=0.0)
    conf = torch.full((4, 5), 0.9, dtype=torch.float64)
    online, offline = make_policy("scheduled"), make_policy("scheduled", online_calibration=False)
    before = online.choose(conf, torch.full((4,), 5), cost).tolist()
    assert before == offline.choose(conf, torch.full((4,), 5), cost).tolist() and before[0] > 0
    for _ in range(50):
        for policy in (online, offline):
            policy.observe(conf, torch.tensor([3, 3, 0, 5]), torch.tensor([0, 0, 0, 0]))
    factors = online.calibration_factors(5)
    assert factors[0] < 0.2 and factors[1:] == pytest.approx(1.0)  # positions ≥ 2 were never reached
    assert online.choose(conf, torch.full((4,), 5), cost).tolist() == [0, 0, 0, 0]
    assert offline.choose(conf, torch.full((4,), 5), cost).tolist() == before
    # accepted drafts count as realised: all accepted at confidence 0.5 -> factor > 1 (clipped c ≤ 1)
    under = make_policy("scheduled")
    for _ in range(50):
        under.observe(torch.full((2, 3), 0.5, dtype=torch.float64), torch.tensor([3, 3]), torch.tensor([3, 3]))
    assert (under.calibration_factors(3) > 1.5).all()


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
    assert policy.step_time_ratios["drafted"] == pytest.approx(3.0, rel=0.1)
    # (the plain kind's first step moved the ratio it borrowed from the drafted kind, 1.2, towards 1.0)
    assert policy.step_time_ratios["plain"] == pytest.approx(1.0, rel=0.02)
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
    ratios = policy.step_time_ratios
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
    assert policy.choose(conf, torch.full((4,), 4), cost, **lookup_rows).tolist() == [3, 3, 3, 3]
    assert policy.step_time_ratios["lookup"] == 1.0  # nothing timed yet
    for _ in range(30):
        policy.observe_step(False, predicted_seconds=0.14, seconds=0.28, wide=True)
        policy.observe_step(False, predicted_seconds=0.108, seconds=0.108, wide=False)
    ratios = policy.step_time_ratios
    assert ratios["lookup"] == pytest.approx(2.0, rel=0.05) and ratios["plain"] == pytest.approx(1.0, rel=0.05)
    assert ratios["drafted"] == pytest.approx(2.0, rel=0.05)  # a kind not timed yet borrows its width class's
    assert policy.choose(conf, torch.full((4,), 4), cost, **lookup_rows).tolist() == [0, 0, 0, 0]
    factors = policy.step_time_factors(3, drafted=False)
    margin = policy.speculation_margin
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

    margin = make_policy("scheduled").speculation_margin
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
        for _ in range(policy.min_probe_evidence):
            policy.choose(torch.full((4, 5), 0.8, dtype=torch.float64), torch.full((4,), 5), cheap)
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
    plain steps look dear at 16 rows — one factor for all plain steps did, and the policy drafted where drafting
    lost — and the drafted kind is corrected against the plain steps of its own row count."""
    policy = make_policy("scheduled", probe_interval=100)
    for _ in range(40):
        policy.observe_step(False, predicted_seconds=0.075, seconds=0.105, rows=9)
        policy.observe_step(False, predicted_seconds=0.152, seconds=0.145, rows=16)
        policy.observe_step(True, predicted_seconds=0.308, seconds=0.308 * 0.954 * 1.25, wide=True, rows=16)
    rho = policy.plain_step_ratios
    assert rho["9 rows"] == pytest.approx(1.4, rel=0.02) and rho["16 rows"] == pytest.approx(0.954, rel=0.02)
    ratios = policy.step_time_ratios
    assert ratios["plain"] == 1.0 and ratios["drafted"] == pytest.approx(1.25, rel=0.02)
    # a kind first seen at a row count whose plain steps were never timed compares with the nearest row count's
    fresh = make_policy("scheduled")
    for _ in range(40):
        fresh.observe_step(False, predicted_seconds=0.1, seconds=0.2, rows=4)
        fresh.observe_step(False, predicted_seconds=0.1, seconds=0.1, rows=16)
    for _ in range(40):
        fresh.observe_step(False, predicted_seconds=0.1, seconds=0.3, wide=True, rows=5)
    assert fresh.step_time_ratios["lookup"] == pytest.approx(1.5, rel=0.02)  # 0.3 / (0.1 · ρ(4) = 2)


def test_wide_step_corrections_are_kept_per_row_count_and_wait_for_a_plain_step():
    """A wide step is 1.1× a plain one at 4 rows and 1.3× at 16 (more padded attention, more logits): each row
    count keeps its own κ. Before any plain step was timed, a drafted step's time says how fast the machine is, not
    how dear drafting is: it sets ρ (which the first plain step then replaces), leaves κ alone, and asks for a
    plain step next."""
    policy = make_policy("scheduled")
    for _ in range(3):
        policy.observe_step(True, predicted_seconds=0.2, seconds=0.16, wide=True, rows=16)  # the machine is fast
    assert policy.step_time_ratios_at(16)["drafted"] == 1.0
    assert policy.plain_step_ratios == {"16 rows": pytest.approx(0.8)}
    # so the next step is a plain one, lookup proposals and the drafter both set aside
    cheap = step_cost(verify_per_token=0.001, fixed=0.1, draft=0.001)
    assert not policy.wants_drafts(4, cheap)
    use_lookup, run_drafter = policy.plan_sources(np.full((4, 2), 0.9), cheap, drafter_available=True)
    assert not run_drafter and not use_lookup.any()
    policy.observe_step(False, predicted_seconds=0.1, seconds=0.1, rows=16)
    assert policy.plain_step_ratios == {"16 rows": 1.0}  # a real plain step replaces the machine-speed guess
    assert not policy.wants_drafts(4, cheap)  # one plain step is one sample of a noisy machine: more first
    for _ in range(policy.min_plain_steps - 1):
        policy.observe_step(False, predicted_seconds=0.1, seconds=0.1, rows=16)
    assert policy.wants_drafts(4, cheap)
    for _ in range(60):
        for rows, relative in ((4, 1.1), (16, 1.3)):
            policy.observe_step(False, predicted_seconds=0.1, seconds=0.1, rows=rows)
            policy.observe_step(False, predicted_seconds=0.2, seconds=0.2 * relative, wide=True, rows=rows)
    assert policy.step_time_ratios_at(4)["lookup"] == pytest.approx(1.1, rel=0.01)
    assert policy.step_time_ratios_at(16)["lookup"] == pytest.approx(1.3, rel=0.01)
    assert policy.step_time_ratios_at(12)["lookup"] == pytest.approx(1.3, rel=0.01)  # the nearest row count's
    margin = policy.speculation_margin  # every kind but a plain step is priced with it
    assert policy.step_time_factors(3, drafted=False, rows=16).tolist() == pytest.approx(
        [1.0] + [1.3 * margin] * 3, rel=0.01)


def test_a_policy_that_keeps_speculating_re_times_plain_steps_ever_more_rarely():
    """κ is learned relative to ρ, which only plain steps time: a policy that speculates every step would keep the
    ρ of its first few plain steps for ever (one slow one once priced drafting at 0.72× a plain step). After
    ``plain_refresh_interval`` timed speculative steps in a row it takes a plain step, and the next refresh comes
    twice as late."""
    policy = make_policy("scheduled")
    cheap = step_cost(verify_per_token=0.001, fixed=0.1, draft=0.001)
    for _ in range(policy.min_plain_steps):
        policy.observe_step(False, predicted_seconds=0.1, seconds=0.1, rows=4)
    interval = policy.plain_refresh_interval
    for every in (interval, 2 * interval):
        for _ in range(every):
            assert policy.wants_drafts(4, cheap)
            policy.observe_step(True, predicted_seconds=0.2, seconds=0.2, wide=True, rows=4)
        assert not policy.wants_drafts(4, cheap)
        _, run_drafter = policy.plan_sources(np.full((4, 2), 0.9), cheap, drafter_available=True)
        assert not run_drafter
        policy.observe_step(False, predicted_seconds=0.1, seconds=0.13, rows=4)
        assert policy.wants_drafts(4, cheap)
    assert policy.plain_step_ratios["4 rows"] > 1.0  # the refreshes moved ρ


def test_a_kinds_correction_follows_the_current_plain_step_ratio():
    """κ is the kind's measured / predicted ratio over ρ *now*: drafted steps timed at 1.2× their prediction while
    plain steps ran 1.3× (an early, slow stretch) are 1.2 / 1.1 a plain step once plain steps settle at 1.1×, not
    the 0.92 of that stretch."""
    policy = make_policy("scheduled")
    for _ in range(policy.min_plain_steps):
        policy.observe_step(False, predicted_seconds=0.1, seconds=0.13, rows=16)
    for _ in range(20):
        policy.observe_step(True, predicted_seconds=0.2, seconds=0.24, wide=True, rows=16)
    assert policy.step_time_ratios_at(16)["drafted"] == pytest.approx(1.2 / 1.3, rel=0.02)
    for _ in range(60):
        policy.observe_step(False, predicted_seconds=0.1, seconds=0.11, rows=16)
    assert policy.step_time_ratios_at(16)["drafted"] == pytest.approx(1.2 / 1.1, rel=0.02)


def test_a_kind_is_believed_dearer_at_once_and_cheaper_only_on_more_evidence():
    """Four steps of a kind measuring 1.3× a plain step move its κ most of the way (a dear kind keeps losing while
    it settles); four measuring 0.8× move it only a little (choosing on a few noisy steps favours kinds that
    happened to look cheap). Twenty steps settle either."""
    def learned(relative: float, steps: int) -> float:
        policy = make_policy("scheduled")
        for _ in range(policy.min_plain_steps):
            policy.observe_step(False, predicted_seconds=0.1, seconds=0.1, rows=4)
        for _ in range(steps):
            policy.observe_step(True, predicted_seconds=0.2, seconds=0.2 * relative, wide=True, rows=4)
        return policy.step_time_ratios_at(4)["drafted"]

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
    assert make_policy("scheduled").choose(conf, torch.full((4,), 1), cost, **lookup_rows).tolist() == [0] * 4
    eager = make_policy("scheduled", speculation_margin=1.0)
    assert eager.choose(conf, torch.full((4,), 1), cost, **lookup_rows).tolist() == [1] * 4
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
            policy.choose(torch.full((4, 5), conf, dtype=torch.float64), torch.full((4,), 5), cheap)
        assert policy.mean_survival[0] == pytest.approx(0.1, abs=0.01)
    assert sum(was_good.wants_drafts(4, dear) for _ in range(8)) == 2
    assert not any(never_good.wants_drafts(4, dear) for _ in range(8))


def test_rounds_of_other_widths_keep_learning_the_drafter():
    """With lookup in the batch a round is as wide as its longest proposal, wider than the drafter's block: the
    drafter's rows carry zeros there. Such rounds must add to the drafter's estimate, not restart it (a restart
    kept the policy in its always-drafting learning rounds for good: at C = 16 it drafted every step and lost 16 %)."""
    policy = make_policy("scheduled")
    cost = step_cost(verify_per_token=0.01, fixed=0.1, draft=0.01, max_width=12)
    for width in (4, 10, 4, 7, 4, 10):  # drafter block 4, lookup proposals of up to 9 drafts widen some rounds
        conf = np.zeros((2, width))
        conf[:, :4] = 0.5
        policy.choose(conf, np.array([4, 4]), cost, drafter_rows=np.ones(2, dtype=bool), drafted=True)
    assert policy._survival_rounds == 6 and policy._survival_rows == 12 >= policy.min_learning_rows
    assert policy.mean_survival.size == 10
    assert policy.mean_survival[:4] == pytest.approx(0.5 ** np.arange(1, 5))  # nothing verified: no correction
    assert not policy.mean_survival[4:].any()


def test_an_under_confident_head_is_corrected_within_a_few_dozen_drafts():
    """The head says 0.2 at position 1, the drafts are accepted 3 times in 8 (37.5 %): after 32 verified drafts the
    factor is past 1.5 (the prior is 16 drafts at the mean prediction; counted as 16 units of predicted mass it was
    worth 80 such drafts and the factor was still 1.23)."""
    policy = make_policy("scheduled")
    conf = torch.full((4, 3), 0.2, dtype=torch.float64)
    for accepted in ([1, 0, 0, 1], [0, 1, 0, 0]) * 4:
        policy.observe(conf, torch.ones(4, dtype=torch.long), torch.tensor(accepted))
    factor = policy.calibration_factors(3)
    realised, predicted, prior = 12.0, 0.2 * 32, 16 * 0.2
    assert factor[0] == pytest.approx((realised + prior) / (predicted + prior), rel=0.02) and factor[0] > 1.5
    assert factor[1:].tolist() == [1.0, 1.0]  # never reached
