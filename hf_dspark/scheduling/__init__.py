"""How much to verify each round, shared by ``generate`` and the serving engine: verify-length policies
(policies.py: none / fixed / threshold / Algorithm 1 and its async variant, one registry; throughput.py: the
arithmetic of Algorithm 1 they share) and the measured cost of a round on this machine (step_cost.py: SPS(B) and
the padded drafter + verify step cost)."""

from .policies import (
    AsyncScheduledPolicy,
    FixedLengthPolicy,
    NoSpeculationPolicy,
    ScheduledPolicy,
    ThresholdPolicy,
    VerifyPolicy,
    available_policies,
    make_policy,
    register_policy,
)
from .step_cost import SPSProfile, StepCostProfile, profile_step_cost, profile_verify_sps

__all__ = [
    "AsyncScheduledPolicy",
    "FixedLengthPolicy",
    "NoSpeculationPolicy",
    "SPSProfile",
    "ScheduledPolicy",
    "StepCostProfile",
    "ThresholdPolicy",
    "VerifyPolicy",
    "available_policies",
    "make_policy",
    "profile_step_cost",
    "profile_verify_sps",
    "register_policy",
]
