"""Per-round records of speculative decoding: the raw data that STS calibration and the evaluation need.

``draft.stats`` (DSparkStats) keeps only running totals. Calibration needs, for *every* verification round,
the raw confidence logits z_1..z_γ of the proposed drafts and the realised accepted prefix length, and the
offline threshold sweep needs the same. :class:`RoundRecorder` is the optional hook that
``target.generate(..., assistant_model=draft, dspark_recorder=recorder)`` calls once per round; it only appends
a few small CPU tensors, so the normal path (no recorder) is untouched. :class:`RoundTrace` is the frozen
result, one row per (round, batch row), with the benchmark each round belongs to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..metrics import DSparkStats


@dataclass(frozen=True)
class RoundTrace:
    """Verification rounds, one row each. Confidence logits are NaN for drafters without a confidence head."""

    num_proposed: np.ndarray  # [N] int: drafts offered for verification
    num_accepted: np.ndarray  # [N] int: leading drafts accepted
    num_committed: np.ndarray  # [N] int: tokens committed (accepted + recovered/bonus, fewer at EOS/length)
    confidence_logits: np.ndarray  # [N, γ] float: raw z_k
    tags: np.ndarray  # [N] str: benchmark (or any label) of the round

    @classmethod
    def from_rounds(cls, num_proposed: Sequence[int], num_accepted: Sequence[int],
                    num_committed: Sequence[int] | None = None, confidence_logits=None, tags=None,
                    block_size: int | None = None) -> "RoundTrace":
        """Build a trace from plain lists (scripted traces in tests, or data read elsewhere).
        ``num_committed`` defaults to accepted + 1 (no EOS); ``confidence_logits`` [N, γ] to NaN."""
        proposed = np.asarray(num_proposed, dtype=np.int64).reshape(-1)
        accepted = np.asarray(num_accepted, dtype=np.int64).reshape(-1)
        committed = accepted + 1 if num_committed is None else np.asarray(num_committed, np.int64).reshape(-1)
        if confidence_logits is None:
            gamma = block_size or int(proposed.max(initial=0))
            logits = np.full((proposed.size, gamma), np.nan)
        else:
            logits = np.asarray(confidence_logits, dtype=np.float64)
            logits = logits if logits.ndim == 2 else logits.reshape(proposed.size, -1)
        tags = np.full(proposed.size, "", dtype=object) if tags is None else np.asarray(list(tags), dtype=object)
        trace = cls(proposed, accepted, committed, logits, tags)
        trace._raise_if_inconsistent()
        return trace

    def _raise_if_inconsistent(self) -> None:
        n = self.num_proposed.size
        if not (self.num_accepted.size == self.num_committed.size == self.tags.size == self.confidence_logits.shape[0]
                == n):
            raise ValueError("every per-round array of a RoundTrace must have one entry per round")
        if (self.num_accepted < 0).any() or (self.num_accepted > self.num_proposed).any():
            raise ValueError("num_accepted must lie in [0, num_proposed] for every round")
        if (self.num_proposed > self.block_size).any():
            raise ValueError(f"num_proposed exceeds the block size {self.block_size}")
        if (self.num_committed < 0).any() or (self.num_committed > self.num_accepted + 1).any():
            raise ValueError("num_committed must lie in [0, num_accepted + 1] for every round")

    def __len__(self) -> int:
        return int(self.num_proposed.size)

    @property
    def block_size(self) -> int:
        return int(self.confidence_logits.shape[1])

    @property
    def has_confidence(self) -> bool:
        """True when every proposed draft carries a confidence logit (a drafter with a confidence head); slots
        beyond a round's proposal may be NaN (a run drafting fewer than γ tokens)."""
        finite = np.isfinite(self.confidence_logits)
        proposed = np.arange(self.block_size)[None, :] < self.num_proposed[:, None]
        return bool(finite.any()) and bool(finite[proposed].all())

    @property
    def tau(self) -> float:
        """Pooled τ = Σ committed / rounds (includes the recovered/bonus token)."""
        return float(self.num_committed.sum() / len(self)) if len(self) else 0.0

    def select(self, tag: str) -> "RoundTrace":
        keep = self.tags == tag
        return RoundTrace(self.num_proposed[keep], self.num_accepted[keep], self.num_committed[keep],
                          self.confidence_logits[keep], self.tags[keep])

    def stats(self) -> DSparkStats:
        """The same totals ``draft.stats`` keeps, recomputed from the rounds (per-position rates included)."""
        stats = DSparkStats.new(self.block_size)
        if len(self):
            stats.observe_round(torch.from_numpy(self.num_proposed), torch.from_numpy(self.num_accepted),
                                torch.from_numpy(self.num_committed))
        return stats

    @staticmethod
    def concatenate(traces: Sequence["RoundTrace"]) -> "RoundTrace":
        if not traces:
            raise ValueError("concatenate needs at least one trace")
        return RoundTrace(*(np.concatenate([getattr(t, name) for t in traces]) for name in
                            ("num_proposed", "num_accepted", "num_committed", "confidence_logits", "tags")))

    def save(self, path: str | Path) -> Path:
        """Write the rounds to an ``.npz`` file (raw data behind every reported number)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, num_proposed=self.num_proposed, num_accepted=self.num_accepted,
                            num_committed=self.num_committed, confidence_logits=self.confidence_logits,
                            tags=self.tags.astype(str))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "RoundTrace":
        with np.load(path) as data:
            return cls.from_rounds(data["num_proposed"], data["num_accepted"], data["num_committed"],
                                   data["confidence_logits"], data["tags"].astype(object))


class RoundRecorder:
    """Collects every verification round of ``target.generate(..., dspark_recorder=recorder)``.

    Set :attr:`tag` (e.g. the benchmark name) before each call; rounds are stored under the tag current when
    they happen. Works for any batch size: each batch row of a round becomes one row of the trace."""

    def __init__(self, block_size: int, tag: str = ""):
        self.block_size = block_size
        self.tag = tag
        self._chunks: list[tuple[np.ndarray, ...]] = []

    def observe_round(self, num_proposed: torch.Tensor, num_accepted: torch.Tensor, num_committed: torch.Tensor,
                      confidence_logits: torch.Tensor | None) -> None:
        """Called by the generate loop. num_* [B]; confidence_logits [B, γ] raw z_k or None (no head)."""
        rows = int(num_proposed.shape[0])
        logits = np.full((rows, self.block_size), np.nan)
        if confidence_logits is not None:
            z = confidence_logits.detach().float().cpu().numpy()
            logits[:, : z.shape[1]] = z
        self._chunks.append((num_proposed.detach().cpu().numpy().astype(np.int64),
                             num_accepted.detach().cpu().numpy().astype(np.int64),
                             num_committed.detach().cpu().numpy().astype(np.int64), logits,
                             np.full(rows, self.tag, dtype=object)))

    def __len__(self) -> int:
        return sum(chunk[0].size for chunk in self._chunks)

    def trace(self) -> RoundTrace:
        if not self._chunks:
            return RoundTrace.from_rounds([], [], [], np.zeros((0, self.block_size)), [])
        columns = [np.concatenate(parts) for parts in zip(*self._chunks)]
        return RoundTrace(*columns)


__all__ = ["RoundRecorder", "RoundTrace"]
