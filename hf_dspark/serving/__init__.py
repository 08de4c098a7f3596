"""Serving many requests: verify-length policies (scheduler.py) and the verify cost curve SPS(B) (profiler.py)."""

from .profiler import SPSProfile, profile_verify_sps
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
    "FixedLengthPolicy",
    "NoSpeculationPolicy",
    "SPSProfile",
    "ScheduledPolicy",
    "ThresholdPolicy",
    "VerifyPolicy",
    "available_policies",
    "make_policy",
    "profile_verify_sps",
    "register_policy",
]
