"""Anchor sampling and block targets for training (SPEC §5, DeepSpec's per-sequence sampler).

A training step drafts many blocks per sequence at once. Each block starts at an *anchor* position p (the last
committed token at inference) and its slot j (0-based) is supervised with the token at p + j + 1.

Why anchors need both p and p + 1 inside the loss mask: at inference the first response token is produced by
the target itself at prefill, so a block is never drafted from the last prompt token, and a block whose first
target lies outside the response teaches nothing. Supervision stops at the first slot whose target falls outside
the response or past the sequence end (the *cumulative* eval mask): a block never learns to continue across a
turn boundary.

Everything here is a pure function on tensors; randomness comes only from the caller's ``torch.Generator``, so
a training run (and its resume) is reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

IGNORE_LABEL = -100  # label of unsupervised slots (torch's cross-entropy ignore index)
_NOT_A_CANDIDATE = 2.0  # sort key above every uniform random key: non-candidates sort last


@dataclass
class BlockTargets:
    """Everything a training step needs about its blocks; shapes use A = num_anchors, γ = block_size."""

    anchor_positions: torch.Tensor  # [N, A] long, ascending among kept blocks; 0 for dummy blocks
    block_keep: torch.Tensor  # [N, A] bool, False for dummy blocks (fewer candidates than A)
    block_ids: torch.Tensor  # [N, A, γ] long: anchor token then mask ids (dummy blocks: all mask ids)
    labels: torch.Tensor  # [N, A, γ] long: input_ids[p + j + 1], IGNORE_LABEL where unsupervised
    eval_mask: torch.Tensor  # [N, A, γ] bool, cumulative: slot j supervised iff slots 0..j all valid
    prev_ids: torch.Tensor  # [N, A, γ] long: teacher-forced previous token input_ids[p + j] (slot 0: anchor)
    target_positions: torch.Tensor  # [N, A, γ] long: p + j, the position whose target state predicts slot j

    @property
    def num_supervised(self) -> int:
        return int(self.eval_mask.sum())

    def to(self, device) -> BlockTargets:
        return BlockTargets(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """[N, T] loss mask -> [N, T] bool: positions p with loss_mask[p] and loss_mask[p + 1] (last column False)."""
    mask = loss_mask.bool()
    cand = torch.zeros_like(mask)
    cand[:, :-1] = mask[:, :-1] & mask[:, 1:]
    return cand


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``num_anchors`` anchors per row, uniform without replacement among the candidates, ascending.

    loss_mask [N, T]. Returns (anchor_positions [N, A] long, block_keep [N, A] bool). Rows with fewer candidates
    than A get dummy blocks at the end (position 0, keep False).
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors={num_anchors} must be >= 1.")
    cand = anchor_candidates(loss_mask)
    n, t = cand.shape
    device = generator.device if generator is not None else cand.device
    keys = torch.rand(n, t, generator=generator, device=device).to(cand.device)
    keys = keys.masked_fill(~cand, _NOT_A_CANDIDATE)
    take = min(num_anchors, t)
    chosen = keys.topk(take, dim=1, largest=False).indices  # the `take` smallest keys: a uniform subset
    keep = cand.gather(1, chosen)
    # ascending positions for kept blocks; dummies sort after every real position
    order_key = torch.where(keep, chosen, torch.full_like(chosen, t))
    order_key, _ = order_key.sort(dim=1)
    keep = order_key < t
    positions = torch.where(keep, order_key, torch.zeros_like(order_key))
    if take < num_anchors:
        pad = num_anchors - take
        positions = torch.cat([positions, positions.new_zeros(n, pad)], dim=1)
        keep = torch.cat([keep, keep.new_zeros(n, pad)], dim=1)
    return positions, keep


def make_block_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchor_positions: torch.Tensor,
                       block_keep: torch.Tensor, block_size: int, mask_token_id: int) -> BlockTargets:
    """Labels, cumulative eval mask, block inputs and teacher-forced previous tokens for sampled anchors.

    input_ids / loss_mask [N, T] (padding has loss_mask 0), anchor_positions / block_keep [N, A].
    """
    n, t = input_ids.shape
    offsets = torch.arange(block_size, device=input_ids.device)
    slot_pos = anchor_positions[..., None] + offsets  # [N, A, γ] = p + j
    label_pos = slot_pos + 1
    in_range = label_pos < t

    def gather(values: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return values.gather(1, pos.clamp(max=t - 1).view(n, -1)).view_as(pos)

    labels = gather(input_ids, label_pos)
    label_in_mask = gather(loss_mask.bool(), label_pos)
    valid = in_range & label_in_mask & block_keep[..., None]
    eval_mask = valid.long().cumprod(dim=-1).bool()
    prev_ids = gather(input_ids, slot_pos)
    anchor_ids = input_ids.gather(1, anchor_positions)
    block_ids = torch.full_like(slot_pos, mask_token_id)
    block_ids[..., 0] = torch.where(block_keep, anchor_ids, torch.full_like(anchor_ids, mask_token_id))
    return BlockTargets(anchor_positions=anchor_positions, block_keep=block_keep, block_ids=block_ids,
                        labels=labels.masked_fill(~eval_mask, IGNORE_LABEL), eval_mask=eval_mask,
                        prev_ids=prev_ids, target_positions=slot_pos.clamp(max=t - 1))
