"""Benchmark prompts, selected and rendered the way DeepSpec's evaluation does (so τ is comparable to the paper).

* files: ``<eval_dir>/<name>.jsonl``, one ``{"turns": [...]}`` record a line (DeepSpec's ``eval_datasets``);
* caps: DeepSpec's per-benchmark sample caps; a file longer than its cap is shuffled with
  ``random.Random(seed)`` (seed 980406) and cut to the cap, shorter files are used whole and in order;
* prompt: the **first turn only** (MT-Bench is single-turn here), as the only user message, rendered with the
  target's chat template and ``add_generation_prompt=True``; no system prompt of our own (a template that
  inserts a default one keeps it, as in DeepSpec); ``enable_thinking=False`` for templates that know it.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..training.prompts import Prompt, PromptFileError, read_prompts

DEEPSPEC_SEED = 980406
DEFAULT_BENCHMARKS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")
# DeepSpec eval.py's caps (alpaca / livecodebench / arena-hard files are not shipped in ../shared).
DEEPSPEC_SAMPLE_CAPS: Mapping[str, int] = {
    "gsm8k": 500, "math500": 500, "aime25": 30, "humaneval": 164, "mbpp": 256, "livecodebench": 500,
    "mt-bench": 80, "alpaca": 500, "arena-hard-v2": 500,
}
BENCHMARK_CATEGORIES: Mapping[str, str] = {
    "gsm8k": "math", "math500": "math", "aime25": "math", "humaneval": "code", "mbpp": "code",
    "livecodebench": "code", "mt-bench": "chat", "alpaca": "chat", "arena-hard-v2": "chat",
}
EVAL_DIR_ENV = "HF_DSPARK_EVAL_DIR"


def eval_dir_candidates() -> list[Path]:
    """Where the benchmark prompts may be, in order: ``$HF_DSPARK_EVAL_DIR``; ``../shared/eval_datasets`` beside
    the repository checkout the package runs from (a source or editable install); ``../shared/eval_datasets``
    from the working directory (a wheel installed elsewhere, run from inside the repository)."""
    candidates = [Path(os.environ[EVAL_DIR_ENV])] if os.environ.get(EVAL_DIR_ENV) else []
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file():
        candidates.append(checkout.parent / "shared" / "eval_datasets")
    candidates.append(Path.cwd().parent / "shared" / "eval_datasets")
    return candidates


def default_eval_dir() -> Path:
    """The first of :func:`eval_dir_candidates` that exists (``$HF_DSPARK_EVAL_DIR`` whenever it is set, so a
    wrong value is reported rather than silently replaced); the first candidate when none does."""
    candidates = eval_dir_candidates()
    if os.environ.get(EVAL_DIR_ENV):
        return candidates[0]
    return next((path for path in candidates if path.is_dir()), candidates[0])


def benchmark_path(name: str, eval_dir: str | os.PathLike | None = None) -> Path:
    """``<eval_dir>/<name>.jsonl`` (default: :func:`default_eval_dir`); a missing file is a FileNotFoundError that
    says where it looked and how to point elsewhere."""
    directory = Path(eval_dir) if eval_dir is not None else default_eval_dir()
    path = directory / f"{name}.jsonl"
    if not path.is_file():
        looked = str(directory) if eval_dir is not None else ", ".join(dict.fromkeys(map(str, eval_dir_candidates())))
        raise FileNotFoundError(f"benchmark file {name}.jsonl not found (looked in {looked}): set ${EVAL_DIR_ENV} "
                                "(or pass --eval-dir) to a folder of <benchmark>.jsonl files with 'turns' records, "
                                "e.g. the repository's ../shared/eval_datasets.")
    return path


@dataclass(frozen=True)
class Benchmark:
    """A benchmark's selected first turns, in evaluation order (prompt i is run with seed + i)."""

    name: str
    prompts: tuple[str, ...]

    @property
    def category(self) -> str:
        return BENCHMARK_CATEGORIES.get(self.name, "other")


def select_samples(items: Sequence, cap: int | None, seed: int = DEEPSPEC_SEED) -> list:
    """DeepSpec's subsampling: shuffle with ``random.Random(seed)`` only when there are more items than the cap."""
    items = list(items)
    if cap is not None and len(items) > cap:
        random.Random(seed).shuffle(items)
        items = items[:cap]
    return items


def load_benchmark(name: str, eval_dir: str | os.PathLike | None = None, cap: int | None = None,
                   seed: int = DEEPSPEC_SEED) -> Benchmark:
    """Read ``<eval_dir>/<name>.jsonl`` and select its prompts. ``cap`` defaults to DeepSpec's cap for the
    benchmark (no cap for unknown names); pass a smaller one for CPU runs."""
    cap = DEEPSPEC_SAMPLE_CAPS.get(name) if cap is None else cap
    turns = [p.first_turn for p in read_benchmark_prompts(name, eval_dir)]
    return Benchmark(name, tuple(select_samples(turns, cap, seed)))


def read_benchmark_prompts(name: str, eval_dir: str | os.PathLike | None = None) -> list[Prompt]:
    """Every prompt of ``<eval_dir>/<name>.jsonl``; :class:`PromptFileError` when it holds none (an empty file gave
    a row of dashes, and the run went on as if the benchmark had been measured)."""
    path = benchmark_path(name, eval_dir)
    prompts = read_prompts(path)
    if not prompts:
        raise PromptFileError(f"benchmark file {path} holds no prompts (one 'turns' record a line).")
    return prompts


def encode_chat_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as the only user turn, with the generation prompt appended."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; evaluation renders prompts with the target's chat "
                         "template (set tokenizer.chat_template)")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False, enable_thinking=False)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def left_pad(rows: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, L], left-padded as decoder-only batched generation expects."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.tensor(list(row), dtype=torch.long)
            mask[i, width - len(row):] = 1
    return ids, mask


__all__ = [
    "BENCHMARK_CATEGORIES",
    "DEEPSPEC_SAMPLE_CAPS",
    "DEEPSPEC_SEED",
    "DEFAULT_BENCHMARKS",
    "Benchmark",
    "benchmark_path",
    "default_eval_dir",
    "eval_dir_candidates",
    "encode_chat_prompt",
    "left_pad",
    "load_benchmark",
    "read_benchmark_prompts",
    "select_samples",
]
