"""A drafter training run that does not stop: every session continues the committed drafter on all the data there is.

One call of :func:`train_continuously` is one session's share of a run that spans machines and sessions:

1. the drafter starts from ``best_dir`` (the committed bf16 weights; on the very first run from ``init_from``,
   converted to ``draft_layer_style`` and deepened to ``num_layers``), with a fresh optimizer and a constant
   learning rate after a short warm-up (no session knows how long the run will last, so the schedule has no end);
2. it trains on chat-record files (regenerated on-policy answers and human-written text alike), the target
   prefilling each conversation when it is read (:class:`~.prefill_features.TargetPrefillDataset`): the signal is
   as large as the text on disk, and files that grow while the run goes on (a regeneration beside it) are read
   again at the next evaluation;
3. every ``eval_every`` steps it checkpoints into ``run_dir`` (a crash resumes from there) and scores the drafter on
   the fixed held-out cache (greedy τ, full block, per prompt set); each score is one row of ``curve_file`` with
   the tokens seen since the run began, across sessions. When the held-out τ beats every earlier row, the bf16
   weights go to ``best_dir`` for the session to commit.

It stops at ``max_hours`` or when killed; nothing is lost but the steps since the last evaluation.

The run's own weights train at a constant rate, so they carry the rate's noise: :func:`cool_down` (at the end of a
session) continues a copy of them for a few hundred steps with the rate decaying to zero, scores that copy as a row
of its own (``cool_down_steps`` set) and ships it when it is the best yet, while the run itself goes on from its
uncooled checkpoint — the warm-up / stable / decay practice of runs that do not know their length.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .losses import LossConfig
from .prefill_features import TargetPrefillDataset, chat_record_files, read_chat_records
from .target_cache import TargetCacheDataset
from .trainer import DSparkTrainer, DSparkTrainingConfig, make_accelerator
from .validation import score_prompt_sets

logger = logging.getLogger(__name__)

PROGRESS_NAME = "progress.json"  # in run_dir: tokens seen by this session's checkpoints


@dataclass
class ContinuousRecipe:
    """Where the run lives and how it trains (see the module docstring)."""

    data: list[str]  # chat-record files or glob patterns (jsonl / jsonl.gz)
    heldout_cache: str  # target cache of the target's greedy answers to the held-out prompts
    run_dir: str  # this machine's checkpoints and metrics (not committed)
    best_dir: str  # the committed drafter (bf16): continued from, rewritten when held-out τ improves
    curve_file: str  # the committed curve: one JSON row per evaluation
    init_from: str | None = None  # first run only: the drafter to start from when best_dir holds none
    num_layers: int | None = None  # first run only: deepen init_from to this many layers
    draft_layer_style: str = "qwen3"  # first run only: the layer style init_from is converted to
    eval_every: int = 200
    max_hours: float | None = None
    max_evaluations: int | None = None  # stop after this many evaluations (None: at max_hours or when killed)
    lr: float = 1e-4  # 3e-4 stopped improving the held-out τ where 1e-4 kept climbing (BENCHMARKS.md)
    warmup_steps: int = 50
    batch_size: int = 4
    grad_accum: int = 1
    num_anchors: int = 64
    max_length: int = 1024
    bf16_features: bool | None = None  # prefill with a bf16 copy of the target; None = where the CPU has bf16 units
    mixed_precision: str = "auto"  # the drafter's step: "auto" = bf16 autocast where the CPU has bf16 units, or "no"
    seed: int = 0
    # prefilled features kept on disk (feature_memo.py): later epochs read them instead of prefilling again
    feature_memo: str | None = None
    feature_memo_gb: float | None = 40.0
    skip_repeats: int | None = None  # no loss on answer tokens completing an n-gram seen before (repetition.py)
    session: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M"))


def step_precision(mixed_precision: str = "auto") -> str:
    """The accelerate precision of the drafter's step for a recipe's ``mixed_precision``. On a CPU with bf16 units,
    bf16 autocast runs the step faster at the same loss (the soft labels stay fp32: ``losses.target_probabilities``);
    without them oneDNN emulates bf16 and the step gets slower, so "auto" keeps fp32 there. GPUs: bf16."""
    from ..cpu_kernels import cpu_has_bf16_units

    if mixed_precision != "auto":
        return mixed_precision
    if torch.cuda.is_available():
        return "bf16"
    return "bf16" if cpu_has_bf16_units() else "no"


def start_drafter(target, recipe: ContinuousRecipe):
    """The drafter this session continues: ``best_dir``'s, else ``init_from``'s converted to the recipe's layers."""
    from ..modeling import DSparkDraftModel

    if (Path(recipe.best_dir) / "config.json").is_file():
        return DSparkDraftModel.from_pretrained(recipe.best_dir, target=target).float()
    if recipe.init_from is None:
        raise FileNotFoundError(f"{recipe.best_dir} holds no drafter yet: give init_from (a trained drafter to start "
                                "from) for the first run.")
    return convert_layer_style(DSparkDraftModel.from_pretrained(recipe.init_from, target=target).float(),
                               target, recipe.draft_layer_style, recipe.num_layers)


