"""Validation of a drafter on a target cache of held-out conversations: what a training run watches.

:func:`greedy_block_acceptance` is τ at T = 0 with the full block from every anchor of the target's own greedy
answers (what ``generate`` measures, in seconds instead of minutes); :func:`score_prompt_sets` splits it by prompt
set (sample ids name theirs: ``heldout-chat-…`` / ``heldout-code-…``).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from torch.utils.data import Subset

from .anchors import IGNORE_LABEL
from .losses import compute_block_hidden
from .trainer import anchor_generator, block_batch

logger = logging.getLogger(__name__)


@torch.no_grad()
def draft_candidates(drafter, hidden: torch.Tensor, prev_ids: torch.Tensor,
                     top_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidates a teacher-forced block ranks and their final scores: ([M, γ, k] target ids, [M, γ, k] fp32).

    With a sequential (Markov) head restricted to the base logits' top ``sequential_top_k``, those are the candidates
    and the score adds the head's bias there, as ``draft_block`` does, so the argmax is the token drafting would
    propose. Where the bias covers the whole vocabulary (``sequential_top_k`` 0, or no head) the candidates are the
    top ``top_k`` (64 when None) of the full scores. Ids are mapped from the draft vocabulary to the target's."""
    head = getattr(drafter, "markov_head", None)
    base = drafter.compute_draft_logits(hidden).float()  # [M, γ, V']
    vocab = base.shape[-1]
    sequential_top_k = (drafter.config.sequential_top_k or vocab) if head is not None else vocab
    if sequential_top_k >= vocab:  # the bias over the whole vocabulary (one matmul), then its best candidates
        if head is not None:
            base = base + head.bias(head.forward_teacher_forced(hidden, head.markov_w1(prev_ids))).float()
        vals, cand = base.topk(min(top_k or 64, vocab), dim=-1)
    else:
        vals, cand = base.topk(sequential_top_k, dim=-1)  # [M, γ, k]
        u = head.forward_teacher_forced(hidden, head.markov_w1(prev_ids))
        vals = vals + head.bias(u.flatten(0, 1), cand.flatten(0, 1)).view(cand.shape).float()
    if drafter.draft_to_target is not None:
        cand = drafter.draft_to_target[cand]
    return cand, vals


@torch.no_grad()
def teacher_forced_blocks(drafter, dataset, num_anchors: int = 128, batch_size: int = 4, seed: int = 0):
    """Per batch of ``dataset``: ``(batch, targets, full, hidden)`` for the blocks whose every slot has a label (no
    answer end inside): ``full`` [N, A] marks them, ``hidden`` [M, γ, d] is the drafter's backbone state of those
    blocks. The anchors are seeded by ``seed`` and the batch's start, so every scorer sees the same blocks."""
    param = next(drafter.parameters())
    for start in range(0, len(dataset), batch_size):
        samples = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        batch, targets = block_batch(samples, drafter.config, num_anchors, anchor_generator(seed, 0, start))
        hidden = compute_block_hidden(drafter, batch["target_hidden_states"].to(param.device),
                                      batch["attention_mask"].to(param.device), targets.to(param.device),
                                      batch["input_ids"].to(param.device))
        full = targets.eval_mask.all(-1)
        if bool(full.any()):
            yield batch, targets, full, hidden[full]


