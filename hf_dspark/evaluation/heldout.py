"""Held-out τ: a drafter's rounds on prompts the project never trains on, per prompt set and per position.

The benchmark prompts (``benchmarks.py``) are what the templated training prompts imitate, so their τ flatters a
drafter. ``data/heldout/`` holds a fixed set of prompts from sources no recipe trains on (hand-written chat,
code requests from :data:`~hf_dspark.training.prompt_sources.HELD_OUT_CODE_MODULES`); this module runs a
drafter on them through the public ``target.generate(..., assistant_model=draft)`` path at confidence threshold
0 (every round proposes the full block) and reports τ plus conditional / unconditional acceptance per position.

It also returns the target's answers: at T = 0 speculative decoding is token-identical to plain greedy decoding,
so one run yields the held-out conversations a cheap cache-based validation curve (τ_probabilistic per
checkpoint, :func:`~hf_dspark.training.trainer.evaluate_on_cache` and
:func:`~hf_dspark.training.validation.greedy_block_acceptance`) needs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .benchmarks import DEEPSPEC_SEED, encode_chat_prompt, left_pad
from .harness import FULL_PROPOSALS, _ensure_bound, _eos_ids, sampling_kwargs
from .recorder import RoundRecorder, RoundTrace


@dataclass(frozen=True)
class HeldOutPrompt:
    id: str
    text: str
    category: str


def read_heldout(path: str | Path) -> list[HeldOutPrompt]:
    """``{"id", "turns": [first turn, ...], "category"}`` records (only the first turn is used)."""
    prompts = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            prompts.append(HeldOutPrompt(record["id"], record["turns"][0], record.get("category", "")))
    return prompts


@dataclass
class HeldOutRun:
    """Rounds and answers of one drafter on one prompt set."""

    trace: RoundTrace
    answers: list[dict]  # chat records {"id", "messages", "finish_reason"} of the target's answers
    seconds: float
    draft_seconds: float

    def summary(self) -> dict:
        stats = self.trace.stats()
        return {"rounds": stats.rounds, "tau": stats.tau, "committed_tokens": stats.committed_tokens,
                "conditional_acceptance": stats.conditional_acceptance,
                "unconditional_acceptance": stats.unconditional_acceptance, "seconds": self.seconds,
                "draft_ms_per_round": 1000 * self.draft_seconds / max(stats.rounds, 1)}


def _answer(tokenizer, row: list[int], eos_ids: set[int]) -> tuple[str, str]:
    ends = [i for i, tok in enumerate(row) if tok in eos_ids]
    finish = "stop" if ends else "length"
    return tokenizer.decode(row[: ends[0]] if ends else row, skip_special_tokens=True), finish


def run_heldout(target, tokenizer, drafter, prompts: Sequence[HeldOutPrompt], *, max_new_tokens: int = 128,
                batch_size: int = 8, temperature: float = 0.0, seed: int = DEEPSPEC_SEED,
                tag: str = "") -> HeldOutRun:
    """Every round of ``drafter`` on ``prompts`` (threshold 0, full block) and the target's answers."""
    if not prompts:  # no rounds: the summary's τ of 0 would read as a drafter that never gets a draft accepted
        raise ValueError("run_heldout needs at least one prompt (is the held-out prompt file empty?)")
    recorder = RoundRecorder(drafter.config.block_size, tag=tag)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    gen_kwargs = {"max_new_tokens": max_new_tokens, "pad_token_id": pad, **sampling_kwargs(temperature)}
    eos_ids = _eos_ids(target)
    _ensure_bound(drafter, target)
    answers, draft_seconds = [], 0.0
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first:first + batch_size]
        ids, mask = left_pad([encode_chat_prompt(tokenizer, p.text) for p in batch], pad)
        torch.manual_seed(seed + first)
        with torch.no_grad():  # threshold 0 passed per call: every round proposes the whole block
            out = target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter,
                                  dspark_recorder=recorder, **FULL_PROPOSALS, **gen_kwargs)
        draft_seconds += drafter.stats.draft_seconds
        for p, row in zip(batch, out[:, ids.shape[1]:].tolist()):
            text, finish = _answer(tokenizer, row, eos_ids)
            answers.append({"id": p.id, "category": p.category, "finish_reason": finish,
                            "messages": [{"role": "user", "content": p.text},
                                         {"role": "assistant", "content": text}]})
    return HeldOutRun(recorder.trace(), answers, time.perf_counter() - start, draft_seconds)


__all__ = ["HeldOutPrompt", "HeldOutRun", "read_heldout", "run_heldout"]
