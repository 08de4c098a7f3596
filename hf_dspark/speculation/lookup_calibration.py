"""Online-calibrated survival estimates for lookup drafts: what the scheduler multiplies into prefix survival.

The scheduler needs, for every draft j of a proposal, c_j = P(draft j accepted | drafts < j accepted); its prefix
survival a_j = Π_{i≤j} c_i then prices the draft against the verify cost (``hf_dspark.scheduling``). DSpark drafts
get c_j from the calibrated confidence head; lookup drafts have no model, so :class:`LookupCalibrator` estimates
c_j as an acceptance *rate* per bucket of what the proposal knew when it was made:

* the proposal's source (the row's own text or the shared history),
* its match length n (1, 2, 3-4, 5-7, ≥ 8),
* the evidence for draft j (``LookupProposal.counts[j] / totals[j]``): seen once; always followed by the draft,
  2-3 or ≥ 4 times; followed by it in a majority / a minority of occurrences,
* the position j in the proposal (1 .. ``max_position``, later positions share the last bucket).

Estimate: a two-level Beta posterior. The cell's rate shrinks towards its parent (same source, match length and
evidence, pooled over positions) with ``pool_strength`` pseudo-counts, and the parent towards the seed prior with
``prior_strength`` pseudo-counts, so a cell speaks from its first few events without being noise. Why pool over
positions and not over evidence: on the agent-loop transcripts (``scripts/bench_lookup.py``) the evidence moves
the rate from ~0.25 (a minority continuation) to ~0.9 (always followed by the draft), while inside one match
bucket the rate barely changes with j. Counts are capped at ``max_events`` per cell (both scaled down together),
so the estimate follows traffic that drifts.

The seed (:data:`DEFAULT_PRIOR` × :data:`DEFAULT_SUPPORT_FACTOR`, capped at 0.95) is the rate per match bucket
and evidence measured on those transcripts, rounded: a 1-token match (one common token) is accepted ~30 % of the
time, an 8-token match (inside a copied span) ~90 %. It matters only until a bucket has seen a few drafts.

Losslessness: c_j depends on the proposal's features, and the whole proposal is a deterministic function of
committed tokens, so admitting draft j on c_j never looks at draft j's verification (``hf_dspark.scheduling``).

ECE is reported like the drafter's (``hf_dspark.training.calibration``): on the *joint* survival a_k against
1[drafts 1..k accepted] at every verified position, plus on the conditional c_j over reached drafts, both
prequential (each prediction recorded before its outcome updates the counts), next to their noise floors.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .lookup import HISTORY_SOURCE, ROW_SOURCE, LookupProposal

logger = logging.getLogger(__name__)

#: match length n -> bucket: 1, 2, 3-4, 5-7, >= 8
_MATCH_BUCKETS = (0, 1, 2, 2, 3, 3, 3)
#: Seed P(accept | reached) per match bucket (1, 2, 3-4, 5-7, >= 8) before any evidence.
DEFAULT_PRIOR = (0.3, 0.55, 0.7, 0.75, 0.9)
#: ... times this per evidence bucket (see :func:`support_bucket`), capped at MAX_PRIOR.
DEFAULT_SUPPORT_FACTOR = (1.0, 1.05, 1.1, 0.6, 0.3, 1.0)
MAX_PRIOR = 0.95
NUM_MATCH_BUCKETS = 5
NUM_SUPPORT_BUCKETS = 6


def match_bucket(match_length: int) -> int:
    return _MATCH_BUCKETS[match_length - 1] if match_length <= len(_MATCH_BUCKETS) else 4


def support_bucket(count: int, total: int) -> int:
    """0 seen once; 1 always followed by the draft 2-3 times; 2 ... ≥ 4 times; 3 the majority; 4 a minority;
    5 no evidence (count 0: a caller-built proposal)."""
    if count <= 0 or total <= 0:
        return 5
    if total == 1:
        return 0
    if count == total:
        return 1 if count <= 3 else 2
    return 3 if 2 * count >= total else 4


@dataclass
class LookupCalibrationReport:
    """Prequential calibration of the lookup survival estimates (NaN where no event was recorded)."""

    num_rounds: int
    num_reached: int  # drafts reached (verified and all earlier ones accepted): conditional events
    acceptance_rate: float  # of reached drafts
    mean_confidence: float  # mean predicted c_j over reached drafts
    ece_conditional: float
    ece_conditional_noise_floor: float
    num_positions: int  # verified positions: joint events
    ece_joint: float
    ece_joint_noise_floor: float


class LookupCalibrator:
    """Per-bucket acceptance rates of lookup drafts, updated online from verified rounds.

    Args:
        prior (sequence of 5 floats, defaults to DEFAULT_PRIOR): seed rate per match bucket (1, 2, 3-4, 5-7, ≥8),
            multiplied by ``DEFAULT_SUPPORT_FACTOR`` per evidence bucket (capped at 0.95).
        prior_strength (float, defaults to 4.0): pseudo-drafts of the seed in each (source, match, evidence) parent.
        pool_strength (float, defaults to 4.0): pseudo-drafts of the parent in each cell (parent × position).
        max_position (int, defaults to 16): positions beyond it share its bucket.
        max_events (float, defaults to 2048): cap on a cell's counts (older evidence fades beyond it).
        max_records (int, defaults to 100_000): predictions kept for the ECE report (the most recent).
    """

    def __init__(self, prior: Sequence[float] = DEFAULT_PRIOR, prior_strength: float = 4.0,
                 pool_strength: float = 4.0, max_position: int = 16, max_events: float = 2048.0,
                 max_records: int = 100_000):
        prior = tuple(float(p) for p in prior)
        if len(prior) != 5 or not all(0.0 < p < 1.0 for p in prior):
            raise ValueError(f"LookupCalibrator: prior must be 5 rates in (0, 1) (match 1, 2, 3-4, 5-7, >=8), got "
                             f"{prior}")
        if prior_strength <= 0 or pool_strength <= 0 or max_position < 1 or max_events < 1 or max_records < 0:
            raise ValueError(f"LookupCalibrator: need prior_strength > 0, pool_strength > 0, max_position >= 1, "
                             f"max_events >= 1, max_records >= 0; got {prior_strength}, {pool_strength}, "
                             f"{max_position}, {max_events}, {max_records}")
        self.prior = prior
        # seed per parent (match, evidence); the same for both sources
        self._seed = [min(MAX_PRIOR, p * f) for p in prior for f in DEFAULT_SUPPORT_FACTOR]
        self.prior_strength, self.pool_strength = prior_strength, pool_strength
        self.max_position, self.max_events = max_position, max_events
        # flat [accepted, reached] pairs (python floats: a proposal reads a few cells, numpy indexing costs more)
        num_parents = 2 * NUM_MATCH_BUCKETS * NUM_SUPPORT_BUCKETS  # source, match bucket, evidence bucket
        self._parent = [[0.0, 0.0] for _ in range(num_parents)]
        self._cell = [[0.0, 0.0] for _ in range(num_parents * max_position)]
        self.num_rounds = 0
        self._conditional: deque[tuple[float, bool]] = deque(maxlen=max_records)
        self._joint: deque[tuple[float, bool]] = deque(maxlen=max_records)

    def _keys(self, proposal: LookupProposal, num: int):
        source = 1 if proposal.source == HISTORY_SOURCE else 0
        match = match_bucket(max(proposal.match_length, 1))
        for j in range(num):
            count = proposal.counts[j] if j < len(proposal.counts) else 0
            total = proposal.totals[j] if j < len(proposal.totals) else 0
            seed = match * NUM_SUPPORT_BUCKETS + support_bucket(count, total)
            parent = source * NUM_MATCH_BUCKETS * NUM_SUPPORT_BUCKETS + seed
            yield seed, parent, parent * self.max_position + min(j, self.max_position - 1)

    def confidences(self, proposal: LookupProposal) -> list[float]:
        """c_j for j = 1..len(proposal): P(draft j accepted | drafts < j accepted)."""
        out = []
        for seed, parent, cell in self._keys(proposal, len(proposal)):
            accepted, reached = self._parent[parent]
            rate = (accepted + self.prior_strength * self._seed[seed]) / (reached + self.prior_strength)
            accepted, reached = self._cell[cell]
            out.append((accepted + self.pool_strength * rate) / (reached + self.pool_strength))
        return out

    def confidence_matrix(self, proposals: Sequence[LookupProposal], width: int | None = None) -> np.ndarray:
        """c_{r,j} as float64 [R, width] (width defaults to the longest proposal); 0 beyond each proposal, which
        the scheduler reads as "never verify" (its ``max_lengths`` say the same)."""
        width = max((len(p) for p in proposals), default=0) if width is None else width
        out = np.zeros((len(proposals), width))
        for r, proposal in enumerate(proposals):
            conf = self.confidences(proposal)[:width]
            out[r, :len(conf)] = conf
        return out

    def observe(self, proposal: LookupProposal, num_verified: int, num_accepted: int) -> None:
        """One verified round: the target checked the first ``num_verified`` drafts and accepted ``num_accepted``.

        Draft j counts when it was verified (j ≤ num_verified) and reached (drafts < j accepted); drafts the
        scheduler did not verify say nothing about acceptance and are not counted."""
        num_verified = min(int(num_verified), len(proposal))
        if not 0 <= num_accepted <= num_verified:
            raise ValueError(f"LookupCalibrator.observe: need 0 <= num_accepted <= num_verified (<= "
                             f"{len(proposal)} drafts), got num_accepted={num_accepted}, num_verified={num_verified}")
        if num_verified == 0:
            return
        self.num_rounds += 1
        predicted = self.confidences(proposal)[:num_verified]
        survival = 1.0
        for k in range(num_verified):
            survival *= predicted[k]
            self._joint.append((survival, k < num_accepted))
        for j, (_, parent, cell) in enumerate(self._keys(proposal, min(num_verified, num_accepted + 1))):
            accepted = j < num_accepted
            self._conditional.append((predicted[j], accepted))
            self._add(self._parent[parent], accepted)
            self._add(self._cell[cell], accepted)

    def observe_batch(self, proposals: Sequence[LookupProposal], num_verified: Sequence[int],
                      num_accepted: Sequence[int]) -> None:
        for proposal, verified, accepted in zip(proposals, num_verified, num_accepted, strict=True):
            self.observe(proposal, int(verified), int(accepted))

    def _add(self, counts: list[float], accepted: bool) -> None:
        counts[0] += accepted
        counts[1] += 1.0
        if counts[1] > self.max_events:
            scale = self.max_events / counts[1]
            counts[0] *= scale
            counts[1] *= scale

    def rates(self, source: str = ROW_SOURCE) -> np.ndarray:
        """Parent estimates [match bucket, evidence bucket] for one source (what the cells shrink towards)."""
        size = NUM_MATCH_BUCKETS * NUM_SUPPORT_BUCKETS
        first = (1 if source == HISTORY_SOURCE else 0) * size
        counts = np.array(self._parent[first:first + size]).reshape(NUM_MATCH_BUCKETS, NUM_SUPPORT_BUCKETS, 2)
        seed = np.array(self._seed).reshape(NUM_MATCH_BUCKETS, NUM_SUPPORT_BUCKETS)
        return (counts[..., 0] + self.prior_strength * seed) / (counts[..., 1] + self.prior_strength)

    def num_events(self, source: str = ROW_SOURCE) -> np.ndarray:
        """Reached drafts counted per cell [match bucket, evidence bucket, position] (after the ``max_events`` cap)."""
        size = NUM_MATCH_BUCKETS * NUM_SUPPORT_BUCKETS * self.max_position
        first = (1 if source == HISTORY_SOURCE else 0) * size
        return np.array([c[1] for c in self._cell[first:first + size]]).reshape(
            NUM_MATCH_BUCKETS, NUM_SUPPORT_BUCKETS, self.max_position)

    def clear_records(self) -> None:
        """Forget the recorded predictions (the ECE window), keeping the learned counts."""
        self._conditional.clear()
        self._joint.clear()

    def report(self, bins: int | None = None, noise_floor_draws: int = 200) -> LookupCalibrationReport:
        """ECE of the recorded predictions with the drafter's metric and its noise floor (20 bins by default)."""
        from ..training.calibration import DEFAULT_BINS, ece_noise_floor, expected_calibration_error

        bins = DEFAULT_BINS if bins is None else bins
        nan = float("nan")
        values = {}
        for name, records in (("conditional", self._conditional), ("joint", self._joint)):
            p = np.array([r[0] for r in records], dtype=np.float64)
            y = np.array([r[1] for r in records], dtype=np.float64)
            values[name] = (p, y, expected_calibration_error(p, y, bins) if p.size else nan,
                            ece_noise_floor(p, bins, noise_floor_draws) if p.size and noise_floor_draws else nan)
        p, y, ece_c, floor_c = values["conditional"]
        _, y_joint, ece_j, floor_j = values["joint"]
        return LookupCalibrationReport(
            num_rounds=self.num_rounds, num_reached=int(p.size), acceptance_rate=float(y.mean()) if y.size else nan,
            mean_confidence=float(p.mean()) if p.size else nan, ece_conditional=ece_c,
            ece_conditional_noise_floor=floor_c, num_positions=int(y_joint.size), ece_joint=ece_j,
            ece_joint_noise_floor=floor_j)


__all__ = ["DEFAULT_PRIOR", "DEFAULT_SUPPORT_FACTOR", "LookupCalibrationReport", "LookupCalibrator", "match_bucket",
           "support_bucket"]
