"""THE speculative round, shared by ``generate`` (one batch of prompts) and the serving engine (requests joining
and leaving): propose → choose per-row widths → one target forward → verify → extend the drafter context.

    drafts, c    = drafter.draft_block(context, anchors)            (skipped when the policy says it cannot pay;
                                                                    a block drafter projects the deferred context
                                                                    in this pass, an Eagle3 one before it)
    ℓ_r          = policy.choose(c, min(drafts_r, budget_r - 1))   (host; read 1: drafts proposed + confidences)
    p            = target([anchor_r, x_r,1..ℓ_r] for every row)      (one padded forward, width 1 + max ℓ)
    accepted     = verify(x, ℓ, p, q)                              (greedy matching or rejection sampling)
    tokens_r     = accepted drafts + recovered / bonus token          (host; read 2: accepted counts + tokens)
    batch        <- holes for rejected slots, new anchors, drafter context deferred

Two device→host reads per round, whatever the batch size and τ: everything the host needs after verification
(how many drafts each row accepted and which tokens it commits) travels in one packed transfer, and what the host
derives from it (trailing holes, positions, finished rows) never needs another. The caller commits ``tokens_r``
with its own stopping rules (EOS, length, stop strings) and drops finished rows with ``batch.keep``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..modeling.architectures import architecture_of
from ..modeling.draft_cache import DraftCache
from ..modeling.drafting import DraftBlock
from ..modeling.target_support import cache_kwarg
from ..scheduling.policies import PolicyInputs
from ..scheduling.cost_tables import SPSProfile, StepCostProfile
from .proposals import DRAFTER, LOOKUP, NO_SOURCE, RoundPlan, assemble_drafts, combined_confidences, truncate
from .ragged_batch import RaggedBatch
from .verification import verify as default_verify


@dataclass
class RoundResult:
    """What one round did, on the host. Per row: ``num_drafts`` drafts verified (ℓ_r), ``num_accepted`` of them
    accepted, ``tokens`` = accepted drafts + the recovered / bonus token (before any stopping rule)."""

    width: int  # verify width 1 + max ℓ
    num_drafts: list[int]
    num_accepted: list[int]
    tokens: list[list[int]]
    block: DraftBlock | None  # the drafter's proposal (None when the round skipped the drafter)
    confidence: np.ndarray | None  # [R, γ''] calibrated confidences read to the host (None without a head)
    raw_logits: torch.Tensor  # [R, W, V] the target's logits (device)
    target_logits: torch.Tensor  # [R, W, V] after the logits processors (device)
    draft_seconds: float
    verify_seconds: float
    sources: list[str] | None = None  # per row: "drafter", "lookup" or "none" (a plain decoding step)


class SpeculativeRound:
    """Runs rounds for one target + drafter under one verify policy (see the module docstring).

    Args:
        target: the causal LM.
        drafter: a drafter with ``draft_block`` / ``extend_context`` (None: plain decoding rounds).
        policy: a :class:`~hf_dspark.scheduling.VerifyPolicy`; ``cost`` is what it prices rounds with (a step-cost
            profile, an SPS table, or None for cost-blind policies; a callable is resolved on first use so
            cost-blind rounds never pay for profiling).
        verify_fn: the verification routine (``verification.verify``; injectable so tests can hand it a wrong q).
        observe_time: report each round's wall time to the policy next to the cost's prediction.
        sequential_top_k: per-call override of the drafter's sequential-bias support (None: its config).
        max_deferred_rounds: rounds of target features kept unprojected while the drafter is skipped.
    """

    def __init__(self, target, drafter, policy, *, cost=None, verify_fn=None, observe_time: bool = False,
                 sequential_top_k: int | None = None, max_deferred_rounds: int = 64, lookup=None, calibrator=None):
        self.target, self.drafter, self.policy = target, drafter, policy
        self._cost = cost
        self.verify_fn = verify_fn or default_verify
        self.observe_time = observe_time
        self.sequential_top_k = sequential_top_k
        self.max_deferred_rounds = max_deferred_rounds
        self.cache_name = cache_kwarg(target)
        self.block_size = drafter.config.block_size if drafter is not None else 0
        # a drafter that projects deferred context in its drafting pass gets it there (one pass instead of two)
        architecture = architecture_of(drafter.config) if drafter is not None else None
        self.fuses_context = architecture is not None and architecture.fuses_context
        self.needs_next_ids = architecture is not None and architecture.autoregressive
        self.max_drafts = policy.max_drafts(self.block_size) if drafter is not None else 0
        # the lookup proposer is offered only to policies that can weigh it against the drafter
        self.lookup = lookup if policy.supports_lookup else None
        self.calibrator = calibrator
        if self.lookup is not None and calibrator is None:
            raise ValueError("SpeculativeRound: a lookup proposer needs its LookupCalibrator (survival estimates)")
        self.vocab_size = target.get_output_embeddings().weight.shape[0]
        self.fastest_step_ratio: float | None = None  # min over timed rounds of wall time / the cost's prediction

    @property
    def resolved_cost(self):
        """The cost model if a round has used it (None: never resolved, e.g. a cost-blind policy)."""
        return self._cost if isinstance(self._cost, (SPSProfile, StepCostProfile)) else None

    @property
    def cost(self):
        """The policy's cost model; a factory given at construction is called once, on first use."""
        if self._cost is not None and not isinstance(self._cost, (SPSProfile, StepCostProfile)):
            self._cost = self._cost()
        return self._cost

    def run(self, batch: RaggedBatch, processor, budgets: Sequence[int], *, do_sample: bool | Sequence[bool],
            generator=None, tap=None, step: int | None = None, row_ids: Sequence | None = None) -> RoundResult:
        """One round for every row of ``batch``. ``budgets[r]``: tokens row r may still commit (≥ 1); the round
        never proposes more than ``budgets[r] - 1`` drafts (it always adds a recovered / bonus token).
        ``do_sample``: one mode for the batch or one per row; ``generator``: shared or one per row; ``tap``: the
        target feature tap the drafter context is read from (None without a drafter); ``row_ids``: each row's
        id in the lookup proposer (lookup proposals are offered only when given)."""
        # resolved before the clock starts: a first use may measure the step cost (seconds), which is setup, not
        # this round's drafting, nor a step time to correct the cost by
        cost = self.cost if self.policy.needs_step_cost else None
        start = time.perf_counter()
        rows = len(batch)
        per_row = not isinstance(do_sample, bool)
        modes = [bool(m) for m in do_sample] if per_row else [bool(do_sample)] * rows
        any_sampled = any(modes)
        # Rounds skipped by the drafter left their context unprojected; whichever round projects it (the next drafting
        # round, or the bounded-memory flush) pays for all of them. Every token's context is projected sooner or
        # later, drafting or not, so that time is no price of drafting: it is projected apart, timed, and left out
        # of the time the round reports (counted in, a drafter that runs rarely would look dearer the more rarely
        # it runs; left unreported, a drafter stopped by a dear-looking step could never be re-priced, since each
        # probe after skipped rounds carries a backlog).
        plan = self._plan(rows, budgets, cost, row_ids, any_sampled)
        block, proposed, confidence = None, np.zeros(rows, dtype=np.int64), None
        upkeep = 0.0
        if plan.run_drafter:
            if batch.num_deferred_steps > 1:
                upkeep_start = time.perf_counter()
                batch.flush_backlog(self.drafter)
                upkeep = time.perf_counter() - upkeep_start
            block, proposed, confidence = self._draft(batch, processor, any_sampled, modes if per_row else None,
                                                      generator)
            if plan.proposals is not None and confidence is not None:
                plan.use_lookup = self.policy.refine_sources(confidence, plan.lookup_confidences, plan.use_lookup,
                                                             switchable=~np.asarray(modes, dtype=bool))
        lengths, sources, drafter_rows = self._choose(plan, block, proposed, confidence, budgets, cost, step,
                                                      any_sampled)
        width = 1 + max(lengths, default=0)
        drafts, probs = assemble_drafts(block, plan, lengths, sources, width, batch.anchors, self.vocab_size,
                                        any_sampled)
        mid = time.perf_counter()

        # -- verify: one target forward over [anchor, drafts] for every row --------------------------------------
        positions = batch.anchor_positions[:, None] + torch.arange(width, device=batch.device)  # [R, W]
        # a batch without holes needs no padding mask (transformers would otherwise build and check one per layer
        # type: host work, and on an accelerator a device read, for a mask of ones)
        mask = None if not batch.has_holes else torch.cat([batch.mask, batch.mask.new_ones(rows, width)], dim=1)
        out = self.target(input_ids=torch.cat([batch.anchors[:, None], drafts], dim=1), attention_mask=mask,
                          position_ids=positions, use_cache=True, logits_to_keep=width,
                          **{self.cache_name: batch.cache})
        raw = out.logits if out.logits.shape[1] == width else out.logits[:, -width:]
        raw = raw.float()
        target_logits = raw if processor.is_identity else processor.process_positions(drafts, raw.clone())
        # every row verifying all W - 1 slots (most batch-1 rounds) needs no per-row lengths on the device
        lengths_dev = (None if all(n == width - 1 for n in lengths)
                       else torch.tensor(lengths, dtype=torch.long, device=batch.device))
        result = self.verify_fn(drafts, lengths_dev, target_logits, probs, do_sample=modes if per_row else do_sample,
                                generator=generator, host_num_drafts=lengths)
        host = torch.cat([result.num_accepted[:, None], result.output_tokens], dim=1).tolist()  # read 2
        num_accepted = [row[0] for row in host]
        tokens = [row[1:2 + a] for row, a in zip(host, num_accepted)]

        # -- the batch after the round ---------------------------------------------------------------------------
        kept = result.committed_mask()  # [R, W]: the anchor's slot and the accepted drafts' (verify built it)
        if self.drafter is not None:
            # kept slots are a prefix of every row: the drafter context needs only the longest one (the rest are
            # rejected in every row), so it projects fewer slots and, rows aligned, writes them as one slice
            span = 1 + max(num_accepted)
            # the committed token after each slot: only an autoregressive drafter pairs positions with it
            next_ids = (torch.where(kept[:, :span], result.output_tokens[:, :span], 0) if self.needs_next_ids
                        else None)
            batch.defer_context(tap.features()[:, :span], positions[:, :span], kept[:, :span], next_ids,
                                counts=[a + 1 for a in num_accepted])
            if batch.num_deferred_steps >= self.max_deferred_rounds:
                upkeep_start = time.perf_counter()
                batch.flush_context(self.drafter)  # bounded memory while the drafter stays skipped
                upkeep += time.perf_counter() - upkeep_start
        batch.commit_round(kept, result.next_tokens, result.num_accepted, host_accepted=num_accepted)
        self._observe(plan, confidence, drafter_rows, lengths, num_accepted, sources)
        end = time.perf_counter()
        if self.observe_time and self.policy.needs_step_cost:
            predicted = (cost.draft(rows) if block is not None else 0.0) + cost.verify(rows, width)
            self.policy.observe_step(block is not None, predicted, end - start - upkeep, sampled=any_sampled,
                                     wide=width > 1, rows=rows)
            ratio = (end - start - upkeep) / predicted if predicted > 0 else None
            if ratio is not None and (self.fastest_step_ratio is None or ratio < self.fastest_step_ratio):
                self.fastest_step_ratio = ratio
        return RoundResult(width, lengths, num_accepted, tokens, block, confidence, raw, target_logits,
                           draft_seconds=mid - start, verify_seconds=end - mid, sources=sources)

    def _plan(self, rows: int, budgets: Sequence[int], cost, row_ids, sampled: bool) -> RoundPlan:
        """Lookup proposals and the policy's decision whether the drafter runs (before anything is drafted)."""
        caps = np.maximum(np.asarray(budgets, dtype=np.int64) - 1, 0)  # drafts a row may verify (+1 bonus token)
        if self.lookup is None or row_ids is None:
            return RoundPlan(bool(self.max_drafts) and self.policy.wants_drafts(rows, cost, sampled=sampled,
                                                                                caps=caps))
        if not caps.any():  # every row commits its last token: nothing to propose, a plain step
            return RoundPlan(False)
        caps_list = caps.tolist()
        proposals = [truncate(p, cap) for p, cap in zip(self.lookup.propose(row_ids, max_tokens=caps_list),
                                                        caps_list)]
        confidences = self.calibrator.confidence_matrix(proposals)
        use_lookup, run_drafter = self.policy.plan_sources(confidences, cost, drafter_available=bool(self.max_drafts),
                                                           sampled=sampled, caps=caps)
        return RoundPlan(bool(run_drafter), proposals, confidences, np.asarray(use_lookup, dtype=bool))

    def _draft(self, batch: RaggedBatch, processor, any_sampled: bool, modes, generator):
        """Draft for every row in one pass and read what the policy needs (read 1)."""
        new_context = None
        if self.fuses_context:
            new_context = batch.take_context()
            if batch.draft_cache is None:
                batch.draft_cache = DraftCache()
        else:
            batch.flush_context(self.drafter)
        block = self.drafter.draft_block(batch.draft_cache, batch.anchors, batch.anchor_positions,
                                         num_tokens=self.max_drafts, do_sample=any_sampled,
                                         logits_processor=processor, generator=generator if any_sampled else None,
                                         confidence_threshold=self.policy.draft_threshold(),
                                         greedy_rows=None if modes is None else [not m for m in modes],
                                         sequential_top_k=self.sequential_top_k,
                                         context_precedes_anchors=True,  # the batch holds committed context only
                                         **({"new_context": new_context} if self.fuses_context else {}))
        if block.confidence is not None:
            packed = torch.cat([block.num_drafts[:, None].to(block.confidence.dtype), block.confidence], dim=1)
            packed = packed.double().cpu().numpy()  # read 1
            return block, packed[:, 0].astype(np.int64), packed[:, 1:]
        return block, block.num_drafts.cpu().numpy().astype(np.int64), None  # read 1

    def _choose(self, plan: RoundPlan, block, proposed: np.ndarray, confidence, budgets, cost, step,
                any_sampled: bool):
        """ℓ_r for every row (never more than its source proposes or its budget allows) and each row's source."""
        rows = len(budgets)
        caps = np.maximum(np.asarray(budgets, dtype=np.int64) - 1, 0)
        drafter_max = np.minimum(proposed, caps) if block is not None else np.zeros(rows, dtype=np.int64)
        if plan.proposals is None:
            if block is None:
                return [0] * rows, [NO_SOURCE] * rows, np.zeros(rows, dtype=bool)
            # host tensors (CPU: no device traffic); policies read them as numpy
            chosen = self.policy.choose(PolicyInputs(None if confidence is None else torch.from_numpy(confidence),
                                                     torch.from_numpy(drafter_max), cost, step=step,
                                                     all_greedy=not any_sampled))
            drafter_rows = np.ones(rows, dtype=bool)
            max_lengths = drafter_max
        else:
            use_lookup = plan.use_lookup
            drafter_rows = ~use_lookup & (block is not None)
            lookup_len = np.array([len(p) for p in plan.proposals], dtype=np.int64)
            max_lengths = np.where(use_lookup, lookup_len, np.where(drafter_rows, drafter_max, 0))
            if block is None and not max_lengths.any():  # no proposal to verify in any row: a plain step, no walk
                return [0] * rows, [NO_SOURCE] * rows, drafter_rows
            conf = combined_confidences(plan, confidence, drafter_rows, rows)
            chosen = self.policy.choose(PolicyInputs(torch.from_numpy(conf), torch.from_numpy(max_lengths), cost,
                                                     step=step, drafter_rows=drafter_rows, drafted=block is not None,
                                                     all_greedy=not any_sampled))
        chosen = np.minimum(np.asarray(chosen.cpu() if isinstance(chosen, torch.Tensor) else chosen), max_lengths)
        lengths = [int(x) for x in chosen]
        sources = [NO_SOURCE if n == 0 else DRAFTER if drafter_rows[r] else LOOKUP for r, n in enumerate(lengths)]
        return lengths, sources, drafter_rows

    def _observe(self, plan: RoundPlan, confidence, drafter_rows: np.ndarray, lengths, num_accepted, sources) -> None:
        """Resolved drafts calibrate their source: the policy's online correction, the lookup calibrator."""
        lengths, accepted = np.asarray(lengths), np.asarray(num_accepted)
        if confidence is not None and drafter_rows.any():
            self.policy.observe(confidence[drafter_rows], lengths[drafter_rows], accepted[drafter_rows])
        lookup_rows = [r for r, s in enumerate(sources) if s == LOOKUP]
        if lookup_rows:
            self.calibrator.observe_batch([plan.proposals[r] for r in lookup_rows], lengths[lookup_rows],
                                          accepted[lookup_rows])


def prefill(target, input_ids: torch.Tensor, positions: torch.Tensor, cache, *, pick_first=None,
            following_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, tap=None,
            drafter=None, draft_cache=None, valid: torch.Tensor | None = None, counts: Sequence[int] | None = None):
    """A prompt (or a chunk of one) through the target into ``cache``, and its tapped features into the drafter
    context (packed: padding never enters it). The token after the chunk's last position is ``following_ids``
    [B] when known (the next chunk's first prompt token), else ``pick_first(logits [B, V]) -> [B]`` picks it
    (the first generated token). Returns (last position's logits [B, V] fp32, that token [B], drafter cache)."""
    out = target(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                 logits_to_keep=1, **{cache_kwarg(target): cache})
    logits = out.logits[:, -1].float()
    following = following_ids if following_ids is not None else pick_first(logits)
    if drafter is not None:
        next_ids = torch.cat([input_ids[:, 1:], following[:, None]], dim=1)  # the token after each position
        draft_cache = drafter.extend_context(draft_cache, tap.features(), positions, valid, next_ids, packed=True,
                                             counts=counts)
    return logits, following, draft_cache


__all__ = ["RoundResult", "SpeculativeRound", "prefill"]
