"""Verify-length policies on hand-made confidence tables, incl. the paper's App. A counterexample; the policy
protocol and its registry."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from hf_dspark.scheduling import (
    PolicyInputs,
    SPSProfile,
    VerifyPolicy,
    available_policies,
    make_policy,
    register_policy,
)
from hf_dspark.scheduling.algorithm1 import (
    admission_order,
    expected_throughput,
    fill_confidences,
    lengths_from_admissions,
    prefix_survival,
    throughput_path,
)

APP_A_SPS = SPSProfile.from_user_table({1: 1.0, 2: 0.5, 3: 0.45})


def choose(name, conf, max_lengths, cost, **kwargs):
    policy = make_policy(name, **kwargs)
    inputs = PolicyInputs(torch.tensor(conf, dtype=torch.float64), torch.tensor(max_lengths), cost)
    return policy.choose(inputs).tolist()


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
        lambda x1: policy.choose(PolicyInputs(torch.tensor(app_a_table(x1)), torch.tensor([2]), APP_A_SPS))[0].item()
        >= 1)
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
            policy.choose(PolicyInputs(torch.tensor(app_a_table(A)), torch.tensor([2]), APP_A_SPS, step=step))
        chosen = policy.choose(PolicyInputs(torch.tensor(app_a_table(x1)), torch.tensor([2]), APP_A_SPS, step=2))
        return chosen[0].item() >= 1

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
    policy.choose(PolicyInputs(old, lengths, sps, step=10))  # no history: synchronous fallback
    policy.choose(PolicyInputs(quiet, lengths, sps, step=11))
    now = torch.tensor([[0.95, 0.2, 0.9], [0.9, 0.9, 0.8]])  # a = [[.95,.19,.171],[.9,.81,.648]]
    got = policy.choose(PolicyInputs(now, lengths, sps, step=12))
    # Budget from step 10: all 6 stale candidates are worth it on this nearly flat curve -> K = 6.
    assert policy.last_budget == 6 and got.tolist() == [3, 3]
    got = policy.choose(PolicyInputs(now, lengths, sps, step=13))  # budget from step 11 (quiet): K = 0
    assert policy.last_budget == 0 and got.tolist() == [0, 0]


def test_scheduled_async_top_k_by_current_confidence():
    policy = make_policy("scheduled-async", delay=1)
    sps = SPSProfile.from_user_table({2: 1.0, 4: 0.99, 5: 0.6})  # cliff after B = 4: budget K = 2
    lengths = torch.tensor([3, 3])
    policy.choose(PolicyInputs(torch.full((2, 3), 0.9), lengths, sps, step=0))
    got = policy.choose(PolicyInputs(torch.tensor([[0.5, 0.9, 0.9], [0.95, 0.9, 0.1]]), lengths, sps, step=1))
    assert policy.last_budget == 2 and got.tolist() == [0, 2]  # a: [.5,.45,.405] vs [.95,.855,.0855]


def test_async_global_search_crosses_a_jagged_cliff_the_break_cannot():
    # Θ dips at B = 3 then rises: Algorithm 1 stops (lossless but myopic); the stale global search goes on.
    sps = SPSProfile.from_user_table({1: 1.0, 2: 0.55, 3: 0.55, 4: 0.55})
    conf = torch.tensor([[0.8, 0.99, 0.99]])
    assert choose("scheduled", conf.tolist(), [3], sps) == [0]
    policy = make_policy("scheduled-async")
    for step in range(3):
        got = policy.choose(PolicyInputs(conf, torch.tensor([3]), sps, step=step))
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
    assert policy.choose(PolicyInputs(None, torch.tensor([2, 3]), HAND_SPS)).tolist() == [2, 3]
    # scheduled treats unknown c as the prior: with prior 0 nothing is worth verifying, with 1 everything is
    flat = SPSProfile.from_user_table({16: 1.0})
    no_prior, full_prior = (make_policy("scheduled", missing_confidence=c) for c in (0.0, 1.0))
    assert no_prior.choose(PolicyInputs(conf, torch.tensor([3, 3]), flat)).tolist() == [0, 3]
    assert full_prior.choose(PolicyInputs(None, torch.tensor([3, 2]), flat)).tolist() == [3, 2]
    per_position = torch.tensor([0.9, 0.0, 0.0])
    got = make_policy("scheduled", missing_confidence=per_position).choose(
        PolicyInputs(None, torch.tensor([3, 3]), flat))
    assert got.tolist() == [1, 1]


def test_max_lengths_and_empty_batch():
    conf = torch.ones(3, 4)
    flat = SPSProfile.from_user_table({64: 1.0})
    for name in ("fixed", "threshold", "scheduled", "scheduled-async"):
        assert make_policy(name).choose(PolicyInputs(conf, torch.tensor([4, 0, 2]), flat)).tolist() == [4, 0, 2]
        empty = PolicyInputs(torch.ones(0, 4), torch.zeros(0, dtype=torch.long), flat)
        assert make_policy(name).choose(empty).numel() == 0
    with pytest.raises(ValueError, match="max_lengths must be >= 0"):
        make_policy("fixed").choose(PolicyInputs(conf, torch.tensor([1, -1, 2]), flat))
    with pytest.raises(ValueError, match=r"confidences must be \[R, γ\]"):
        make_policy("scheduled").choose(PolicyInputs(conf, torch.tensor([1, 2]), flat))


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
    light = policy.choose(PolicyInputs(torch.full((2, 7), 0.8), torch.full((2,), 7), sps))
    heavy = policy.choose(PolicyInputs(torch.full((256, 7), 0.8), torch.full((256,), 7), sps))
    assert light.tolist() == [7, 7]
    assert heavy.float().mean() <= 1.0
    means = [policy.choose(PolicyInputs(torch.full((r, 7), 0.8), torch.full((r,), 7), sps)).float().mean().item()
             for r in (1, 4, 16, 64, 256)]
    assert means == sorted(means, reverse=True) and means[0] > means[-1]


def test_scheduled_never_below_none_and_matches_brute_force_on_smooth_sps():
    generator = torch.Generator().manual_seed(0)
    sps = latency_plus_compute_sps(max_tokens=64, latency=6.0)  # Θ unimodal along the path: break is optimal
    for _ in range(40):
        num_requests, gamma = int(torch.randint(1, 4, (1,), generator=generator)), 3
        conf = torch.rand(num_requests, gamma, generator=generator, dtype=torch.float64) ** 0.3
        max_lengths = torch.randint(0, gamma + 1, (num_requests,), generator=generator)
        got = make_policy("scheduled").choose(PolicyInputs(conf, max_lengths, sps))
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
            chosen = policy.choose(PolicyInputs(conf, lengths, sps, step=step))
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


def test_a_user_defined_policy_registers_and_runs_through_the_same_inputs():
    """A policy of one's own: subclass VerifyPolicy, implement choose(inputs), register it; make_policy builds it
    and every hook it does not override keeps its neutral default."""

    class FirstTwo(VerifyPolicy):
        def choose(self, inputs: PolicyInputs) -> torch.Tensor:
            return inputs.result(np.minimum(inputs.lengths(), 2))

    register_policy("test-first-two", overwrite=True)(FirstTwo)
    policy = make_policy("test-first-two")
    assert policy.name == "test-first-two" and "test-first-two" in available_policies()
    assert policy.choose(PolicyInputs(None, torch.tensor([4, 1, 0]))).tolist() == [2, 1, 0]
    assert policy.max_drafts(5) == 5 and policy.draft_threshold() == 0.0 and policy.wants_drafts(3, None)
    assert not policy.needs_step_cost and not policy.supports_lookup


def test_registering_a_choose_with_another_signature_names_the_one_it_needs():
    class Positional(VerifyPolicy):
        def choose(self, confidences, max_lengths, cost):
            return max_lengths

    with pytest.raises(TypeError, match=r"Positional.choose must take one argument.*def choose\(self, inputs\)"):
        register_policy("test-positional")(Positional)
    assert "test-positional" not in available_policies()


def test_policy_inputs_give_host_lengths_and_results_on_the_callers_device():
    inputs = PolicyInputs(None, np.array([3, 0, 2]))
    assert inputs.lengths().dtype == np.int64 and inputs.lengths().tolist() == [3, 0, 2]
    result = inputs.result(np.array([1, 0, 2]))
    assert result.dtype == torch.long and result.device.type == "cpu" and result.tolist() == [1, 0, 2]
    with pytest.raises(ValueError, match="max_lengths must be >= 0"):
        PolicyInputs(None, [1, -1]).lengths()
