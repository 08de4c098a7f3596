"""Serving many requests: the continuous-batching engine (engine.py) with its requests and metrics.

The verify-length policies and the measured step cost it schedules with live in ``hf_dspark.scheduling`` (shared
with ``generate``); ``hf_dspark.serving.scheduler`` and ``hf_dspark.serving.profiler`` remain importable as the same
module objects, so earlier imports and patches keep working.
"""

import sys

from ..scheduling import policies as scheduler
from ..scheduling import step_cost as profiler

sys.modules[__name__ + ".scheduler"] = scheduler
sys.modules[__name__ + ".profiler"] = profiler

from ..scheduling import (  # noqa: E402
    AsyncScheduledPolicy,
    FixedLengthPolicy,
    NoSpeculationPolicy,
    ScheduledPolicy,
    SPSProfile,
    StepCostProfile,
    ThresholdPolicy,
    VerifyPolicy,
    available_policies,
    make_policy,
    profile_step_cost,
    profile_verify_sps,
    register_policy,
)
from .engine import DSparkEngine  # noqa: E402
from .requests import FinishReason, RequestHandle, RequestOutput, RequestRejectedError, SamplingParams  # noqa: E402

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
