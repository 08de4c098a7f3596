"""How much to verify each round, shared by ``generate`` and the serving engine: pure arithmetic over measured costs.

Policies (policies.py: the inputs of a choice, the protocol, the registry, none / fixed / threshold; scheduled.py:
Algorithm 1 on measured costs; scheduled_async.py: its §5.2 variant) built on Algorithm 1's arithmetic
(algorithm1.py) and on small estimators the scheduled policy composes (acceptance.py: the drafter's acceptance;
step_time.py: measured step times; probes.py: when to re-measure a skipped drafter). Costs: the tables
(cost_tables.py: SPS(B) and the padded drafter + verify step cost), measured on this machine (step_cost.py, timing
one cell in forward_timing.py on the grids of cost_grids.py) and kept on disk (profile_cache.py).
"""

from .cost_tables import SPSProfile, StepCostProfile
from .policies import (
    FixedLengthPolicy,
    NoSpeculationPolicy,
    PolicyInputs,
    ThresholdPolicy,
    VerifyPolicy,
    available_policies,
    make_policy,
    register_policy,
)
from .scheduled import ScheduledPolicy
from .scheduled_async import AsyncScheduledPolicy
from .step_cost import profile_step_cost, profile_verify_sps

__all__ = [
    "AsyncScheduledPolicy",
    "FixedLengthPolicy",
    "NoSpeculationPolicy",
    "PolicyInputs",
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
