"""What the drafter's drafts are accepted at, learned from resolved rounds: the online correction of its calibrated
confidences (:class:`AcceptanceCorrection`) and its mean prefix survival per position over recent drafting rounds
(:class:`DrafterSurvival`), which the scheduled policy prices drafting with before anything is drafted.

Both read rounds that are already verified, so anything computed from them is known before the current round's
drafts are sampled: a policy may use them without anticipating a draft (see ``policies.py``).
"""

from __future__ import annotations

import numpy as np


class AcceptanceCorrection:
    """Per-position factors that scale the drafter's confidences to what verification realises (not in the paper).

    Offline STS fixes the calibration on held-out data; live traffic can differ (a drafter fitted where position 1
    is accepted often can meet prompts where it rarely is), and an over-confident scheduler verifies more than pays.
    Per position j it keeps decayed sums of the predicted c_j and of the realised acceptances over the drafts that
    were verified and reached, and multiplies c_j by (realised + prior) / (predicted + prior).

    Args:
        decay (`float`, defaults to 0.995): weight of the past per observed round, in (0, 1].
        prior (`float`, defaults to 16.0): pseudo-drafts at factor 1, so a few drafts move the factor only a little.
        enabled (`bool`, defaults to True): False leaves confidences as they are and learns nothing.
    """

    def __init__(self, decay: float = 0.995, prior: float = 16.0, *, enabled: bool = True):
        self.decay, self.prior, self.enabled = decay, prior, enabled
        self._predicted: np.ndarray | None = None  # decayed Σ c_j over verified, reached drafts, per j
        self._realised: np.ndarray | None = None  # decayed count of those that were accepted
        self._reached: np.ndarray | None = None  # decayed count of those drafts

    def factors(self, gamma: int) -> np.ndarray:
        """[γ] multipliers of the confidences; 1 at positions never observed (and everywhere without data).

        The prior is counted in drafts at the mean predicted confidence, not in predicted mass: as mass, a head
        predicting low confidences would need several times more drafts to move its factor, and a rarely verified
        head would stay mispriced for a long time."""
        factors = np.ones(gamma)
        if self.enabled and self._predicted is not None:
            n = min(gamma, self._predicted.size)
            mean_prediction = np.divide(self._predicted[:n], self._reached[:n], out=np.ones(n),
                                        where=self._reached[:n] > 0)
            prior = self.prior * mean_prediction
            factors[:n] = (self._realised[:n] + prior) / (self._predicted[:n] + prior)
        return factors

    def apply(self, conf: np.ndarray) -> np.ndarray:
        """``conf`` [R, γ] scaled by :meth:`factors`, clipped to [0, 1] (unchanged without data)."""
        if not self.enabled or self._predicted is None or conf.shape[1] == 0:
            return conf
        return np.clip(conf * self.factors(conf.shape[1])[None, :], 0.0, 1.0)

    def observe(self, conf: np.ndarray, lengths: np.ndarray, num_accepted: np.ndarray) -> None:
        """One round: ``conf`` [R, γ] the confidences the round was chosen on (before correction), ``lengths`` [R]
        drafts verified, ``num_accepted`` [R] of them accepted. Draft j counts when it was verified (ℓ_r ≥ j) and
        reached (drafts < j accepted); its outcome is whether it was accepted."""
        if not self.enabled:
            return
        gamma = conf.shape[1]
        positions = np.arange(1, gamma + 1)[None, :]
        reached = (positions <= lengths[:, None]) & (positions <= num_accepted[:, None] + 1)
        predicted = (conf * reached).sum(axis=0)
        realised = (reached & (positions <= num_accepted[:, None])).sum(axis=0).astype(np.float64)
        if self._predicted is None or self._predicted.size != gamma:
            self._predicted, self._realised, self._reached = np.zeros(gamma), np.zeros(gamma), np.zeros(gamma)
        self._predicted = self.decay * self._predicted + predicted
        self._realised = self.decay * self._realised + realised
        self._reached = self.decay * self._reached + reached.sum(axis=0)


