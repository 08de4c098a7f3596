"""Training losses and metrics for block drafters (SPEC §5; DeepSpec's code convention, not the paper's).

Slot k (0-based) of a block has weight w_k = exp(-k / decay) · m_k, m_k the cumulative eval mask. With draft
logits D_k = U_k + B_k (base logits plus the teacher-forced sequential bias), target distribution p_t and
draft distribution p_d = softmax(D_k):

    L = 0.1 · Σ w CE(D_k, y_k) / Σ w  +  0.9 · Σ w ‖p_d − p_t‖₁ / Σ w  +  1.0 · Σ w BCE(z_k, c*_k) / Σ w
    c*_k = clamp(1 − ½‖p_d − p_t‖₁, 0, 1)   (detached, T = 1, fp32)

DFlash (no sequential head, no confidence head) trains with CE only (:meth:`LossConfig.for_head`).

Why target logits are recomputed here and not cached: the cache stores the target's final post-norm hidden
state (d numbers per token) and the drafter's frozen copy of the LM head turns it into logits only at the
sampled positions p + j — V numbers per token would not fit on disk (the paper's "hidden state communication").

Full-vocabulary logits for every block slot dominate memory, so the loss runs over chunks of blocks; with more
than one chunk each chunk is gradient-checkpointed and only the backbone states stay alive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .anchors import IGNORE_LABEL, BlockTargets


@dataclass
class LossConfig:
    """Loss coefficients. ``chunk_blocks`` (int, defaults to 256): blocks whose full-vocab logits exist at once."""

    ce_weight: float = 0.1
    l1_weight: float = 0.9
    confidence_weight: float = 1.0
    decay: float = 4.0
    chunk_blocks: int = 256

    @classmethod
    def for_head(cls, head: str, **overrides) -> LossConfig:
        """DSpark's three-term loss, or CE only for the baselines: DFlash (``head="none"``) and the architectures
        registered with ``baseline_loss`` (``"eagle3"``), as the training CLI's ``--head`` names them."""
        from ..modeling.architectures import NO_SEQUENTIAL_HEAD, architecture_named, available_architectures

        baseline = head == NO_SEQUENTIAL_HEAD or (
            head in available_architectures() and architecture_named(head).baseline_loss)
        if baseline:
            overrides = {"ce_weight": 1.0, "l1_weight": 0.0, "confidence_weight": 0.0, **overrides}
        return cls(**overrides)

    def __post_init__(self) -> None:
        if self.decay <= 0:
            raise ValueError(f"decay={self.decay} must be > 0 (DeepSpec uses 4.0).")
        if self.chunk_blocks < 1:
            raise ValueError(f"chunk_blocks={self.chunk_blocks} must be >= 1.")


def slot_weights(eval_mask: torch.Tensor, decay: float = 4.0) -> torch.Tensor:
    """w_k = exp(-k / decay) · m_k for eval_mask [..., γ] -> float [..., γ]."""
    k = torch.arange(eval_mask.shape[-1], device=eval_mask.device, dtype=torch.float32)
    return torch.exp(-k / decay) * eval_mask.float()


# ---------------------------------------------------------------------------------------------------------
# Drafter outputs for training (shared with evaluation)
# ---------------------------------------------------------------------------------------------------------
@dataclass
class BlockOutputs:
    """The drafter's training-time outputs for a set of blocks (teacher-forced sequential head)."""

    hidden: torch.Tensor  # [..., γ, d] final-normed backbone states h_k
    draft_logits: torch.Tensor | None  # [..., γ, V'] fp32 U_k + B_k over the draft vocabulary
    confidence_logits: torch.Tensor | None  # [..., γ] fp32 z_k


