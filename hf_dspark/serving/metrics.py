"""EngineMetrics: what the serving engine did, as a dict and a log line.

Verify budget = drafts verified per request per step (ℓ averaged over every request-round): the quantity the
scheduler adapts to load (long on an idle engine, short under heavy load). τ counts the bonus token, as in
:class:`hf_dspark.DSparkStats`, which the engine feeds per round. Wasted verify tokens are verified drafts that
were rejected; padding tokens are the extra slots of a padded verify batch (rows shorter than the widest).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from ..metrics import DSparkStats

logger = logging.getLogger("hf_dspark.serving")


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else None


#: decode steps by (drafter ran, drafts verified): a plain step, lookup drafts verified without a drafter pass, a
#: drafter pass whose drafts (or lookup drafts) were verified, and a drafter pass that then verified nothing
STEP_KINDS = {False: {False: "plain", True: "lookup"}, True: {False: "drafted, nothing verified", True: "drafted"}}


@dataclass
class EngineMetrics:
    block_size: int
    stats: DSparkStats = field(init=False)
    start_time: float = field(default_factory=time.perf_counter)
    steps: int = 0
    decode_steps: int = 0
    busy_seconds: float = 0.0  # in steps, less step_cost_seconds (setup): what tok/s divides by
    step_cost_seconds: float = 0.0  # measuring the engine's step cost once (or reading it from the disk cache)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    generated_tokens: int = 0
    prefill_tokens: int = 0
    reused_prompt_tokens: int = 0  # prompt tokens a scope's prefix cache served instead of a prefill
    prefill_forwards: int = 0  # target forwards spent on prompts (short prompts admitted together share one)
    verify_tokens: int = 0  # Σ_steps B = Σ_r (1 + ℓ_r)
    padded_verify_tokens: int = 0  # Σ_steps R · W (what the padded forward actually computed)
    verified_drafts: int = 0  # Σ ℓ_r
    request_rounds: int = 0  # Σ_steps R
    wasted_verify_tokens: int = 0  # verified drafts that were rejected
    finished: dict = field(default_factory=dict)  # finish reason -> count
    rejected_requests: int = 0
    compactions: int = 0
    joined_in_place: int = 0  # requests that joined the batch in a finished request's row (no copy of the batch)
    skipped_draft_steps: int = 0  # decode steps where the policy skipped the drafter (drafting could not pay)
    isolated_step_failures: int = 0  # decode steps that raised (the batch resumed, at most one request failed)
    request_latencies: list[dict] = field(default_factory=list)  # per finished request (bounded, see below)
    max_kept_requests: int = 100_000
    # per kind of decode step (STEP_KINDS): steps, rows, committed tokens, seconds — where a policy's time goes
    step_kinds: dict = field(default_factory=dict)

    def __post_init__(self):
        self.stats = DSparkStats.new(self.block_size)

    def observe_decode_step(self, num_rows: int, width: int, lengths: list[int], accepted: list[int], *,
                            drafted: bool = False, committed: int | None = None, seconds: float = 0.0) -> None:
        """One decode step: R rows verified at ``width``; ``drafted``: the drafter ran; ``committed`` tokens
        (default: every row's accepted drafts + 1) in ``seconds`` (drafter pass + verify)."""
        kind = STEP_KINDS[bool(drafted)][width > 1]
        entry = self.step_kinds.setdefault(kind, {"steps": 0, "rows": 0, "tokens": 0, "seconds": 0.0})
        entry["steps"] += 1
        entry["rows"] += num_rows
        entry["tokens"] += sum(accepted) + num_rows if committed is None else committed
        entry["seconds"] += seconds
        self.decode_steps += 1
        self.request_rounds += num_rows
        self.verify_tokens += num_rows + sum(lengths)
        self.padded_verify_tokens += num_rows * width
        self.verified_drafts += sum(lengths)
        self.wasted_verify_tokens += sum(n - a for n, a in zip(lengths, accepted))

    def observe_finished(self, reason: str, latency: dict) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1
        if len(self.request_latencies) < self.max_kept_requests:
            self.request_latencies.append(latency)

    @property
    def mean_verify_budget(self) -> float:
        """Drafts verified per request per step."""
        return self.verified_drafts / self.request_rounds if self.request_rounds else 0.0

    def to_dict(self) -> dict:
        latencies = self.request_latencies
        return {
            "steps": self.steps,
            "decode_steps": self.decode_steps,
            "uptime_s": time.perf_counter() - self.start_time,
            "busy_s": self.busy_seconds,
            "step_cost_s": self.step_cost_seconds,
            "generated_tokens": self.generated_tokens,
            "throughput_tok_s": self.generated_tokens / self.busy_seconds if self.busy_seconds else 0.0,
            "mean_batch_size": self.request_rounds / self.decode_steps if self.decode_steps else 0.0,
            "mean_verify_budget": self.mean_verify_budget,
            "mean_verify_tokens": self.verify_tokens / self.decode_steps if self.decode_steps else 0.0,
            "tau": self.stats.tau,
            "acceptance_rate": self.stats.acceptance_rate,
            "conditional_acceptance": self.stats.conditional_acceptance,
            "wasted_verify_tokens": self.wasted_verify_tokens,
            "padding_tokens": self.padded_verify_tokens - self.verify_tokens,
            "prefill_tokens": self.prefill_tokens, "reused_prompt_tokens": self.reused_prompt_tokens,
            "prefill_forwards": self.prefill_forwards,
            "prefill_s": self.prefill_seconds,
            "draft_s": self.draft_seconds,
            "verify_s": self.verify_seconds,
            "finished_requests": dict(self.finished),
            "rejected_requests": self.rejected_requests,
            "compactions": self.compactions,
            "joined_in_place": self.joined_in_place,
            "skipped_draft_steps": self.skipped_draft_steps,
            "step_kinds": {kind: dict(entry) for kind, entry in self.step_kinds.items()},
            "isolated_step_failures": self.isolated_step_failures,
            "mean_ttft_s": _mean([m["ttft_s"] for m in latencies]),
            "mean_itl_s": _mean([m["mean_itl_s"] for m in latencies]),
            "mean_request_tok_s": _mean([m["tokens_per_second"] for m in latencies]),
        }

    def summary(self) -> str:
        d = self.to_dict()
        ttft = d["mean_ttft_s"]
        per_user = d["mean_request_tok_s"]
        setup = f", step cost measured in {d['step_cost_s']:.1f} s (setup, not counted)" if d["step_cost_s"] else ""
        return (f"engine: {d['generated_tokens']} tokens in {d['decode_steps']} decode steps, "
                f"{d['throughput_tok_s']:.1f} tok/s, mean batch {d['mean_batch_size']:.1f}, "
                f"mean verify budget {d['mean_verify_budget']:.2f} drafts/request/step "
                f"({d['mean_verify_tokens']:.1f} tokens/step), tau={d['tau']:.2f} (incl. bonus), "
                f"wasted verify tokens {d['wasted_verify_tokens']}, padding {d['padding_tokens']}, "
                f"TTFT {'-' if ttft is None else f'{ttft * 1e3:.0f} ms'}, per-request "
                f"{'-' if per_user is None else f'{per_user:.1f}'} tok/s{setup}")

    def log(self) -> None:
        logger.info(self.summary())


__all__ = ["EngineMetrics"]
