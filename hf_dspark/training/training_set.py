"""A drafter's training set (``hf-dspark regenerate``): which prompts it holds, answered by the target itself.

Prompts come from the user's files (jsonl with ``turns``, ShareGPT ``conversations`` or OpenAI ``messages``),
from templates, from the target itself (Magpie: the instruct model writes user requests when given only the
user-turn prefix), from real sources (GSM8K train questions, requests written from the standard library) and from
well-formed chat requests composed from frames and slot lists (``chat_requests``: what Magpie's requests are not).
They are de-duplicated, interleaved round-robin (an early stop still leaves a mix of all of them) and refused if they
overlap the evaluation benchmarks. Answers come from the local target (batched ``generate``, or the
continuous-batching engine) or from any OpenAI-compatible server. Everything is resumable: prompts are fixed by
the seed, answers already in ``train.jsonl`` are skipped.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .chat_requests import chat_request_prompts
from .prompt_sources import TRAIN_CODE_MODULES, code_prompts, gsm8k_prompts
from .prompts import EvalOverlapGuard, Prompt, dedupe, read_prompts, synthesise_template_prompts
from .regenerate import (SamplingSettings, regenerate_endpoint, regenerate_local, regenerate_with_engine,
                         synthesise_magpie_prompts)

logger = logging.getLogger(__name__)

# Batch k of a Magpie synthesis uses system prompt k mod len: the kinds of request listed here are the spread of
# what people ask a chat assistant. Asked only generically, the target writes requests it answers more surely than
# hand-written ones, and a drafter trained on those trails on real chat (BENCHMARKS.md, "Where held-out chat loses").
_ASSISTANT = "You are a helpful AI assistant. "
MAGPIE_SYSTEMS = [
    None,
    _ASSISTANT + "Users ask you math word problems.",
    _ASSISTANT + "Users ask you to write Python code.",
    _ASSISTANT + "Users ask you for advice, explanations and writing help.",
    _ASSISTANT + "Users ask for advice about personal situations with family, friends, neighbours, colleagues or money.",
    _ASSISTANT + "Users ask why everyday things happen and how things in nature, science and the home work.",
    _ASSISTANT + "Users ask you to write poems, short stories, jokes, songs, speeches and letters.",
    _ASSISTANT + "Users ask you to play a character or to imagine a scenario and describe it.",
    _ASSISTANT + "Users ask for your opinion, or for the pros and cons of a decision they face.",
    _ASSISTANT + "Users ask you to compare options: products, skills, places, methods or ideas.",
    _ASSISTANT + "Users ask step by step how to fix, cook, clean, grow, build or repair something.",
    _ASSISTANT + "Users ask you to plan trips, events, budgets, routines and projects.",
    _ASSISTANT + "Users paste a short text and ask you to summarise it, rewrite it or change its tone.",
    _ASSISTANT + "Users ask about history, geography, philosophy, art and culture.",
    _ASSISTANT + "Users ask about technology, computers, phones, the internet and software they use.",
    _ASSISTANT + "Users ask about health, exercise, sleep, food and habits.",
    _ASSISTANT + "Users ask for lists: ideas, names, gifts, activities, books or tips.",
    _ASSISTANT + "Users ask about learning, studying, languages, jobs and careers.",
]
SOURCES = ("gsm8k", "code", "requests")
BACKENDS = ("generate", "engine")
TRAIN_FILE = "train.jsonl"


@dataclass
class TrainingSetRecipe:
    """What goes into the training set. ``sources``: any of :data:`SOURCES`; ``gsm8k_file`` feeds ``"gsm8k"``,
    ``num_requests`` sizes ``"requests"`` (composed chat requests, seeded by ``seed``)."""

    prompt_files: Sequence[str | os.PathLike] = ()
    num_template: int = 6000
    num_magpie: int = 1500
    magpie_max_new_tokens: int = 64
    sources: Sequence[str] = ()
    gsm8k_file: str | os.PathLike = "../shared/train_data/gsm8k_train.jsonl"
    num_requests: int = 4000
    seed: int = 0
    sampling: SamplingSettings = field(default_factory=lambda: SamplingSettings(temperature=0.2, top_p=0.9,
                                                                              max_new_tokens=384))

    def __post_init__(self) -> None:
        unknown = set(self.sources) - set(SOURCES)
        if unknown:
            raise ValueError(f"unknown prompt sources {sorted(unknown)}: choose from {', '.join(SOURCES)}")


def interleave(*sources: list[Prompt]) -> list[Prompt]:
    """Round-robin over the sources, so an early stop still leaves a mix of all of them."""
    out = []
    for i in range(max((len(s) for s in sources), default=0)):
        out.extend(s[i] for s in sources if i < len(s))
    return out


def _write_prompts(path: Path, prompts: list[Prompt]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"turns": list(p.turns), "category": p.category}, ensure_ascii=False) + "\n")


def gather_prompts(model, tokenizer, out_dir: str | os.PathLike, recipe: TrainingSetRecipe,
                   guard: EvalOverlapGuard) -> list[Prompt]:
    """Every prompt of the training set, in answering order; templated and Magpie prompts are written to (and on
    a rerun read back from) ``out_dir``. ``model`` / ``tokenizer`` are needed only for Magpie prompts."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    template_file = out / "prompts_template.jsonl"
    written = read_prompts(template_file) if template_file.exists() else None
    if written is None or len(written) < recipe.num_template:  # a first run, or a rerun asking for more: the same
        # seed synthesises the earlier prompts first, so what was answered stays in the set
        fresh = synthesise_template_prompts(recipe.num_template, seed=recipe.seed, guard=guard)
        if written is None or len(fresh) > len(written):
            _write_prompts(template_file, fresh)
    magpie_file = out / "prompts_magpie.jsonl"
    if recipe.num_magpie:  # resumable: continues an interrupted synthesis from the prompts already written
        synthesise_magpie_prompts(model, tokenizer, recipe.num_magpie, seed=recipe.seed, system_prompts=MAGPIE_SYSTEMS,
                                  guard=guard, out_path=magpie_file, max_new_tokens=recipe.magpie_max_new_tokens)
    own = dedupe([p for path in recipe.prompt_files for p in read_prompts(path)])
    template = read_prompts(template_file)[: recipe.num_template]
    magpie = read_prompts(magpie_file)[: recipe.num_magpie] if magpie_file.exists() else []
    sources = {}
    if "gsm8k" in recipe.sources:
        sources["gsm8k"] = gsm8k_prompts(recipe.gsm8k_file, guard=guard)
    if "code" in recipe.sources:
        sources["code"] = code_prompts(TRAIN_CODE_MODULES, seed=recipe.seed, guard=guard)
    if "requests" in recipe.sources:
        sources["requests"] = chat_request_prompts(recipe.num_requests, seed=recipe.seed, guard=guard)
    prompts = interleave(own, template, magpie, *sources.values())
    guard.raise_if_overlapping(prompts)
    logger.info("%d prompts: %d yours, %d templated, %d Magpie, from sources %s", len(prompts), len(own),
                len(template), len(magpie), {name: len(s) for name, s in sources.items()})
    return prompts


