"""The drafting primitive of the block drafter: one round's proposal for every row (SPEC §2), shared by
``generate``, the serving engine, training evaluation and the evaluation harness.

    h = forward_block(context, [anchor, MASK × (γ-1)])                       (one backbone pass)
    for slot k, left to right:   c_k = σ(w·[h_k ; W1[x_{k-1}]] + b)           (confidence, from x_<k only)
                                 logits_k = U_k + W2·u_k(x_{k-1}, h_k)        (sequential bias)
                                 x_k ~ q_k = softmax(processed logits_k)      (or argmax when greedy)

Cost notes (the loop runs every round): greedy drafting without logits processors picks tokens in the draft
vocabulary and maps them to target ids, so no full-vocabulary tensor is built per slot (the block's
``draft_logits`` are materialised only if someone reads them); calibration temperatures / offsets are cached on
the device; the confidence early exit reads a device value per slot, so it runs where that read is free (CPU)
unless asked for explicitly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ..sampling import sample_rows
from .draft_cache import DraftCache


class DraftBlock:
    """One round's proposal for a batch. Slot k (0-based) drafts the token at anchor position + k + 1.

    ``draft_probs`` is the exact distribution q each token was sampled from (sequential bias and logits
    processors included; ``None`` when drafting greedily, where q is one-hot). ``num_drafts[b]`` is how many
    leading drafts row b proposes for verification (< γ only under a confidence early exit).
    Shapes: tokens [B, γ'], num_drafts [B], draft_logits / draft_probs [B, γ', V] (target vocabulary),
    base_logits [B, γ', V'] (U_k over the draft vocabulary), hidden [B, γ, d], confidence / confidence_logits
    [B, γ''] (every evaluated slot, γ' ≤ γ'' ≤ γ). γ' = γ except under an early exit.
    """

    def __init__(self, tokens: torch.Tensor, num_drafts: torch.Tensor, draft_logits: torch.Tensor | None = None,
                 draft_probs: torch.Tensor | None = None, base_logits: torch.Tensor | None = None,
                 hidden: torch.Tensor | None = None, confidence: torch.Tensor | None = None,
                 confidence_logits: torch.Tensor | None = None,
                 materialise_logits: Callable[[], torch.Tensor] | None = None):
        self.tokens, self.num_drafts = tokens, num_drafts
        self.draft_probs, self.base_logits, self.hidden = draft_probs, base_logits, hidden
        self.confidence, self.confidence_logits = confidence, confidence_logits
        self._draft_logits, self._materialise = draft_logits, materialise_logits

    @property
    def draft_logits(self) -> torch.Tensor:
        """[B, γ', V] the processed logits the tokens were drawn from (built on first read on the fast path)."""
        if self._draft_logits is None and self._materialise is not None:
            self._draft_logits, self._materialise = self._materialise(), None
        return self._draft_logits

    @draft_logits.setter
    def draft_logits(self, value: torch.Tensor) -> None:
        self._draft_logits, self._materialise = value, None


def draw_draft_token(logits: torch.Tensor, tokens: torch.Tensor, k: int, logits_processor, prefix_ids, do_sample: bool,
                     generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Process slot k's logits [B, V] as the target's will be (input ids = prefix + drafts < k), then write the
    sampled (or greedy) draft into ``tokens[:, k]``. Returns (processed logits, q or None when greedy)."""
    raw = logits
    if logits_processor is not None:
        ids = tokens[:, :k] if prefix_ids is None else torch.cat([prefix_ids, tokens[:, :k]], dim=-1)
        logits = logits_processor(ids, logits)
    if not do_sample:
        tokens[:, k] = logits.argmax(dim=-1)
        return logits, None
    probs = torch.softmax(logits, dim=-1)
    if logits_processor is not None and not getattr(logits_processor, "is_identity", False):
        # The processors can leave a row no finite logit (a constraint allowing only tokens outside the draft
        # vocabulary or the sequential top-k support): softmax gives NaN there. Such a row proposes one token
        # one-hot (q = δ, exact as a lookup draft is; the target rejects it unless it allows it): the unprocessed
        # argmax. A CPU reads the flag for free; an accelerator takes the branch-free path (no sync).
        dead = torch.isneginf(logits).all(dim=-1, keepdim=True)
        if logits.device.type != "cpu" or bool(dead.any()):
            fallback = raw.argmax(dim=-1, keepdim=True)
            probs = torch.where(dead, 0.0, probs).scatter_add_(-1, fallback, dead.to(probs.dtype))
    tokens[:, k] = sample_rows(probs, generator)
    return logits, probs


def calibrated_confidence(model, logits: torch.Tensor, first_position: int = 0,
                          greedy: bool | torch.Tensor = False) -> torch.Tensor:
    """c_k = σ(z_k / T_k + b_k) with the fit of the decoding mode (see ``DSparkDraftModel.confidence_from_logits``)."""
    if isinstance(greedy, torch.Tensor):
        rows = greedy.to(logits.device).view(-1, *([1] * (logits.dim() - 1)))
        return torch.where(rows, calibrated_confidence(model, logits, first_position, True),
                           calibrated_confidence(model, logits, first_position, False))
    temps, offsets = _calibration_tensors(model, bool(greedy), logits.dtype, logits.device)
    window = slice(first_position, first_position + logits.shape[-1])
    if temps is not None:
        logits = logits / temps[window]
    if offsets is not None:
        logits = logits + offsets[window]
    return torch.sigmoid(logits)


def _calibration_tensors(model, greedy: bool, dtype: torch.dtype, device: torch.device):
    """The fit as device tensors, cached per (values, dtype, device): built once, not once per slot and round."""
    temps, offsets = model.config.calibration_for(greedy)
    key = (tuple(temps or ()), tuple(offsets or ()), dtype, device)
    cache = model.__dict__.setdefault("_calibration_tensor_cache", {})
    if key not in cache:
        cache.clear() if len(cache) > 8 else None
        cache[key] = tuple(None if values is None else torch.tensor(values, dtype=dtype, device=device)
                           for values in (temps, offsets))
    return cache[key]


def _resolve_greedy(do_sample: bool, greedy_rows: torch.Tensor | Sequence[bool] | None):
    """One bool when every row decodes the same way (one calibration fit), else a per-row bool tensor."""
    if greedy_rows is None:
        return not do_sample
    if isinstance(greedy_rows, torch.Tensor):
        flags = greedy_rows.tolist() if greedy_rows.device.type == "cpu" else None
        if flags is None:
            return greedy_rows
    else:
        flags = [bool(g) for g in greedy_rows]
    if len(set(flags)) <= 1:
        return bool(flags[0]) if flags else False
    return torch.tensor(flags, dtype=torch.bool)


@torch.no_grad()
def draft_block(model, cache: DraftCache, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor, *,
                num_tokens: int | None = None, do_sample: bool = False, logits_processor=None,
                prefix_ids: torch.Tensor | None = None,
                generator: torch.Generator | Sequence[torch.Generator] | None = None,
                confidence_threshold: float | None = None, greedy_rows: torch.Tensor | Sequence[bool] | None = None,
                sequential_top_k: int | None = None, early_exit: bool | None = None,
                context_precedes_anchors: bool = False, new_context=None) -> DraftBlock:
    """See :meth:`DSparkDraftModel.draft_block`."""
    gamma = min(model.config.block_size if num_tokens is None else num_tokens, model.config.block_size)
    greedy = _resolve_greedy(do_sample, greedy_rows)
    threshold = model.config.confidence_threshold if confidence_threshold is None else confidence_threshold
    top_k = model.config.sequential_top_k if sequential_top_k is None else sequential_top_k
    hidden = model.forward_block(cache, anchor_ids, anchor_positions, context_precedes_anchors=context_precedes_anchors,
                                 new_context=new_context)[:, :gamma]
    head = model.markov_head
    bsz, device = hidden.shape[0], hidden.device
    # Under a threshold, c_k (a function of h_k and x_<k only) is evaluated before slot k is drafted, and
    # drafting ends once every row has stopped: slots nobody will verify cost no LM head, sequential head or
    # logits processing (on a CPU most rounds of a weak drafter stop at slot 0). Checking "every row stopped"
    # reads a device value per slot: free on a CPU, a sync on an accelerator (there all slots are drafted and
    # the verify policy, which applies the same threshold, cuts the proposal instead).
    if early_exit is None:
        early_exit = device.type == "cpu"
    early_exit = bool(early_exit and threshold and threshold > 0 and model.confidence_head is not None)
    # pick in draft space, no full-vocabulary tensors (a processor that changes nothing counts as none)
    fast_greedy = not do_sample and (logits_processor is None or getattr(logits_processor, "is_identity", False))
    base_logits = None if early_exit else model.compute_draft_logits(hidden).float()
    state = head.init_state(bsz, hidden) if head is not None else None
    tokens = anchor_ids.new_zeros(bsz, max(gamma, 0))
    all_base, all_logits, all_probs, conf_logits, parts = [], [], [], [], []
    # first slot whose own c_k (a function of x_<k only) is below the threshold; γ = proposes every draft
    stop_at = torch.full((bsz,), gamma, dtype=torch.long, device=device)
    prev = anchor_ids
    drafted = 0
    if fast_greedy and head is None and not early_exit and gamma:
        # no sequential head: the slots are independent, one argmax for the whole block
        best = base_logits.argmax(dim=-1)
        tokens[:] = best if model.draft_to_target is None else model.draft_to_target[best]
        parts = [(base_logits[:, k], None) for k in range(gamma)]
        drafted = gamma
    # c_k = w·[h_k ; W1[x_{k-1}]] + b = (w_h·h_k + b) + w_e·W1[x_{k-1}]: the h part of every slot in one product
    # before the loop (the same for the early-exit and the full-block path, so both score a slot identically)
    confidence_head = model.confidence_head
    hidden_scores = confidence_head.hidden_logits(hidden) if confidence_head is not None else None  # [B, γ]
    embedding = head.markov_w1.weight if head is not None else None
    for k in range(drafted, gamma):
        prev_emb = F.embedding(prev, embedding) if head is not None else None
        if hidden_scores is not None:
            conf_logits.append(hidden_scores[:, k] + confidence_head.token_logits(prev_emb))
        if early_exit:
            c_k = calibrated_confidence(model, conf_logits[-1][:, None], first_position=k, greedy=greedy)[:, 0]
            stop_at = torch.where((c_k < threshold) & (stop_at == gamma), k, stop_at)
            if bool((stop_at <= k).all()):
                break
            base = model.compute_draft_logits(hidden[:, k]).float()
            all_base.append(base)
        else:
            base = base_logits[:, k]
        values, candidates, state = _slot_logits(head, base, hidden[:, k], prev_emb, state, top_k)
        if fast_greedy:
            best = values.argmax(dim=-1)
            draft_ids = best if candidates is None else candidates.gather(-1, best[:, None])[:, 0]
            tokens[:, k] = draft_ids if model.draft_to_target is None else model.draft_to_target[draft_ids]
            parts.append((values, candidates))
        else:
            logits = model.to_target_vocab(values, candidates)
            logits, probs = draw_draft_token(logits, tokens, k, logits_processor, prefix_ids, do_sample, generator)
            all_probs.append(probs)
            all_logits.append(logits)
        prev = tokens[:, k]
        drafted = k + 1
    z = torch.stack(conf_logits, dim=1) if conf_logits else None
    confidence = calibrated_confidence(model, z, greedy=greedy) if z is not None else None
    if base_logits is None:  # early exit: only the drafted slots have base logits
        draft_vocab = model.config.draft_vocab_size or model.config.vocab_size
        base_logits = torch.stack(all_base, 1) if all_base else hidden.new_zeros(bsz, 0, draft_vocab)
    empty = hidden.new_zeros(bsz, 0, model.config.vocab_size)

    def materialise() -> torch.Tensor:
        if not parts:
            return empty
        return torch.stack([model.to_target_vocab(v, c) for v, c in parts], 1)

    return DraftBlock(tokens=tokens[:, :drafted], num_drafts=stop_at,
                      draft_logits=None if fast_greedy else (torch.stack(all_logits, 1) if all_logits else empty),
                      draft_probs=(torch.stack(all_probs, 1) if all_probs else empty) if do_sample else None,
                      base_logits=base_logits, hidden=hidden, confidence=confidence, confidence_logits=z,
                      materialise_logits=materialise if fast_greedy else None)


def _slot_logits(head, base: torch.Tensor, hidden: torch.Tensor, prev_emb, state, top_k: int):
    """Slot logits in the draft vocabulary: base U_k plus the sequential bias, on the base top-k support when
    ``top_k`` restricts it (q_k is then defined on that support: still lossless, it is the q we sample from).
    Returns (values [B, K], candidate draft ids [B, K] or None for the whole draft vocabulary, next head state)."""
    if head is None:
        return base, None, state
    u, state = head.step(hidden, prev_emb, state)
    if top_k and top_k < base.shape[-1]:
        candidates = base.topk(top_k, dim=-1).indices
        return base.gather(-1, candidates) + head.bias(u, candidates).float(), candidates, state
    return base + head.bias(u).float(), None, state


__all__ = ["DraftBlock", "calibrated_confidence", "draft_block", "draw_draft_token"]
