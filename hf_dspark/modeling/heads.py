"""Sequential heads (markov / gated / rnn) and the confidence head.

Every sequential head produces, for slot k, a rank-r vector u_k from the previous token (and, for gated/rnn, the
backbone state h_k); the logit bias is B_k = W2 · u_k. Keeping that shared shape lets inference evaluate B_k
on a small candidate set (``W2[S] · u_k``) instead of all V rows, which is what makes the sequential step cheap
on CPU (see ``DSparkDraftModel.draft_block``).

Slot 0's previous token is the anchor. Training uses teacher forcing (previous = ground truth); inference
uses the token actually sampled for the previous slot, so c_k and B_k depend on x_{<k} only.

Parameter names follow DeepSpec (``markov_head.markov_w1`` [V, r], ``markov_head.markov_w2`` [V, r],
``markov_head.gate_proj``, ``markov_head.joint_proj``, ``confidence_head.proj``) so published checkpoints
load without renaming.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

HeadState = torch.Tensor | None


class SequentialHead(nn.Module):
    """Base: the low-rank bigram tables W1 (prev token → r) and W2 (r → draft vocabulary).

    W1 is indexed by target token ids (the previous token can be any token the target emitted); W2 has one row
    per token the drafter can propose (``output_size`` = the draft vocabulary, the target's by default).
    """

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, output_size: int | None = None):
        super().__init__()
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, output_size or vocab_size, bias=False)

    def init_state(self, batch_size: int, like: torch.Tensor) -> HeadState:
        return None

    def step(self, hidden: torch.Tensor, prev_emb: torch.Tensor, state: HeadState) -> tuple[torch.Tensor, HeadState]:
        """One slot: hidden [B, d], prev_emb = W1[x_{k-1}] [B, r] -> (u_k [B, r], next state)."""
        raise NotImplementedError

    def forward_teacher_forced(self, hidden: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        """All slots at once (training): hidden [N, γ, d], prev_emb [N, γ, r] -> u [N, γ, r]."""
        state = self.init_state(hidden.shape[0], hidden)
        outs = []
        for k in range(hidden.shape[1]):
            u, state = self.step(hidden[:, k], prev_emb[:, k], state)
            outs.append(u)
        return torch.stack(outs, dim=1)

    def bias(self, u: torch.Tensor, candidate_ids: torch.Tensor | None = None) -> torch.Tensor:
        """B = W2 · u over the whole vocabulary ([..., V]) or only the rows ``candidate_ids`` ([..., K])."""
        if candidate_ids is None:
            return F.linear(u, self.markov_w2.weight)  # functional: drafting calls this once per slot
        rows = self.markov_w2.weight[candidate_ids]  # [B, K, r]
        return torch.einsum("bkr,br->bk", rows, u)


class MarkovHead(SequentialHead):
    """B_k = W2 · W1[x_{k-1}]: a low-rank bigram, independent of the hidden state (the paper's default)."""

    def step(self, hidden, prev_emb, state):
        return prev_emb, state

    def forward_teacher_forced(self, hidden, prev_emb):
        return prev_emb


class GatedHead(SequentialHead):
    """g = σ(Linear([h_k ; W1[x_{k-1}]])), B_k = W2 · (g ⊙ W1[x_{k-1}])."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, output_size: int | None = None):
        super().__init__(hidden_size, vocab_size, rank, output_size)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def step(self, hidden, prev_emb, state):
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_emb], dim=-1)))
        return gate * prev_emb, state

    def forward_teacher_forced(self, hidden, prev_emb):
        return self.step(hidden, prev_emb, None)[0]


class RNNHead(SequentialHead):
    """z = [s_{k-1} ; W1[x_{k-1}] ; h_k] → (gate, cand, out); s_k = σ(gate)s_{k-1} + (1-σ(gate))tanh(cand)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, output_size: int | None = None):
        super().__init__(hidden_size, vocab_size, rank, output_size)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def init_state(self, batch_size, like):
        return like.new_zeros(batch_size, self.rank)

    def step(self, hidden, prev_emb, state):
        gate, cand, out = self.joint_proj(torch.cat([state, prev_emb, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(cand)
        return torch.tanh(out), state


SEQUENTIAL_HEAD_CLASSES: dict[str, type[SequentialHead]] = {}


def register_sequential_head(name: str, cls: type[SequentialHead]) -> None:
    """Add a sequential head type; ``DSparkConfig.sequential_head`` selects it by name."""
    if not issubclass(cls, SequentialHead):
        raise TypeError(f"{cls!r} must subclass SequentialHead")
    SEQUENTIAL_HEAD_CLASSES[name] = cls


register_sequential_head("markov", MarkovHead)
register_sequential_head("gated", GatedHead)
register_sequential_head("rnn", RNNHead)


class ConfidenceHead(nn.Module):
    """c_k = σ(w · [h_k ; W1[x_{k-1}]] + b): P(slot k accepted | slots < k accepted). Outputs the logit."""

    def __init__(self, input_size: int):
        super().__init__()
        self.proj = nn.Linear(input_size, 1)

    def forward(self, hidden: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([hidden, prev_emb], dim=-1)).squeeze(-1)

    # Drafting splits the logit, w·[h ; e] + b = (w_h·h + b) + w_e·e: the h part of every slot is one product before
    # the slot loop (the previous token is known only slot by slot).
    def hidden_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """w_h·h + b for hidden [..., d] -> [...] fp32."""
        d = hidden.shape[-1]
        return F.linear(hidden, self.proj.weight[:, :d], self.proj.bias)[..., 0].float()

    def token_logits(self, prev_emb: torch.Tensor) -> torch.Tensor:
        """w_e·W1[x_{k-1}] for prev_emb [..., r] -> [...] fp32."""
        return (prev_emb @ self.proj.weight[0, -prev_emb.shape[-1]:]).float()