def regenerate_training_set(model, tokenizer, out_dir: str | os.PathLike, recipe: TrainingSetRecipe,
                            eval_dir: str | os.PathLike, *, backend: str = "generate", batch_size: int = 24,
                            endpoint: str | None = None, model_name: str | None = None,
                            api_key: str = "EMPTY", engine=None) -> Path:
    """Gather the prompts and answer them into ``<out_dir>/train.jsonl`` (returned).

    ``backend``: batched ``generate`` (``batch_size`` prompts a batch) or ``"engine"``: the continuous-batching
    ``engine`` the caller built (a ``DSparkEngine`` with policy none: a finished answer frees its row at once; the
    caller builds it because serving sits above training); with ``endpoint`` a server answers as ``model_name``
    and the local model only writes Magpie prompts. ``eval_dir``: the prompts never trained on.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: choose one of {', '.join(BACKENDS)}")
    if backend == "engine" and engine is None and not endpoint:
        raise ValueError("backend='engine' answers with a DSparkEngine: pass engine=DSparkEngine(model, policy='none', "
                         "max_running_requests=..., tokenizer=tokenizer)")
    guard = EvalOverlapGuard.from_dir(eval_dir)
    if not any(Path(eval_dir).glob("*.jsonl")):
        logger.warning("No evaluation prompts in %s: the training set cannot be checked for overlap with them",
                       eval_dir)
    prompts = gather_prompts(model, tokenizer, out_dir, recipe, guard)
    train_file = Path(out_dir) / TRAIN_FILE
    if endpoint:
        regenerate_endpoint(endpoint, model_name, prompts, train_file, settings=recipe.sampling, api_key=api_key)
    elif backend == "engine":
        regenerate_with_engine(engine, tokenizer, prompts, train_file, settings=recipe.sampling, seed=recipe.seed)
    else:
        regenerate_local(model, tokenizer, prompts, train_file, settings=recipe.sampling, batch_size=batch_size,
                         seed=recipe.seed)
    return train_file