def compute_block_hidden(drafter, features: torch.Tensor, context_valid: torch.Tensor,
                         targets: BlockTargets, input_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Backbone states h [N, A, γ, d] of every sampled block: features [N, T, m·d], context_valid [N, T].

    An autoregressive (Eagle3) drafter reads the data's tokens instead of mask-filled blocks: it also needs
    ``input_ids`` [N, T]."""
    n, t = context_valid.shape
    positions = torch.arange(t, device=features.device).expand(n, t)
    param = next(drafter.parameters())
    return drafter.training_hidden(features.to(param.dtype), positions, context_valid.bool(), targets, input_ids)


def compute_block_logits(drafter, hidden: torch.Tensor, prev_ids: torch.Tensor,
                         with_confidence: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft logits U + B (teacher forcing: prev = [anchor, y_1 .. y_{γ-1}]) and confidence logits.

    hidden [B, γ, d], prev_ids [B, γ] -> ([B, γ, V'] fp32 over the draft vocabulary, [B, γ] fp32 or None).
    """
    logits = drafter.compute_draft_logits(hidden).float()
    head = drafter.markov_head
    if head is None:
        return logits, None
    prev_emb = head.markov_w1(prev_ids)
    u = head.forward_teacher_forced(hidden, prev_emb)
    logits = logits + head.bias(u).float()
    conf = None
    if with_confidence and drafter.confidence_head is not None:
        conf = drafter.confidence_head(hidden, prev_emb).float()
    return logits, conf


def compute_block_outputs(drafter, features: torch.Tensor, context_valid: torch.Tensor,
                          targets: BlockTargets, input_ids: torch.Tensor | None = None) -> BlockOutputs:
    """All drafter outputs for the sampled blocks at once (evaluation; training uses the chunked loss)."""
    hidden = compute_block_hidden(drafter, features, context_valid, targets, input_ids)
    flat_hidden = hidden.flatten(0, 1)
    logits, conf = compute_block_logits(drafter, flat_hidden, targets.prev_ids.flatten(0, 1))
    lead = hidden.shape[:2]
    return BlockOutputs(hidden=hidden, draft_logits=logits.view(*lead, *logits.shape[1:]),
                        confidence_logits=None if conf is None else conf.view(*lead, -1))


def gather_target_hidden(target_last_hidden: torch.Tensor, targets: BlockTargets) -> torch.Tensor:
    """[N, T, d] cached final post-norm target states -> [N, A, γ, d] at positions p + j (predicting p + j + 1)."""
    n, a, gamma = targets.target_positions.shape
    idx = targets.target_positions.reshape(n, a * gamma, 1).expand(-1, -1, target_last_hidden.shape[-1])
    return target_last_hidden.gather(1, idx).view(n, a, gamma, -1)


# ---------------------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------------------
_PER_SLOT_FIELDS = ("accept_sum", "slot_count")


@dataclass
class LossStats:
    """Detached sums over supervised slots; add across micro-batches / ranks, then :meth:`summary`."""

    weight_sum: torch.Tensor  # Σ w
    ce_sum: torch.Tensor  # Σ w · CE
    l1_sum: torch.Tensor  # Σ w · ‖p_d − p_t‖₁
    bce_sum: torch.Tensor  # Σ w · BCE
    accept_sum: torch.Tensor  # [γ] Σ (1 − TV_k) over supervised slots
    slot_count: torch.Tensor  # [γ] supervised slots
    tau_sum: torch.Tensor  # Σ over fully supervised blocks of 1 + Σ_k Π_{i≤k} (1 − TV_i)
    num_full_blocks: torch.Tensor
    conf_error_sum: torch.Tensor  # Σ |c − c*| over supervised slots
    conf_bias_sum: torch.Tensor  # Σ (c − c*)

    @classmethod
    def zeros(cls, block_size: int, device=None) -> LossStats:
        return cls.from_vector(torch.zeros(len(fields(cls)) + 2 * (block_size - 1), device=device), block_size)

    def __add__(self, other: LossStats) -> LossStats:
        return LossStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def to_vector(self) -> torch.Tensor:
        """One flat tensor (for a single all-reduce)."""
        return torch.cat([getattr(self, f.name).reshape(-1).float() for f in fields(self)])

    @classmethod
    def from_vector(cls, vec: torch.Tensor, block_size: int) -> LossStats:
        per_slot = [f.name in _PER_SLOT_FIELDS for f in fields(cls)]
        parts = vec.split([block_size if slot else 1 for slot in per_slot])
        return cls(*(p if slot else p.reshape(()) for p, slot in zip(parts, per_slot)))

    def summary(self, config: LossConfig) -> dict[str, float]:
        """Means for logging: loss terms, accept_rate@k (mean 1 − TV), tau_probabilistic, confidence error."""
        w = max(float(self.weight_sum), 1e-12)
        ce, l1, bce = float(self.ce_sum) / w, float(self.l1_sum) / w, float(self.bce_sum) / w
        out = {"loss": config.ce_weight * ce + config.l1_weight * l1 + config.confidence_weight * bce,
               "ce": ce, "l1": l1, "confidence_bce": bce}
        counts = self.slot_count.clamp(min=1)
        for k, rate in enumerate((self.accept_sum / counts).tolist()):
            out[f"accept_rate@{k}"] = rate if float(self.slot_count[k]) > 0 else math.nan
        blocks = float(self.num_full_blocks)
        out["tau_probabilistic"] = float(self.tau_sum) / blocks if blocks else math.nan
        slots = float(self.slot_count.sum())
        out["confidence_abs_error"] = float(self.conf_error_sum) / slots if slots else math.nan
        out["confidence_bias"] = float(self.conf_bias_sum) / slots if slots else math.nan
        out["num_supervised_slots"] = slots
        return out


# ---------------------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------------------
@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    stats: LossStats  # detached sums for metrics


def target_probabilities(drafter, target_hidden: torch.Tensor, target_lse: torch.Tensor | None = None) -> torch.Tensor:
    """The target's next-token probabilities on the draft vocabulary's rows: the soft labels.

    Computed in the LM head's own precision even inside a bf16 autocast step: bf16-rounded logits would shift the
    labels (and the L1 term) the drafter is pulled towards, and a cached fp32 log-normaliser must meet logits of the
    same precision or the rows stop summing to at most one.
    """
    device_type = target_hidden.device.type
    with torch.no_grad(), torch.autocast(device_type, enabled=False):
        if drafter.draft_to_target is not None and target_lse is not None:
            # p_t on the draft rows only, normalised by the cached full-vocabulary log-normaliser
            return torch.exp(drafter.compute_draft_logits(target_hidden).float() - target_lse[..., None])
        probs = torch.softmax(drafter.compute_logits(target_hidden).float(), dim=-1)
        return probs[..., drafter.draft_to_target] if drafter.draft_to_target is not None else probs


def _chunk_sums(drafter, config: LossConfig, hidden, prev_ids, labels, mask, target_rows, target_hidden,
                target_lse=None):
    """Weighted term sums [3] (CE, L1, BCE) and the detached statistics vector for one chunk of blocks.

    ``target_rows`` [B, γ] index the flat target states ``target_hidden`` [R, d] (and ``target_lse`` [R]): blocks
    overlap, so a position's soft labels are computed once and shared by every slot that predicts it."""
    weights = slot_weights(mask, config.decay)
    logits, conf = compute_block_logits(drafter, hidden, prev_ids)
    with torch.no_grad():
        reduced = drafter.draft_to_target is not None
        rows, slot_row = torch.unique(target_rows, return_inverse=True)
        target_probs = target_probabilities(drafter, target_hidden[rows],
                                            None if target_lse is None else target_lse[rows])[slot_row]
        outside_mass = 0.0
        if reduced:
            # q is 0 outside the draft vocabulary, so those tokens add their target mass to ‖p_d − p_t‖₁ exactly
            outside_mass = (1 - target_probs.sum(-1)).clamp(min=0)
            # a label the drafter cannot propose has no CE term (it still counts through outside_mass)
            labels = torch.where(labels == IGNORE_LABEL, labels, drafter.target_to_draft_ids(labels.clamp(min=0)))
            labels = labels.masked_fill(labels < 0, IGNORE_LABEL)
    log_probs = F.log_softmax(logits, dim=-1)
    ce = F.nll_loss(log_probs.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_LABEL,
                    reduction="none").view_as(weights)
    with torch.set_grad_enabled(torch.is_grad_enabled() and config.l1_weight > 0):
        l1 = (log_probs.exp() - target_probs).abs().sum(-1) + outside_mass  # = 2·TV
    accept = (1 - 0.5 * l1.detach()).clamp(0, 1)  # c* = 1 − TV: P(slot accepted | earlier slots accepted)
    bce = (F.binary_cross_entropy_with_logits(conf, accept, reduction="none") if conf is not None
           else torch.zeros_like(weights))
    sums = torch.stack([(weights * ce).sum(), (weights * l1).sum(), (weights * bce).sum()])
    with torch.no_grad():
        m = mask.float()
        full = mask.all(-1)
        tau = 1 + accept.cumprod(-1).sum(-1)
        conf_gap = (torch.sigmoid(conf) - accept) * m if conf is not None else torch.zeros_like(m)
        stats = LossStats(weights.sum(), (weights * ce).sum(), (weights * l1).sum(), (weights * bce).sum(),
                          (accept * m).sum(0), m.sum(0), tau[full].sum(), full.sum().float(),
                          conf_gap.abs().sum(), conf_gap.sum())
    return sums, stats.to_vector()


def compute_loss(drafter, hidden: torch.Tensor, targets: BlockTargets, target_last_hidden: torch.Tensor,
                 config: LossConfig, denominator: torch.Tensor | float | None = None,
                 target_logsumexp: torch.Tensor | None = None) -> LossOutput:
    """The weighted three-term loss over all supervised blocks.

    ``target_logsumexp`` [N, T] (the cache's side-car, optional): lets a reduced-vocabulary drafter get the
    target's probabilities on its own rows without the full-vocabulary product.

    hidden [N, A, γ, d] from :func:`compute_block_hidden`; target_last_hidden [N, T, d] (cached, post-norm).
    ``denominator`` replaces the local weight sum Σ w; data-parallel training passes the global Σ w divided by
    the world size so that gradient averaging yields Σ_global w·l / Σ_global w exactly.
    """
    gamma = hidden.shape[-2]
    supervised = targets.eval_mask[..., 0]  # the cumulative mask: any slot supervised iff slot 0 is
    h = hidden[supervised]
    prev, labels, mask = targets.prev_ids[supervised], targets.labels[supervised], targets.eval_mask[supervised]
    lm_dtype = drafter.target.get_output_embeddings().weight.dtype
    n, t, d = target_last_hidden.shape
    # slot -> row of the flattened [N·T] target states: sequence i's position p is row i·T + p
    sequence_start = torch.arange(n, device=target_last_hidden.device).view(n, 1, 1) * t
    target_rows = (sequence_start + targets.target_positions)[supervised]
    target_h = target_last_hidden.reshape(n * t, d).to(lm_dtype)
    target_lse = None
    if target_logsumexp is not None and drafter.draft_to_target is not None:
        target_lse = target_logsumexp.reshape(n * t).float()
    num_blocks = h.shape[0]
    if num_blocks == 0:  # keep the graph connected (DDP expects every parameter to get a gradient)
        zero = hidden.sum() * 0.0
        return LossOutput(zero, LossStats.zeros(gamma, device=hidden.device))
    step = config.chunk_blocks
    use_checkpoint = num_blocks > step and torch.is_grad_enabled()
    sums, stats_vec = 0.0, 0.0
    for start in range(0, num_blocks, step):
        args = (h[start:start + step], prev[start:start + step], labels[start:start + step],
                mask[start:start + step], target_rows[start:start + step], target_h, target_lse)
        if use_checkpoint:
            chunk_sums, chunk_stats = checkpoint(_chunk_sums, drafter, config, *args, use_reentrant=False)
        else:
            chunk_sums, chunk_stats = _chunk_sums(drafter, config, *args)
        sums, stats_vec = sums + chunk_sums, stats_vec + chunk_stats
    stats = LossStats.from_vector(stats_vec, gamma)
    denom = stats.weight_sum.clamp(min=1e-12) if denominator is None else denominator
    coeffs = torch.tensor([config.ce_weight, config.l1_weight, config.confidence_weight], device=sums.device)
    return LossOutput((coeffs * sums).sum() / denom, stats)
