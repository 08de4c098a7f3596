"""Serving many requests: the continuous-batching engine (engine.py), verify-length policies (scheduler.py) and
the verify cost curve SPS(B) (profiler.py)."""

from .engine import DSparkEngine
from .profiler import SPSProfile, profile_verify_sps
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
    "ScheduledPolicy",
    "ThresholdPolicy",
    "VerifyPolicy",
    "available_policies",
    "make_policy",
    "profile_verify_sps",
    "register_policy",
]
