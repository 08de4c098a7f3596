"""The training recipe behind ``hf-dspark cache`` and ``hf-dspark train``: target cache -> drafter -> trainer.

1. :func:`cache_conversations` runs the target once over regenerated conversations and stores its tapped layers
   (resumable: conversations already cached are skipped);
2. :func:`build_drafter` assembles the drafter a cache can train: a DSpark block drafter (``head`` markov / gated /
   rnn, or ``none`` = DFlash) or the Eagle3-style baseline, tapping the cache's layers, optionally on the N most
   frequent answer tokens only, or continued from a trained drafter (``init_from``, optionally deepened);
3. :func:`train_drafter` trains it with :class:`DSparkTrainer` on ``accelerate`` (one CPU, one GPU, or many under
   ``accelerate launch``) and writes ``<out>/drafter``.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .draft_vocabulary import count_answer_tokens, coverage, most_frequent_tokens
from .losses import LossConfig
from .target_cache import (MIN_LOSS_TOKENS, TargetCacheDataset, TargetCacheError, build_target_cache,
                           read_conversations, target_logits_function, validate_manifest, write_target_logsumexp)
from .trainer import DSparkTrainer, DSparkTrainingConfig, make_accelerator, steps_for_epochs

logger = logging.getLogger(__name__)


@dataclass
class CacheRecipe:
    """How conversations are cached: tapped ``layers`` (default: DSparkConfig's spread of 5), storage ``dtype``,
    ``limit`` (the first N records only, e.g. to keep the tail held out), ``logsumexp`` (also store the target's
    per-token log-normaliser, which reduced-vocabulary training reads)."""

    layers: Sequence[int] | None = None
    max_length: int = 1024
    batch_size: int = 8
    dtype: str = "bfloat16"
    min_loss_tokens: int = MIN_LOSS_TOKENS
    shard_size_mb: int = 512
    limit: int | None = None
    logsumexp: bool = False


@dataclass
class DrafterRecipe:
    """The drafter to train. ``head``: a DSpark sequential head, ``"none"`` (DFlash) or ``"eagle3"``.
    ``init_from``: a trained drafter to continue (its architecture and draft vocabulary win over the fields here);
    ``grow_to_layers``: deepen it first (new layers start as zero-output copies, so it proposes the same)."""

    head: str = "markov"
    num_layers: int = 1
    block_size: int = 7
    markov_rank: int = 128
    init_from: str | os.PathLike | None = None
    grow_to_layers: int | None = None
    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.grow_to_layers and not self.init_from:
            raise ValueError("grow_to_layers deepens a trained drafter: give init_from (or num_layers for a new one)")


@dataclass
class TrainingRecipe:
    """Length and optimisation. Exactly one of ``steps`` / ``epochs`` sets the LR schedule; ``max_minutes`` only
    stops early (with a checkpoint). Loss weights left None take the head's defaults (``LossConfig.for_head``)."""

    steps: int | None = None
    epochs: float | None = None
    max_minutes: float | None = None
    batch_size: int = 1
    grad_accum: int = 8
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    max_grad_norm: float = 1.0
    num_anchors: int = 64
    decay: float = 4.0
    ce_weight: float | None = None
    l1_weight: float | None = None
    confidence_weight: float | None = None
    chunk_blocks: int = 256
    mixed_precision: str = "auto"
    seed: int = 0
    save_steps: int = 500
    save_total_limit: int = 2
    progress: bool = True

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("give exactly one of steps or epochs (the LR schedule needs a length; max_minutes only "
                             "stops early)")


def cache_conversations(target, tokenizer, data_files: Sequence[str | os.PathLike], out_dir: str | os.PathLike,
                        recipe: CacheRecipe | None = None) -> dict:
    """Build or extend the target cache at ``out_dir`` from jsonl(.gz) files of ``{"id", "messages"}``; the manifest.

    Every file is read and checked before the target runs (:class:`ConversationFileError` names a bad one): a
    record without messages in the last file failed after the others had been cached. The files are small next to
    their cache (a few MB of text for GBs of features), so holding their records costs nothing that matters."""
    recipe = recipe or CacheRecipe()
    records = itertools.chain.from_iterable([read_conversations(path) for path in data_files])
    if recipe.limit is not None:
        records = itertools.islice(records, recipe.limit)
    manifest = build_target_cache(target, tokenizer, records, out_dir,
                                  layer_ids=list(recipe.layers) if recipe.layers else None,
                                  max_length=recipe.max_length, batch_size=recipe.batch_size, dtype=recipe.dtype,
                                  min_loss_tokens=recipe.min_loss_tokens, shard_size_mb=recipe.shard_size_mb)
    if recipe.logsumexp:
        compute_logits, head_dtype = target_logits_function(target)
        write_target_logsumexp(out_dir, compute_logits, head_dtype)
    logger.info("Cache %s: %d samples, %d tokens (%d loss tokens), layers %s", out_dir, manifest["num_samples"],
                manifest["num_tokens"], manifest["num_loss_tokens"], manifest["target_layer_ids"])
    return manifest


def select_draft_vocabulary(target, cache_dir: str | os.PathLike, size: int) -> torch.Tensor:
    """The ``size`` most frequent answer tokens of the cache (EOS always included): a reduced draft vocabulary."""
    vocab = target.config.get_text_config().vocab_size
    counts = count_answer_tokens(cache_dir, vocab)
    eos = target.generation_config.eos_token_id
    draft_vocab = most_frequent_tokens(counts, size, always_include=eos if isinstance(eos, list) else [eos])
    logger.info("Draft vocabulary: %d of %d tokens, covering %.2f%% of the cached answer tokens (%d distinct tokens "
                "occur)", len(draft_vocab), vocab, 100 * coverage(counts, draft_vocab), int((counts > 0).sum()))
    return draft_vocab


def build_drafter(target, cache_dir: str | os.PathLike, manifest: dict, recipe: DrafterRecipe, seed: int = 0):
    """``(drafter, head)``: the untrained (or ``init_from``) drafter for ``target`` tapping the cache's layers.

    ``seed`` seeds the global RNG before initialising, as training has always done (runs are reproducible).
    """
    from ..modeling import DSparkDraftModel, Eagle3DraftModel

    draft_vocab = None
    if recipe.draft_vocab_size and not recipe.init_from:
        draft_vocab = select_draft_vocabulary(target, cache_dir, recipe.draft_vocab_size)
    torch.manual_seed(seed)
    if recipe.init_from:
        return _continued_drafter(target, recipe), None
    layers = manifest["target_layer_ids"]
    if recipe.head == "eagle3":
        drafter = Eagle3DraftModel.from_target(target, block_size=recipe.block_size, target_layer_ids=layers,
                                               draft_vocab=draft_vocab)
    else:
        drafter = DSparkDraftModel.from_target(target, num_layers=recipe.num_layers, block_size=recipe.block_size,
                                               head=recipe.head, markov_rank=recipe.markov_rank,
                                               target_layer_ids=layers, draft_vocab=draft_vocab)
    return drafter, recipe.head


def _continued_drafter(target, recipe: DrafterRecipe):
    from ..modeling import DSparkDraftModel

    drafter = DSparkDraftModel.from_pretrained(recipe.init_from, target=target)  # binding casts (RoPE kept float32)
    if recipe.grow_to_layers:
        logger.info("Growing the drafter from %d to %d layer(s)", drafter.config.num_hidden_layers,
                    recipe.grow_to_layers)
        drafter.grow_layers(recipe.grow_to_layers)
    logger.info("Initialised from %s (%s head, %d layer(s), draft vocabulary %s); architecture options ignored",
                recipe.init_from, drafter_head(drafter), drafter.config.num_hidden_layers,
                drafter.config.draft_vocab_size or "full")
    return drafter


def drafter_head(drafter) -> str:
    """The loss family of a drafter: its sequential head, or ``"eagle3"`` for the autoregressive baseline."""
    return "eagle3" if drafter.config.drafter_architecture == "eagle3" else drafter.config.sequential_head


def train_drafter(target, cache_dir: str | os.PathLike, out_dir: str | os.PathLike,
                  drafter_recipe: DrafterRecipe | None = None, training: TrainingRecipe | None = None, *,
                  resume: bool = False) -> Path | None:
    """Train a drafter for ``target`` on the cache and write ``<out_dir>/drafter``; its path, or None when the run
    stopped early (``max_minutes``; rerun with ``resume=True`` to continue exactly)."""
    drafter_recipe, training = drafter_recipe or DrafterRecipe(), training or TrainingRecipe(steps=1000)
    accelerator = make_accelerator(training.mixed_precision)
    dataset = TargetCacheDataset(cache_dir)
    if not len(dataset):
        raise TargetCacheError(f"the target cache {cache_dir} holds no conversations (each needs at least its "
                               "min_loss_tokens answer tokens): cache more or longer ones (hf-dspark cache --data).")
    drafter, _ = build_drafter(target, cache_dir, dataset.manifest, drafter_recipe, seed=training.seed)
    head = drafter_head(drafter)
    validate_manifest(dataset.manifest, drafter.config)
    if drafter.draft_to_target is not None and not dataset.has_logsumexp:
        # the reduced-vocabulary loss reads the target's log-normaliser from disk instead of a full-vocab product
        if accelerator.is_main_process:
            write_target_logsumexp(cache_dir, drafter.compute_logits, target.get_output_embeddings().weight.dtype,
                                   progress=training.progress)
        accelerator.wait_for_everyone()
        dataset = TargetCacheDataset(cache_dir)
    overrides = {k: v for k, v in (("ce_weight", training.ce_weight), ("l1_weight", training.l1_weight),
                                   ("confidence_weight", training.confidence_weight)) if v is not None}
    loss = LossConfig.for_head(head, decay=training.decay, chunk_blocks=training.chunk_blocks, **overrides)
    steps = training.steps or steps_for_epochs(training.epochs, len(dataset), training.batch_size,
                                               training.grad_accum, accelerator.num_processes)
    config = DSparkTrainingConfig(
        output_dir=str(out_dir), max_steps=steps, max_minutes=training.max_minutes,
        per_device_batch_size=training.batch_size, gradient_accumulation_steps=training.grad_accum,
        learning_rate=training.lr, warmup_ratio=training.warmup_ratio, max_grad_norm=training.max_grad_norm,
        num_anchors=training.num_anchors, loss=loss, seed=training.seed, save_steps=training.save_steps,
        save_total_limit=training.save_total_limit, mixed_precision=training.mixed_precision,
        progress=training.progress)
    logger.info("Drafter: %s head, %d layer(s), block %d, %.1fM trainable parameters; %d samples, %d steps", head,
                drafter.config.num_hidden_layers, drafter.config.block_size,
                sum(p.numel() for p in drafter.parameters()) / 1e6, len(dataset), steps)
    trainer = DSparkTrainer(drafter, dataset, config, accelerator=accelerator)
    last = trainer.train(resume=resume)
    if last and accelerator.is_main_process:  # one closing log per run, not one per process
        logger.info("Stopped at step %d/%d: loss %.4f, tau_probabilistic %.3f", trainer.step, steps, last["loss"],
                    last["tau_probabilistic"])
    if trainer.step < steps:
        return None
    if accelerator.is_main_process:
        logger.info("Drafter written to %s", Path(out_dir) / "drafter")
    return Path(out_dir) / "drafter"