class DrafterSurvival:
    """The drafter's mean prefix survival a_j per position over its recent drafting rounds, and the best it has
    shown: what drafting a row is expected to accept before the drafter runs.

    A plain mean over the drafted rows of the first rounds (one round of one row is a noisy estimate to start from),
    a decayed mean once a round weighs less than 1 − ``momentum`` of it. Counted in rows, not rounds: one round of
    16 rows (16 different texts) is as much evidence as 16 rounds of one row.

    Args:
        momentum (`float`, defaults to 0.9): weight of the past in the decayed mean, in [0, 1).
        min_learning_rows (`int`, defaults to 4): drafted rows before the estimate counts (:attr:`is_learning`).
    """

    def __init__(self, momentum: float = 0.9, *, min_learning_rows: int = 4):
        self.momentum, self.min_learning_rows = momentum, min_learning_rows
        self.mean: np.ndarray | None = None  # [γ] running mean over rounds of Σ_r a_{r,j} / R
        self.rounds = 0  # drafting rounds behind the mean
        self.rows = 0  # drafted rows behind it, summed over those rounds
        self.best: np.ndarray | None = None  # the highest mean after the learning rows, as wide as the mean

    @property
    def is_learning(self) -> bool:
        """Too few drafted rows back the estimate to decide by it."""
        return self.mean is None or self.rows < self.min_learning_rows

    def observe(self, survival: np.ndarray) -> None:
        """One drafting round's survival [rows, γ] of the rows the drafter proposed for."""
        mean, rows = survival.mean(axis=0), survival.shape[0]
        if self.mean is None:
            self.mean, self.rounds, self.rows, self.best = mean, 1, rows, None
            self._note_best(mean.size)
            return
        # a round is as wide as its widest proposal (a long lookup proposal in the batch widens the drafter's rows
        # with zeros): the drafter's survival is zero past its block, so widths align by zero padding; restarting
        # the estimate on a width change would keep a batch with lookup in its learning rounds for good
        width = max(mean.size, self.mean.size)
        self.rounds += 1
        self.rows += rows
        weight = max(rows / self.rows, 1.0 - self.momentum)
        self.mean = (1.0 - weight) * _zero_padded(self.mean, width) + weight * _zero_padded(mean, width)
        self._note_best(width)

    def _note_best(self, width: int) -> None:
        if self.rows >= self.min_learning_rows:
            self.best = self.mean.copy() if self.best is None else np.maximum(_zero_padded(self.best, width),
                                                                              self.mean)

    def optimistic(self, headroom: float) -> np.ndarray:
        """The best mean survival so far (the text may turn back to what the drafter drafts well) with every
        conditional acceptance ``headroom`` × higher (≤ 1): what re-measuring the drafter could plausibly find."""
        survival = self.mean if self.best is None else np.maximum(self.mean, self.best)
        previous = np.concatenate([[1.0], survival[:-1]])
        conditional = np.divide(survival, previous, out=np.zeros_like(survival), where=previous > 0)
        return np.cumprod(np.minimum(1.0, conditional * headroom))


def survival_per_row(survival: np.ndarray, num_rows: int, caps: np.ndarray | None) -> np.ndarray:
    """[R, γ]: a per-position survival [γ] for each of ``num_rows`` rows, zero past each row's cap (drafts it may
    still verify; None: no cap)."""
    rows = np.tile(survival, (num_rows, 1))
    if caps is not None:
        rows[np.arange(survival.size)[None, :] >= np.asarray(caps)[:, None]] = 0.0
    return rows


def _zero_padded(values: np.ndarray, width: int) -> np.ndarray:
    """``values`` [n] extended with zeros to ``width`` (unchanged when already that wide)."""
    return values if values.size >= width else np.concatenate([values, np.zeros(width - values.size)])


__all__ = ["AcceptanceCorrection", "DrafterSurvival", "survival_per_row"]