def convert_layer_style(drafter, target, style: str, num_layers: int | None = None):
    """A drafter with ``style`` layers that starts from ``drafter``'s weights: every tensor both layouts have is
    copied; q/k norms a Qwen3-style layer adds start at 1 (so attention changes only by the normalisation); layers
    beyond the old ones are zero-output copies (:meth:`~hf_dspark.modeling.DSparkDraftModel.grow_layers`)."""
    config = copy.deepcopy(drafter.config)
    config.draft_layer_style = style
    fresh = type(drafter)(config).to(next(drafter.parameters()).dtype)  # an Eagle3 drafter stays one
    missing, unexpected = fresh.load_state_dict(drafter.state_dict(), strict=False)
    if unexpected or any("_norm" not in name for name in missing):
        raise ValueError(f"Cannot convert the drafter's layers to {style!r}: missing {missing}, unexpected "
                         f"{unexpected}.")
    fresh.bind_target(target)
    if num_layers and num_layers > fresh.config.num_hidden_layers:
        fresh.grow_layers(num_layers)
    logger.info("Drafter converted to %s-style layers (%d layer(s)); new tensors: %s", style,
                fresh.config.num_hidden_layers, missing or "none")
    return fresh


def save_bf16(drafter, out_dir: str | os.PathLike) -> Path:
    """Write the drafter's weights in bf16 (half the bytes; training continues from them in fp32)."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    state = {name: t.detach().to(torch.bfloat16) if t.is_floating_point() else t.detach()
             for name, t in drafter.state_dict().items()}
    drafter.save_pretrained(tmp, state_dict=state)
    config = json.loads((tmp / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if out.exists():
        for child in out.iterdir():
            child.unlink()
        out.rmdir()
    os.replace(tmp, out)
    return out


def best_row(curve: list[dict]) -> dict | None:
    """The row whose drafter is in ``best_dir`` (the first of equals, as the run only ever writes on improvement)."""
    return max(curve, key=held_out_tau, default=None)


def read_curve(path: str | os.PathLike) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def held_out_tau(row: dict) -> float:
    """The number a curve row is ranked by: the mean of the prompt sets' greedy τ."""
    taus = [v["tau_greedy"] for v in row["heldout"].values()]
    return sum(taus) / len(taus)


def prefill_dataset(target, tokenizer, recipe: ContinuousRecipe, drafter, records: list[dict],
                    feature_target) -> TargetPrefillDataset:
    """The recipe's conversations, prefilled on read (or read back from the recipe's feature memo)."""
    cap = None if recipe.feature_memo_gb is None else int(recipe.feature_memo_gb * 1e9)
    return TargetPrefillDataset(target, tokenizer, records, drafter.config.target_layer_ids,
                                max_length=recipe.max_length, feature_target=feature_target,
                                logsumexp=drafter.draft_to_target is not None, progress=False,
                                memo_dir=recipe.feature_memo, memo_max_bytes=cap, skip_repeats=recipe.skip_repeats)


def prefills_in_bf16(bf16_features: bool | None = None) -> bool:
    """Whether the run prefills with a bf16 copy of the target. ``None`` decides by the hardware: a GPU or a CPU with
    bf16 units prefills about twice as fast in bf16 (at the same held-out τ, BENCHMARKS.md); on any other CPU oneDNN
    emulates bf16 and prefill gets many times slower than fp32's."""
    from ..cpu_kernels import cpu_has_bf16_units

    if bf16_features is not None:
        return bf16_features
    return torch.cuda.is_available() or cpu_has_bf16_units()


def prefilling_target(target, bf16_features: bool | None = None):
    """The model that prefills: a bf16 copy of the target where that is faster (:func:`prefills_in_bf16`)."""
    return copy.deepcopy(target).to(torch.bfloat16).eval() if prefills_in_bf16(bf16_features) else target


def feature_target_for(target, recipe: ContinuousRecipe):
    """The recipe's prefilling model (:func:`prefilling_target`)."""
    return prefilling_target(target, recipe.bf16_features)


