"""Serving many requests: the continuous-batching engine and the requests it serves.

    engine.py            DSparkEngine: submission, the step loop, decode rounds, retirement, metrics
    admission.py         admission and prefill: waiting requests, their prefills until they join the batch
    batch.py             the running batch: one ragged cache, rows joining in place and leaving
    requests.py          SamplingParams, the engine-side Request, the caller's RequestHandle, validation
    prefixes.py          the engine's prefix cache per salt
    step_cost_source.py  the step cost the engine schedules with (given, or measured on first use)
    fault_isolation.py   which request a failed decode step is traced to
    processing.py        per-request logits processing over one batch
    metrics.py           EngineMetrics

The verify-length policies and the measured step cost live in ``hf_dspark.scheduling`` (shared with ``generate``).
"""

from .engine import DSparkEngine
from .requests import FinishReason, RequestHandle, RequestOutput, RequestRejectedError, SamplingParams

__all__ = ["DSparkEngine", "FinishReason", "RequestHandle", "RequestOutput", "RequestRejectedError", "SamplingParams"]
