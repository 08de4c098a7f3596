"""THE accept / recover / bonus routine, shared by ``generate`` and the serving engine (SPEC §3).

Vocabulary, per row of a batch, for drafts x_1..x_m (m = ``num_drafts[b]`` ≤ γ):

* **accepted** tokens: the longest prefix of drafts that passes verification;
* **recovered** token: at the first rejected position j, a token drawn from norm(max(p_j − q_j, 0))
  (greedy: the target's argmax there);
* **bonus** token: when all m drafts pass, a token drawn from p_{m+1} (greedy: its argmax).

Each row commits ``num_accepted + 1`` tokens: the accepted drafts, then the recovered or bonus token.
Slots after those in ``output_tokens`` hold :data:`PLACEHOLDER_TOKEN_ID`.

Greedy (T = 0): p and q are one-hot, so a draft is accepted iff it equals the target's argmax and the output
is exactly plain greedy decoding. Sampling: accept x_j with probability min(1, p_j(x_j) / q_j(x_j)); this
preserves the target distribution exactly *provided q is the distribution x_j was actually sampled from*
(for DSpark: base logits + sequential bias at the sampled prefix, after the same logits processors as p).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..sampling import sample_rows as _sample_rows

PLACEHOLDER_TOKEN_ID = -1
# Below this residual mass p ≈ q at the rejected position; rejection there has probability ~0, so drawing from
# p is the correct (measure-zero) fallback rather than dividing by zero.
_RESIDUAL_EPS = 1e-12


@dataclass
class VerificationResult:
    num_accepted: torch.Tensor  # [B] accepted drafts per row
    next_tokens: torch.Tensor  # [B] recovered or bonus token
    output_tokens: torch.Tensor  # [B, γ + 1] accepted drafts, next token, then PLACEHOLDER_TOKEN_ID
    committed: torch.Tensor | None = None  # [B, γ + 1] bool: slot j < num_accepted + 1 (None: not built)

    def committed_mask(self) -> torch.Tensor:
        """[B, γ + 1] bool, True for the committed slots (the accepted drafts and the next token)."""
        if self.committed is None:
            width = self.output_tokens.shape[1]
            self.committed = torch.arange(width, device=self.num_accepted.device)[None, :] <= self.num_accepted[:, None]
        return self.committed

    @property
    def num_committed(self) -> torch.Tensor:
        return self.num_accepted + 1


def verify(draft_tokens: torch.Tensor, num_drafts: torch.Tensor | None, target_logits: torch.Tensor,
           draft_probs: torch.Tensor | None = None, *, do_sample: bool | Sequence[bool] | torch.Tensor,
           generator: torch.Generator | Sequence[torch.Generator] | None = None,
           host_num_drafts: Sequence[int] | None = None) -> VerificationResult:
    """Verify a batch of (ragged) draft blocks against the target in one call.

    Args:
        draft_tokens: [B, γ] drafts (entries at j ≥ num_drafts[b] are ignored).
        num_drafts: [B] drafts proposed per row (0 ⇒ a plain decoding step for that row); None: every row
            proposes all γ (the caller knows it on the host, so nothing is built or copied for it).
        target_logits: [B, γ + 1, V] target logits at the anchor and each draft position, **after** the
            logits processors (temperature / top-k / top-p / penalties) for that position's prefix.
        draft_probs: [B, γ, V] the exact q each draft was sampled from (required when any row samples).
        do_sample: rejection sampling (True), exact greedy matching (False), or per row (the engine mixes greedy
            and sampled requests in one batch): host bools [B] (no device read) or a [B] bool tensor.
        generator: one generator for the batch, or one per row (each request its own random stream: row b then
            draws exactly ``host_num_drafts[b]`` uniforms and one token, so its stream never depends on the rows
            beside it).
        host_num_drafts: ``num_drafts`` as host ints (needed with per-row generators).
    """
    bsz, gamma = draft_tokens.shape
    device = draft_tokens.device
    if num_drafts is None or (host_num_drafts is not None and all(int(n) == gamma for n in host_num_drafts)):
        proposed = None  # every slot of every row is a proposal (the common batch-1 round): no mask to apply
    else:
        proposed = torch.arange(gamma, device=device)[None, :] < num_drafts[:, None]  # [B, γ]
    if isinstance(do_sample, (list, tuple)):
        any_sampled, any_greedy = any(do_sample), not all(do_sample)
        do_sample = torch.tensor(do_sample, dtype=torch.bool, device=device)
    elif isinstance(do_sample, torch.Tensor):
        any_sampled, any_greedy = bool(do_sample.any()), not bool(do_sample.all())
    else:
        any_sampled, any_greedy = bool(do_sample), not do_sample
    per_row = isinstance(do_sample, torch.Tensor)
    if not any_sampled:
        return _verify_greedy(draft_tokens, proposed, target_logits)

    if any_greedy:
        target_argmax = target_logits.argmax(dim=-1)  # [B, γ+1]
        greedy_passes = draft_tokens == target_argmax[:, :gamma]
    if any_sampled:
        if draft_probs is None:
            raise ValueError("verify(do_sample=True) needs draft_probs: the exact distribution q the drafts were "
                             "sampled from (without it the output distribution is not the target's).")
        p = torch.softmax(target_logits.float(), dim=-1)  # [B, γ+1, V]
        q = draft_probs.float()
        safe_drafts = draft_tokens.clamp(min=0)
        p_x = p[:, :gamma].gather(-1, safe_drafts[..., None]).squeeze(-1)  # p_j(x_j)
        q_x = q.gather(-1, safe_drafts[..., None]).squeeze(-1)  # q_j(x_j) > 0: x_j was drawn from q_j
        uniform = _uniforms(bsz, gamma, device, generator, host_num_drafts)
        sampled_passes = uniform * q_x < p_x  # u < p/q without dividing
    if per_row and any_sampled and any_greedy:
        passes = torch.where(do_sample[:, None], sampled_passes, greedy_passes)
    else:
        passes = sampled_passes if any_sampled else greedy_passes

    passes = passes & proposed if proposed is not None else passes
    num_accepted = passes.long().cumprod(dim=-1).sum(dim=-1)  # length of the passing prefix
    rows = torch.arange(bsz, device=device)

    if any_sampled:
        p_next = p[rows, num_accepted]  # [B, V]: p at the first rejected position, or the bonus position
        rejected = (num_accepted < (gamma if num_drafts is None else num_drafts))[:, None]
        q_next = torch.where(rejected, q[rows, num_accepted.clamp(max=max(gamma - 1, 0))], 0.0) if gamma else 0.0
        residual = (p_next - q_next).clamp(min=0)
        mass = residual.sum(-1, keepdim=True)
        residual = torch.where(mass > _RESIDUAL_EPS, residual / mass.clamp(min=_RESIDUAL_EPS), p_next)
        sampled_next = _sample_rows(residual, generator)
    if per_row and any_sampled and any_greedy:
        next_tokens = torch.where(do_sample, sampled_next, target_argmax[rows, num_accepted])
    else:
        next_tokens = sampled_next if any_sampled else target_argmax[rows, num_accepted]

    output = torch.full((bsz, gamma + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=device)
    keep = torch.arange(gamma, device=device)[None, :] < num_accepted[:, None]
    output[:, :gamma] = torch.where(keep, draft_tokens, output[:, :gamma])
    output[rows, num_accepted] = next_tokens
    return VerificationResult(num_accepted=num_accepted, next_tokens=next_tokens, output_tokens=output)


def _verify_greedy(draft_tokens: torch.Tensor, proposed: torch.Tensor | None,
                   target_logits: torch.Tensor) -> VerificationResult:
    """Exact greedy matching, in few device ops (it runs every round): an accepted draft *is* the target's argmax
    at its position, so the committed tokens are the argmax up to and including the first mismatch."""
    gamma = draft_tokens.shape[1]
    target_argmax = target_logits.argmax(dim=-1)  # [B, γ+1]
    passes = draft_tokens == target_argmax[:, :gamma]
    if proposed is not None:
        passes &= proposed
    num_accepted = passes.long().cumprod(dim=-1).sum(dim=-1)
    next_tokens = target_argmax.gather(1, num_accepted[:, None])[:, 0]
    committed = torch.arange(gamma + 1, device=draft_tokens.device)[None, :] <= num_accepted[:, None]
    output = torch.where(committed, target_argmax, PLACEHOLDER_TOKEN_ID)
    return VerificationResult(num_accepted=num_accepted, next_tokens=next_tokens, output_tokens=output,
                              committed=committed)


def _uniforms(bsz: int, gamma: int, device: torch.device, generator, host_num_drafts) -> torch.Tensor:
    """[B, γ] uniforms for the acceptance tests: one batched draw from a shared generator, or per row exactly
    ``host_num_drafts[b]`` draws from row b's own generator (the rest never decide anything: they are padding)."""
    if not isinstance(generator, (list, tuple)):
        return torch.rand(bsz, gamma, device=device, generator=generator)
    if host_num_drafts is None:
        raise ValueError("verify() with one generator per row needs host_num_drafts (each row draws exactly its "
                         "own number of uniforms)")
    out = torch.ones(bsz, gamma, device=device)
    for row, (g, n) in enumerate(zip(generator, host_num_drafts)):
        if n:
            out[row, :n] = torch.rand(int(n), device=device, generator=g)
    return out