def fill_feature_memo(target, tokenizer, recipe: ContinuousRecipe) -> int:
    """Prefill every conversation the run would read into its feature memo (a second process can do this beside
    the run, which then finds most of its reads stored); returns how many were prefilled now."""
    from tqdm.auto import tqdm

    if recipe.feature_memo is None:
        raise ValueError("The recipe has no feature_memo folder to fill.")
    drafter = start_drafter(target, recipe)
    dataset = prefill_dataset(target, tokenizer, recipe, drafter, _DataFiles(recipe.data).records(),
                              feature_target_for(target, recipe))
    for i in tqdm(range(len(dataset) - 1, -1, -1), desc="feature memo", unit="conversation"):
        dataset[i]  # the run reads in random order from the front of its epoch: fill from the back
    logger.info("Feature memo %s: %d conversations prefilled now, %d were stored; %.1f GB", dataset.memo.dir,
                dataset.memo.misses, dataset.memo.hits, dataset.memo.used_bytes / 1e9)
    return dataset.memo.misses


class _DataFiles:
    """The recipe's chat-record files and their sizes: a dataset is rebuilt only when they changed."""

    def __init__(self, patterns: list[str]):
        self.patterns = patterns
        self.signature: tuple = ()

    def changed(self) -> bool:
        signature = tuple((str(p), p.stat().st_size) for p in chat_record_files(self.patterns))
        if signature == self.signature:
            return False
        self.signature = signature
        return True

    def records(self) -> list[dict]:
        return read_chat_records(chat_record_files(self.patterns))


def train_continuously(target, tokenizer, recipe: ContinuousRecipe) -> list[dict]:
    """Run one session of the continuous training (see the module docstring); returns this session's curve rows."""
    drafter = start_drafter(target, recipe)
    feature_target = feature_target_for(target, recipe)
    files = _DataFiles(recipe.data)
    files.changed()

    def dataset():
        return prefill_dataset(target, tokenizer, recipe, drafter, files.records(), feature_target)

    config = DSparkTrainingConfig(
        output_dir=recipe.run_dir, max_steps=10**9, per_device_batch_size=recipe.batch_size,
        gradient_accumulation_steps=recipe.grad_accum, learning_rate=recipe.lr, num_anchors=recipe.num_anchors,
        loss=LossConfig.for_head(drafter.config.sequential_head), seed=recipe.seed, save_total_limit=1,
        schedule="constant", warmup_steps=recipe.warmup_steps, progress=False)
    run_dir = Path(recipe.run_dir)
    curve = read_curve(recipe.curve_file)
    tokens = best_row(curve)["train_tokens"] if curve else 0  # what the committed drafter we start from has seen
    # every session would otherwise replay the same sample order from the top: seed it with where the run stands
    config.seed = recipe.seed + tokens
    trainer = DSparkTrainer(drafter, dataset(), config, accelerator=make_accelerator(step_precision(recipe.mixed_precision)))
    checkpoint = trainer.latest_checkpoint(must_exist=False)
    if checkpoint is not None and (run_dir / PROGRESS_NAME).is_file():  # this session crashed: go on from there
        trainer.load_checkpoint(checkpoint, exact=False)
        tokens = json.loads((run_dir / PROGRESS_NAME).read_text())["train_tokens"]
    heldout = TargetCacheDataset(recipe.heldout_cache)
    best = max((held_out_tau(r) for r in curve), default=float("-inf"))
    rows: list[dict] = []
    if not curve:  # the run's starting point is the first row
        rows.append(_evaluate(trainer, heldout, recipe, tokens, 0.0))
        _append(recipe.curve_file, rows[-1])
    start = time.monotonic()
    while (recipe.max_hours is None or time.monotonic() - start < 3600 * recipe.max_hours) and (
            recipe.max_evaluations is None or len(rows) - (not curve) < recipe.max_evaluations):
        step_start, loss = time.monotonic(), 0.0
        for _ in range(recipe.eval_every):
            stats, info = trainer.training_step()
            tokens += info["num_tokens"]
            loss += stats.summary(config.loss)["loss"] / recipe.eval_every
        trainer.save_checkpoint()
        (run_dir / PROGRESS_NAME).write_text(json.dumps({"train_tokens": tokens, "step": trainer.step}))
        row = _evaluate(trainer, heldout, recipe, tokens, loss)
        row["train_seconds"] = round(time.monotonic() - step_start, 1)
        rows.append(row)
        _append(recipe.curve_file, row)
        if held_out_tau(row) > best:
            best = held_out_tau(row)
            save_bf16(trainer.drafter, recipe.best_dir)
            logger.info("Held-out τ %.3f is the best yet: drafter written to %s", best, recipe.best_dir)
        if files.changed():
            trainer.replace_dataset(dataset())
    return rows


