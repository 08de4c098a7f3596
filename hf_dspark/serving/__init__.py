"""Serving many requests: the continuous-batching engine (engine.py), verify-length policies (scheduler.py) and
the measured cost curves SPS(B) and the engine step cost (profiler.py)."""

from .engine import DSparkEngine
from .profiler import SPSProfile, StepCostProfile, profile_step_cost, profile_verify_sps
from .requests import FinishReason, RequestHandle, RequestOutput, RequestRejectedError, SamplingParams
from .scheduler import (
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

__all__ = [
    "AsyncScheduledPolicy",
    "DSparkEngine",
    "FinishReason",
    "RequestHandle",
    "RequestOutput",
    "RequestRejectedError",
    "SamplingParams",
    "FixedLengthPolicy",
    "NoSpeculationPolicy",
    "SPSProfile",
    "StepCostProfile",
    "ScheduledPolicy",
    "ThresholdPolicy",
    "VerifyPolicy",
    "available_policies",
    "make_policy",
    "profile_step_cost",
    "profile_verify_sps",
    "register_policy",
]