def accepted_runs(match: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, γ] bool draft matches -> (accepted, reached), both [M, γ] long: slot k is accepted iff slots 0..k all
    match, and reached iff slots before it were all accepted."""
    run = match.long().cumprod(-1)
    return run, torch.cat([torch.ones(run.shape[0], 1, dtype=torch.long), run[:, :-1]], dim=1)


@torch.no_grad()
def greedy_block_acceptance(drafter, dataset, num_anchors: int = 128, batch_size: int = 4,
                            seed: int = 0) -> dict:
    """Greedy (T = 0) acceptance of ``drafter`` on a cache of the target's own *greedy* answers, every block at once.

    Why it equals generation's greedy acceptance for a block: in such a cache the next token after each position
    is the target's argmax, so teacher-forcing the sequential head with the cached tokens is exactly what drafting
    sees while its drafts keep being accepted, and slot k is accepted iff the drafter's argmax (over the base
    top-``sequential_top_k`` candidates, as ``draft_block`` does) equals the cached token. Unlike generation it
    scores blocks from every anchor, not only where the previous round ended; seconds instead of minutes, so it
    can score every checkpoint. Returns τ (bonus included) and conditional acceptance per position."""
    gamma = drafter.config.block_size
    reached, accepted = torch.zeros(gamma), torch.zeros(gamma)
    tau_sum, blocks = 0.0, 0
    was_training = drafter.training
    drafter.eval()
    for _, targets, full, hidden in teacher_forced_blocks(drafter, dataset, num_anchors, batch_size, seed):
        labels, prev = targets.labels[full], targets.prev_ids[full]
        cand, vals = draft_candidates(drafter, hidden, prev.to(hidden.device))
        draft = cand.gather(-1, vals.argmax(-1, keepdim=True)).squeeze(-1)
        run, alive = accepted_runs((draft.cpu() == labels) & (labels != IGNORE_LABEL))
        tau_sum += float((1 + run.sum(-1)).sum())
        blocks += run.shape[0]
        reached += alive.sum(0).float()
        accepted += run.sum(0).float()
    drafter.train(was_training)
    return {"blocks": blocks, "tau_greedy": tau_sum / max(blocks, 1),
            "conditional_acceptance": (accepted / reached.clamp(min=1)).tolist()}


@torch.no_grad()
def greedy_answer_records(target, tokenizer, prompts: list[dict], max_new_tokens: int = 128,
                          batch_size: int = 8) -> list[dict]:
    """The target's greedy answers to ``prompts`` (``{"id", "turns": [first turn, ...]}``) as chat records.

    Plain batched ``generate`` (left-padded, fp32 target): the conversations a held-out validation cache holds.
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    records = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        messages = [[{"role": "user", "content": p["turns"][0]}] for p in chunk]
        rows = [tokenizer(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)["input_ids"] for m in messages]
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                              pad_token_id=pad)
        eos = target.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        for prompt, message, row in zip(chunk, messages, out[:, width:].tolist()):
            stop = next((i for i, t in enumerate(row) if t in eos), None)
            answer = tokenizer.decode(row[:stop] if stop is not None else row, skip_special_tokens=True)
            records.append({"id": prompt["id"], "messages": message + [{"role": "assistant", "content": answer}],
                            "finish_reason": "stop" if stop is not None else "length"})
    return records


def stored_greedy_answer_records(target, tokenizer, prompts: list[dict], answers_file: str | os.PathLike,
                                 max_new_tokens: int = 128) -> list[dict]:
    """:func:`greedy_answer_records`, kept in ``answers_file``: a new machine reads the committed answers instead of
    generating them again (minutes of one thread), and every machine scores on the very same conversations (two
    machines' fp32 greedy answers can part at a near-tie). Prompts the file lacks are answered and appended."""
    path = Path(answers_file)
    stored = {}
    if path.is_file():
        stored = {r["id"]: r for r in map(json.loads, path.read_text().splitlines()) if r.get("id")}
    missing = [p for p in prompts if p["id"] not in stored]
    if missing:
        logger.info("Answering %d held-out prompts greedily (%d stored in %s)", len(missing), len(stored), path)
        new = greedy_answer_records(target, tokenizer, missing, max_new_tokens=max_new_tokens)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in new)
        stored.update((r["id"], r) for r in new)
    return [stored[p["id"]] for p in prompts]


def prompt_set_of(sample_id: str) -> str:
    """``"code"`` for held-out code conversations, ``"chat"`` for the rest."""
    return "code" if "code" in sample_id else "chat"


def score_prompt_sets(drafter, dataset, num_anchors: int = 128) -> dict[str, dict]:
    """:func:`greedy_block_acceptance` per prompt set of ``dataset`` (which names its samples in ``ids``)."""
    groups: dict[str, list[int]] = {}
    for i, sid in enumerate(dataset.ids):
        groups.setdefault(prompt_set_of(sid), []).append(i)
    return {name: greedy_block_acceptance(drafter, Subset(dataset, rows), num_anchors=num_anchors)
            for name, rows in sorted(groups.items())}


__all__ = ["accepted_runs", "draft_candidates", "greedy_answer_records", "greedy_block_acceptance", "prompt_set_of", "score_prompt_sets", "teacher_forced_blocks"]