def cool_down(target, tokenizer, recipe: ContinuousRecipe, steps: int, warmup_steps: int = 10) -> dict:
    """Score a cooled-down copy of the run: its latest checkpoint (else the committed drafter) trained ``steps`` more
    steps with a fresh optimizer, the rate warming up then decaying to zero (cosine), on the same data. The row goes
    to the curve with ``cool_down_steps``; the copy goes to ``best_dir`` when it beats every earlier row. The run's
    checkpoint is left as it was: the next session continues the uncooled weights."""
    from safetensors.torch import load_file

    drafter = start_drafter(target, recipe)
    curve = read_curve(recipe.curve_file)
    tokens, step = (best_row(curve)["train_tokens"], best_row(curve)["step"]) if curve else (0, 0)
    latest = Path(recipe.run_dir) / "latest"
    if latest.is_file() and (Path(recipe.run_dir) / PROGRESS_NAME).is_file():
        checkpoint = Path(recipe.run_dir) / latest.read_text().strip()
        drafter.load_state_dict(load_file(checkpoint / "model.safetensors"), strict=True)
        progress = json.loads((Path(recipe.run_dir) / PROGRESS_NAME).read_text())
        tokens, step = progress["train_tokens"], progress["step"]
        logger.info("Cooling down a copy of %s (%d tokens)", checkpoint, tokens)
    dataset = prefill_dataset(target, tokenizer, recipe, drafter, read_chat_records(chat_record_files(recipe.data)),
                              feature_target_for(target, recipe))
    config = DSparkTrainingConfig(
        output_dir=str(Path(recipe.run_dir) / "cool-down"), max_steps=steps, per_device_batch_size=recipe.batch_size,
        gradient_accumulation_steps=recipe.grad_accum, learning_rate=recipe.lr, num_anchors=recipe.num_anchors,
        loss=LossConfig.for_head(drafter.config.sequential_head), seed=recipe.seed + step, schedule="cosine",
        warmup_steps=warmup_steps, progress=False)
    trainer = DSparkTrainer(drafter, dataset, config, accelerator=make_accelerator(step_precision(recipe.mixed_precision)))
    start, loss = time.monotonic(), 0.0
    for _ in range(steps):
        stats, info = trainer.training_step()
        tokens += info["num_tokens"]
        loss += stats.summary(config.loss)["loss"] / steps
    trainer.step = step  # the row is the run's step it branched from
    row = _evaluate(trainer, TargetCacheDataset(recipe.heldout_cache), recipe, tokens, loss)
    row["cool_down_steps"] = steps
    row["train_seconds"] = round(time.monotonic() - start, 1)
    if held_out_tau(row) > max((held_out_tau(r) for r in curve), default=float("-inf")):
        save_bf16(trainer.drafter, recipe.best_dir)
        logger.info("Cooled-down held-out τ %.3f is the best yet: drafter written to %s", held_out_tau(row),
                    recipe.best_dir)
    _append(recipe.curve_file, row)
    return row


def _evaluate(trainer, heldout, recipe: ContinuousRecipe, tokens: int, loss: float) -> dict:
    scores = score_prompt_sets(trainer.drafter, heldout)
    row = {"session": recipe.session, "step": trainer.step, "train_tokens": int(tokens),
           "train_loss": round(loss, 4), "samples": len(trainer.dataset), "lr": trainer.config.learning_rate,
           "precision": trainer.accelerator.mixed_precision, "num_anchors": trainer.config.num_anchors,
           # how the scores rank the sequential bias (drafting's own setting): rows without it used the base top-64
           "sequential_top_k": getattr(trainer.drafter.config, "sequential_top_k", None),
           "skip_repeats": recipe.skip_repeats,
           # the drafter's draft vocabulary when scored (rows without it: 8,192 tokens)
           "draft_vocab_size": trainer.drafter.config.draft_vocab_size,
           "heldout": {name: {"tau_greedy": round(s["tau_greedy"], 4),
                              "acceptance": [round(a, 4) for a in s["conditional_acceptance"]]}
                       for name, s in scores.items()},
           "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    logger.info("step %d, %d tokens: held-out τ %s", trainer.step, tokens,
                {name: s["tau_greedy"] for name, s in row["heldout"].items()})
    return row


def _append(path: str | os.PathLike, row: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


__all__ = ["ContinuousRecipe", "best_row", "convert_layer_style", "cool_down", "prefilling_target",
           "prefills_in_bf16", "read_curve", "save_bf16", "step_precision", "train_continuously"]
