"""DSparkStats: what a user reads after a call (``draft.stats``) and what the engine aggregates.

τ (tokens committed per verification round) **includes** the recovered/bonus token, pooled over rounds:
Σ committed / rounds; a round cut short by EOS or the length limit counts only the tokens it committed.
Per-position rates (1-based position j):

* conditional  q_j = P(draft j accepted | drafts 1..j-1 accepted, draft j proposed)  (paper Fig. 2);
* unconditional r_j = P(drafts 1..j all accepted | draft j proposed)  (vLLM's convention).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

logger = logging.getLogger("hf_dspark")


@dataclass
class DSparkStats:
    block_size: int
    rounds: int = 0
    committed_tokens: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    proposed_at: list[int] = field(default_factory=list)  # rounds with draft j proposed
    reached_at: list[int] = field(default_factory=list)  # ... and drafts < j all accepted
    accepted_at: list[int] = field(default_factory=list)  # ... and draft j accepted too
    prefill_seconds: float = 0.0
    prompt_tokens: int = 0  # prompt tokens of the call ...
    reused_prompt_tokens: int = 0  # ... of which the prefix cache held K/V (not prefilled again)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    # per proposal source ("drafter", "lookup"; "none" = plain decoding rounds): the same counters per source
    by_source: dict = field(default_factory=dict)

    @classmethod
    def new(cls, block_size: int) -> "DSparkStats":
        return cls(block_size=block_size, proposed_at=[0] * block_size, reached_at=[0] * block_size,
                   accepted_at=[0] * block_size)

    def observe_round(self, num_proposed: torch.Tensor | Sequence[int], num_accepted: torch.Tensor | Sequence[int],
                      num_committed: torch.Tensor | Sequence[int], sources: Sequence[str] | None = None) -> None:
        """One verification round for each row: drafts proposed, drafts accepted, tokens actually committed
        (host ints, or tensors), and optionally where each row's drafts came from (split in ``by_source``)."""
        proposed, accepted, committed = (t.tolist() if isinstance(t, torch.Tensor) else list(t)
                                         for t in (num_proposed, num_accepted, num_committed))
        if sources is not None:
            for source in set(sources):
                rows = [i for i, s in enumerate(sources) if s == source]
                child = self.by_source.setdefault(source, DSparkStats.new(self.block_size))
                child.observe_round([proposed[i] for i in rows], [accepted[i] for i in rows],
                                    [committed[i] for i in rows])
        longest = max(proposed, default=0)
        if longest > len(self.proposed_at):  # lookup proposals may be longer than the drafter's block
            for counts in (self.proposed_at, self.reached_at, self.accepted_at):
                counts.extend([0] * (longest - len(counts)))
        self.rounds += len(proposed)
        self.committed_tokens += sum(committed)
        self.proposed_tokens += sum(proposed)
        self.accepted_tokens += sum(accepted)
        for m, a in zip(proposed, accepted):
            for j in range(m):
                self.proposed_at[j] += 1
                if j <= a:
                    self.reached_at[j] += 1
                if j < a:
                    self.accepted_at[j] += 1

    @property
    def tau(self) -> float:
        return self.committed_tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def conditional_acceptance(self) -> list[float]:
        return [a / r if r else float("nan") for a, r in zip(self.accepted_at, self.reached_at)]

    @property
    def unconditional_acceptance(self) -> list[float]:
        return [a / p if p else float("nan") for a, p in zip(self.accepted_at, self.proposed_at)]

    def merge(self, other: "DSparkStats") -> "DSparkStats":
        out = DSparkStats.new(max(self.block_size, other.block_size, len(self.proposed_at), len(other.proposed_at)))
        for s in (self, other):
            for name in ("rounds", "committed_tokens", "proposed_tokens", "accepted_tokens", "prefill_seconds",
                         "prompt_tokens", "reused_prompt_tokens", "draft_seconds", "verify_seconds"):
                setattr(out, name, getattr(out, name) + getattr(s, name))
            for name in ("proposed_at", "reached_at", "accepted_at"):
                dst = getattr(out, name)
                for j, v in enumerate(getattr(s, name)):
                    dst[j] += v
            for source, child in s.by_source.items():
                out.by_source[source] = out.by_source[source].merge(child) if source in out.by_source else child
        return out

    def to_dict(self) -> dict:
        return {"rounds": self.rounds, "tau": self.tau, "committed_tokens": self.committed_tokens,
                "acceptance_rate": self.acceptance_rate, "conditional_acceptance": self.conditional_acceptance,
                "unconditional_acceptance": self.unconditional_acceptance, "prefill_seconds": self.prefill_seconds,
                "prompt_tokens": self.prompt_tokens, "reused_prompt_tokens": self.reused_prompt_tokens,
                "draft_seconds": self.draft_seconds, "verify_seconds": self.verify_seconds,
                "by_source": {name: child.to_dict() for name, child in self.by_source.items()}}

    def summary(self) -> str:
        cond = " ".join(f"{x:.2f}" for x in self.conditional_acceptance)
        text = (f"DSpark: {self.committed_tokens} tokens in {self.rounds} rounds, tau={self.tau:.2f} (incl. bonus), "
                f"acceptance {self.acceptance_rate:.1%}, per-position conditional [{cond}], "
                f"time draft {self.draft_seconds:.2f}s / verify {self.verify_seconds:.2f}s")
        if self.reused_prompt_tokens:
            text += (f"; prefix cache: {self.reused_prompt_tokens} of {self.prompt_tokens} prompt tokens reused, "
                     f"prefill {self.prefill_seconds:.2f}s")
        if self.by_source:
            text += "; by source: " + ", ".join(self.source_summary(name) for name in sorted(self.by_source))
        return text

    def source_summary(self, name: str) -> str:
        """One source's rounds in a few words ("lookup: 12 rounds, tau 3.10, acceptance 61%")."""
        child = self.by_source[name]
        if name == "none":
            return f"plain: {child.rounds} rounds"
        return f"{name}: {child.rounds} rounds, tau {child.tau:.2f}, acceptance {child.acceptance_rate:.0%}"

    def log(self) -> None:
        logger.info(self.summary())
