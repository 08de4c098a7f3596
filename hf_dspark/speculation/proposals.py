"""Two proposers in one round: the training-free lookup proposer and the drafter, chosen per row.

Agent loops re-emit their own context (tool names, JSON keys, earlier sentences), where a matcher over that context
(:mod:`.lookup`) proposes long, nearly free drafts; on novel text the drafter is the better proposer, and where
neither helps the round is a plain decoding step. The verify policy (``scheduling.scheduled.ScheduledPolicy``)
decides per row and per round, from calibrated survival estimates of both sources and the measured step cost:

    plan (before drafting):  which rows take their lookup proposal; whether the drafter runs at all
    refine (after drafting): greedy rows may switch to the source with the larger expected acceptance
    choose:                  one width walk over every row's survival, whatever its source

This module holds the per-round plan and turns the chosen proposals into the verify inputs. Lookup drafts are
one-hot proposals (q = δ): at T > 0 rejection sampling with that q accepts a draft x with probability p(x) and
resamples from p without x, which is exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .lookup import LookupProposal

LOOKUP, DRAFTER, NO_SOURCE = "lookup", "drafter", "none"


@dataclass
class RoundPlan:
    """What a round proposes from, decided before the drafter runs."""

    run_drafter: bool
    proposals: list[LookupProposal] | None = None  # one per row (lookup enabled), else None
    lookup_confidences: np.ndarray | None = None  # [R, L] calibrated conditional confidences (0 past the end)
    use_lookup: np.ndarray | None = None  # [R] bool


def truncate(proposal: LookupProposal, max_tokens: int) -> LookupProposal:
    """A proposal cut to ``max_tokens`` drafts (a row's remaining budget)."""
    if len(proposal) <= max_tokens:
        return proposal
    return dataclasses.replace(proposal, tokens=proposal.tokens[:max_tokens], counts=proposal.counts[:max_tokens],
                               totals=proposal.totals[:max_tokens])


def combined_confidences(plan: RoundPlan, drafter_confidence: np.ndarray | None, drafter_rows: np.ndarray,
                         num_rows: int) -> np.ndarray:
    """[R, W] conditional confidences per row from its source (NaN where the drafter gave none: the policy's
    missing-confidence prior applies), for one width walk over all rows."""
    lookup = plan.lookup_confidences
    width = max(lookup.shape[1] if lookup is not None else 0,
                drafter_confidence.shape[1] if drafter_confidence is not None else 0)
    out = np.full((num_rows, width), np.nan)
    if lookup is not None and plan.use_lookup is not None and plan.use_lookup.any():
        out[plan.use_lookup, : lookup.shape[1]] = lookup[plan.use_lookup]
    if drafter_confidence is not None and drafter_rows.any():
        out[drafter_rows, : drafter_confidence.shape[1]] = drafter_confidence[drafter_rows]
    return out


def assemble_drafts(block, plan: RoundPlan, lengths: Sequence[int], sources: Sequence[str], width: int,
                    anchors: torch.Tensor, vocab_size: int, any_sampled: bool):
    """The verify inputs: drafts [R, W-1] and, when any row samples, q [R, W-1, V] (the drafter's q for its rows,
    one-hot for lookup rows)."""
    rows, num = len(lengths), width - 1
    drafted = min(num, block.tokens.shape[1]) if block is not None else 0
    if block is not None and drafted == num:
        drafts = block.tokens[:, :num].clone() if LOOKUP in sources else block.tokens[:, :num]
    else:
        drafts = anchors.new_zeros(rows, num)
        if drafted:
            drafts[:, :drafted] = block.tokens[:, :drafted]
    lookup_rows = [r for r, s in enumerate(sources) if s == LOOKUP]
    if lookup_rows:
        values = [list(plan.proposals[r].tokens[:num]) + [0] * (num - min(num, len(plan.proposals[r])))
                  for r in lookup_rows]
        index = torch.tensor(lookup_rows, dtype=torch.long, device=drafts.device)
        drafts[index] = torch.tensor(values, dtype=drafts.dtype, device=drafts.device)
    if not any_sampled:
        return drafts, None
    probs = drafts.new_zeros((rows, num, vocab_size), dtype=torch.float32)
    if block is not None and drafted and block.draft_probs is not None:
        probs[:, :drafted] = block.draft_probs[:, :drafted]
    if lookup_rows:
        index = torch.tensor(lookup_rows, dtype=torch.long, device=drafts.device)
        one_hot = torch.zeros((len(lookup_rows), num, vocab_size), device=drafts.device)
        one_hot.scatter_(-1, drafts[index][..., None], 1.0)
        probs[index] = one_hot
    return drafts, probs


__all__ = ["DRAFTER", "LOOKUP", "NO_SOURCE", "RoundPlan", "assemble_drafts", "combined_confidences", "truncate"]
