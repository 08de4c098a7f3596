"""Drafter training on a target cache, with `accelerate`: one CPU, one GPU or `accelerate launch` on many.

Published recipe (SPEC §5): AdamW lr 6e-4, no weight decay, 4 % linear warm-up then cosine to 0, grad clip 1.0,
bf16 autocast on GPUs (fp32 master weights). Only drafter parameters train: the target's embedding and LM head
are read through ``.detach()`` by the drafter and never registered as its parameters.

Reproducibility is by construction, so a resumed run repeats an uninterrupted one exactly:

* data order: one global stream of samples, epoch e shuffled by ``randperm`` seeded with ``seed + e``; a step
  takes the next ``batch × accumulation × world`` samples, so the state is just (epoch, offset);
* anchors: each micro-batch's generator is seeded from (seed, step, global micro-batch), not from a running RNG;
* the loss is normalised over the whole step, so 1 process × 8 accumulation steps and 8 processes × 1 give the
  same update (up to float summation order);
* checkpoints hold drafter weights, optimizer, scheduler, step and stream position.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pickle
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn
from tqdm.auto import tqdm

from .anchors import BlockTargets, make_block_targets, sample_anchors
from .losses import LossConfig, LossStats, compute_block_hidden, compute_loss, slot_weights
from .target_cache import collate_target_batch

logger = logging.getLogger(__name__)


class RunDirectoryError(ValueError):
    """An output directory whose checkpoints a run would overwrite, or cannot resume (exactly) from."""

LATEST_NAME = "latest"  # file in output_dir naming the newest complete checkpoint
STATE_NAME = "trainer_state.pt"
METRICS_NAME = "metrics.jsonl"
FINAL_DIR = "drafter"
SCHEDULES = ("cosine", "constant")


@dataclass
class DSparkTrainingConfig:
    """Training settings (steps count optimizer updates; a micro-batch is ``per_device_batch_size`` sequences).

    ``max_minutes`` (float, defaults to None): wall-clock budget; training stops cleanly with a checkpoint.
    ``mixed_precision`` (str, defaults to "auto"): "auto" = bf16 autocast on GPU, fp32 on CPU; or "no"/"bf16".
    ``save_total_limit`` (int, defaults to 2): checkpoints kept (oldest deleted first; the final one always kept).
    ``schedule`` (str, defaults to "cosine"): "cosine" = warm-up then cosine to 0 at ``max_steps`` (DeepSpec);
    "constant" = warm-up then the full rate, for runs that stop when their time is up rather than at a length.
    ``warmup_steps`` (int, defaults to None): warm-up length; None = ``warmup_ratio`` × ``max_steps``.
    """

    output_dir: str
    max_steps: int = 1000
    max_minutes: float | None = None
    per_device_batch_size: int = 1
    gradient_accumulation_steps: int = 8
    learning_rate: float = 6e-4
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    warmup_ratio: float = 0.04
    max_grad_norm: float = 1.0
    num_anchors: int = 64
    loss: LossConfig = field(default_factory=LossConfig)
    seed: int = 0
    save_steps: int = 500
    save_total_limit: int | None = 2
    logging_steps: int = 1
    mixed_precision: str = "auto"
    progress: bool = True
    schedule: str = "cosine"
    warmup_steps: int | None = None

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} must be one of {SCHEDULES}.")
        if isinstance(self.loss, dict):
            self.loss = LossConfig(**self.loss)
        if self.max_steps < 1:
            raise ValueError(f"max_steps={self.max_steps} must be >= 1.")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio={self.warmup_ratio} must be in [0, 1).")
        if self.mixed_precision not in ("auto", "no", "bf16", "fp16"):
            raise ValueError(f"mixed_precision={self.mixed_precision!r} must be 'auto', 'no', 'bf16' or 'fp16'.")
        if self.per_device_batch_size < 1 or self.gradient_accumulation_steps < 1:
            raise ValueError("per_device_batch_size and gradient_accumulation_steps must be >= 1.")

    @property
    def num_warmup_steps(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else int(self.warmup_ratio * self.max_steps)

    def lr_factor(self, step: int) -> float:
        if self.schedule == "constant":
            return min(1.0, (step + 1) / max(1, self.num_warmup_steps))
        return lr_factor(step, self.num_warmup_steps, self.max_steps)


def lr_factor(step: int, num_warmup: int, num_total: int) -> float:
    """Linear warm-up (step + 1) / warm-up, then cosine from 1 to 0 at ``num_total`` (DeepSpec's schedule)."""
    if step < num_warmup:
        return (step + 1) / num_warmup
    progress = (step - num_warmup) / max(1, num_total - num_warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def anchor_generator(seed: int, step: int, global_micro: int) -> torch.Generator:
    """A generator that depends only on where we are in training (stateless, so resume is exact)."""
    state = np.random.SeedSequence([seed, step, global_micro]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


class SampleStream:
    """Endless sample order: epoch e is ``randperm(n, seed + e)``; position = (epoch, offset)."""

    def __init__(self, num_samples: int, seed: int, epoch: int = 0, offset: int = 0):
        if num_samples < 1:
            raise ValueError("The training set is empty.")
        self.num_samples, self.seed, self.epoch, self.offset = num_samples, seed, epoch, offset
        self._perm = self._permutation(epoch)

    def _permutation(self, epoch: int) -> list[int]:
        return torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def take(self, count: int) -> list[int]:
        out = []
        while len(out) < count:
            if self.offset == self.num_samples:
                self.epoch, self.offset = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
            grab = min(count - len(out), self.num_samples - self.offset)
            out.extend(self._perm[self.offset:self.offset + grab])
            self.offset += grab
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}


class _TrainingStep(nn.Module):
    """Wraps the drafter so the whole differentiable computation is one ``forward`` (what DDP expects)."""

    def __init__(self, drafter: nn.Module, loss_config: LossConfig):
        super().__init__()
        self.drafter = drafter
        self.loss_config = loss_config

    def forward(self, batch: dict, targets, denominator: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = compute_block_hidden(self.drafter, batch["target_hidden_states"], batch["attention_mask"], targets,
                                      batch["input_ids"])
        out = compute_loss(self.drafter, hidden, targets, batch["target_last_hidden_states"], self.loss_config,
                           denominator=denominator, target_logsumexp=batch.get("target_logsumexp"))
        return out.loss, out.stats.to_vector()


def block_batch(samples: list[dict], drafter_config, num_anchors: int,
                generator: torch.Generator) -> tuple[dict, BlockTargets]:
    """Collate cached samples and sample their anchor blocks (CPU tensors): one training or validation batch."""
    batch = collate_target_batch(samples)
    positions, keep = sample_anchors(batch["loss_mask"], num_anchors, generator=generator)
    targets = make_block_targets(batch["input_ids"], batch["loss_mask"], positions, keep, drafter_config.block_size,
                                 drafter_config.mask_token_id)
    return batch, targets


def make_accelerator(mixed_precision: str = "auto"):
    """An ``Accelerator``; "auto" = bf16 autocast on GPU, fp32 on CPU (CPU bf16 autocast is slow on most CPUs)."""
    from accelerate import Accelerator

    use_cuda = torch.cuda.is_available()
    if mixed_precision == "auto":
        mixed_precision = "bf16" if use_cuda else "no"
    _release_single_process_state(mixed_precision)
    # cpu=True without CUDA: accelerate only sets up multi-process CPU (gloo) training under torchrun when asked
    return Accelerator(mixed_precision=mixed_precision, cpu=not use_cuda)


def _release_single_process_state(mixed_precision: str) -> None:
    """accelerate keeps one process-wide state and refuses a second Accelerator of another precision ("restart your
    runtime"). One process may well train twice (an fp32 run, then a bf16 cool-down; a test suite): with a single
    process nothing else can depend on that state, so it is released. Several processes keep accelerate's error."""
    from accelerate.state import AcceleratorState

    state = AcceleratorState._shared_state
    if not state or state.get("_mixed_precision") in (None, mixed_precision):
        return
    if state.get("num_processes", 1) > 1:
        return
    logger.debug("Releasing accelerate's %s state for a %s accelerator", state.get("_mixed_precision"),
                 mixed_precision)
    AcceleratorState._reset_state(reset_partial_state=False)


def steps_for_epochs(num_epochs: float, num_samples: int, per_device_batch_size: int,
                     gradient_accumulation_steps: int, num_processes: int = 1) -> int:
    """Optimizer steps that cover ``num_epochs`` passes over the data."""
    per_step = per_device_batch_size * gradient_accumulation_steps * num_processes
    return max(1, math.ceil(num_epochs * num_samples / per_step))


def global_batch_size(config: DSparkTrainingConfig, num_processes: int) -> int:
    """Sequences per optimizer step: per-device batch x accumulation x processes."""
    return config.per_device_batch_size * config.gradient_accumulation_steps * num_processes


def launched_for_several_processes(environ=None) -> bool:
    """Whether accelerate's simple launcher was asked for several processes: it then exports MASTER_ADDR (and its
    ACCELERATE_* settings) but, unlike torchrun / ``--multi_gpu``, starts one process and sets no WORLD_SIZE."""
    env = os.environ if environ is None else environ
    return "ACCELERATE_USE_CPU" in env and "MASTER_ADDR" in env and "WORLD_SIZE" not in env


class DSparkTrainer:
    """Trains ``drafter`` (bound to its target) on a :class:`TargetCacheDataset`.

    The target is moved to the accelerator's device (its embedding and LM head are used on every step).
    """

    def __init__(self, drafter, dataset, config: DSparkTrainingConfig, accelerator=None):
        self.config = config
        self.dataset = dataset
        self.accelerator = accelerator = accelerator or make_accelerator(config.mixed_precision)
        self.output_dir = Path(config.output_dir)
        drafter.target.to(accelerator.device)
        params = [p for p in drafter.parameters() if p.requires_grad]
        _raise_if_target_params(params, drafter.target)
        optimizer = torch.optim.AdamW(params, lr=config.learning_rate, betas=config.adam_betas, eps=config.adam_eps,
                                      weight_decay=config.weight_decay)
        self.model, self.optimizer = accelerator.prepare(_TrainingStep(drafter, config.loss), optimizer)
        # NOTE: the scheduler is not passed to prepare(): accelerate would step it once per process.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, config.lr_factor)
        self.step = 0
        self.stream = SampleStream(len(dataset), config.seed)
        self._resume_params = self._exact_resume_params()

    @property
    def drafter(self):
        return self.accelerator.unwrap_model(self.model).drafter

    def _exact_resume_params(self) -> dict:
        """What must not change for a resume to be exact (processes × accumulation may be re-split freely)."""
        c = self.config
        return {"num_samples": len(self.dataset), "seed": c.seed, "per_device_batch_size": c.per_device_batch_size,
                "micro_batches_per_step": c.gradient_accumulation_steps * self.accelerator.num_processes,
                "max_steps": c.max_steps, "num_anchors": c.num_anchors}

    # -------------------------------------------------------------------------------------------------------
    # One optimizer step
    # -------------------------------------------------------------------------------------------------------
    def _micro_batch(self, indices: list[int], global_micro: int) -> tuple[dict, BlockTargets]:
        """Collated samples and their block targets, on the CPU (moved to the device one micro-batch at a time)."""
        gen = anchor_generator(self.config.seed, self.step, global_micro)
        return block_batch([self.dataset[i] for i in indices], self.drafter.config, self.config.num_anchors, gen)

    def training_step(self) -> tuple[LossStats, dict]:
        """Accumulate gradients over the step's micro-batches, clip, update. Returns (stats, step info).

        Global micro-batch g = micro · world + rank takes samples [g·B, (g+1)·B) of the step and seeds its anchors
        with g, so a step sees the same blocks however it is split over processes and accumulation. Each loss
        term is normalised by Σ w over the whole step (all micro-batches, all ranks): micro-batch losses are
        Σ w·l / (Σ_step w / world), which DDP's gradient mean turns into exactly Σ_step w·l / Σ_step w.
        """
        c, acc = self.config, self.accelerator
        world, per, device = acc.num_processes, c.per_device_batch_size, acc.device
        indices = self.stream.take(per * world * c.gradient_accumulation_steps)
        micro_batches = []
        for micro in range(c.gradient_accumulation_steps):
            g = micro * world + acc.process_index
            micro_batches.append(self._micro_batch(indices[g * per:(g + 1) * per], g))
        weight_sum = sum(slot_weights(t.eval_mask, c.loss.decay).sum() for _, t in micro_batches).to(device)
        if world > 1:
            weight_sum = acc.reduce(weight_sum, reduction="sum")
        denominator = weight_sum.clamp(min=1e-12) / world
        stats_vec, num_tokens = None, 0
        for micro, (batch, targets) in enumerate(micro_batches):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            num_tokens += int(batch["attention_mask"].sum())
            last = micro == c.gradient_accumulation_steps - 1
            with contextlib.nullcontext() if last else acc.no_sync(self.model):
                loss, vec = self.model(batch, targets.to(device), denominator)
                acc.backward(loss)
            stats_vec = vec if stats_vec is None else stats_vec + vec
        grad_norm = acc.clip_grad_norm_(self.model.parameters(), c.max_grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        stats_vec = acc.reduce(stats_vec, reduction="sum") if world > 1 else stats_vec
        block = self.drafter.config.block_size
        info = {"lr": lr, "grad_norm": float(grad_norm), "num_tokens": num_tokens * world}
        return LossStats.from_vector(stats_vec.float().cpu(), block), info

    # -------------------------------------------------------------------------------------------------------
    # The loop
    # -------------------------------------------------------------------------------------------------------
    def train(self, resume: bool = False, stop_at_step: int | None = None) -> dict:
        """Train to ``max_steps`` (or ``stop_at_step``, or the time budget); returns the last logged metrics.

        ``resume``: continue from the newest checkpoint in ``output_dir`` (if there is none, start from scratch, so
        one command can be rerun until done). Every stop writes a checkpoint.
        """
        c, acc = self.config, self.accelerator
        checkpoint = self.latest_checkpoint(must_exist=False)
        if resume and checkpoint is not None:
            self.load_checkpoint(checkpoint)
        elif resume:
            logger.info("No checkpoint in %s: starting from scratch.", self.output_dir)
        elif checkpoint is not None:
            raise RunDirectoryError(f"{self.output_dir} already holds checkpoints: resume from them (--resume) or use "
                                    "a new output directory.")
        end = min(c.max_steps, stop_at_step or c.max_steps)
        self._log_launch()
        self._trim_metrics()
        start_time, last = time.perf_counter(), {}
        bar = tqdm(total=end, initial=self.step, desc="train", unit="step",
                   disable=not (c.progress and acc.is_main_process))
        while self.step < end:
            step_start = time.perf_counter()
            stats, info = self.training_step()
            metrics = {"step": self.step, "epoch": self.stream.epoch, "lr": info["lr"],
                       "grad_norm": info["grad_norm"], **stats.summary(c.loss),
                       "tokens_per_s": info["num_tokens"] / (time.perf_counter() - step_start),
                       "elapsed_s": time.perf_counter() - start_time}
            if self.step % c.logging_steps == 0 or self.step == end:
                self._log(metrics)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", tau=f"{metrics['tau_probabilistic']:.2f}")
            last = metrics
            out_of_time = self._out_of_time(start_time)
            if self.step % c.save_steps == 0 or self.step == end or out_of_time:
                self.save_checkpoint()
            if out_of_time:
                logger.info("Time budget of %.1f min reached at step %d; checkpoint saved.", c.max_minutes, self.step)
                break
        bar.close()
        if self.step >= c.max_steps and acc.is_main_process:
            self.drafter.save_pretrained(self.output_dir / FINAL_DIR)
        acc.wait_for_everyone()
        return last

    def _log_launch(self) -> None:
        """State the processes and the global batch: a launcher that silently started fewer processes than asked
        for trains another global batch (``accelerate launch --num_processes N`` starts ONE on a CPU host)."""
        c, acc = self.config, self.accelerator
        if not acc.is_main_process:
            return
        logger.info("Training with %d process(es) (%s on %s): global batch %d sequences per optimizer step = %d per "
                    "device x %d accumulation x %d process(es)", acc.num_processes, acc.distributed_type.value,
                    acc.device, global_batch_size(c, acc.num_processes), c.per_device_batch_size,
                    c.gradient_accumulation_steps, acc.num_processes)
        if acc.num_processes == 1 and launched_for_several_processes():
            logger.warning("This run has ONE process, but it was launched for several (accelerate's launcher set "
                           "MASTER_ADDR but no WORLD_SIZE): `accelerate launch --num_processes N` starts a single "
                           "process on a host without several GPUs. Use `accelerate launch --multi_gpu "
                           "--num_processes N ...` or `torchrun --nproc_per_node N ...` for N processes.")

    def _out_of_time(self, start_time: float) -> bool:
        if self.config.max_minutes is None:
            return False
        flag = torch.tensor(float(time.perf_counter() - start_time > 60 * self.config.max_minutes),
                            device=self.accelerator.device)
        if self.accelerator.num_processes > 1:  # every rank must stop at the same step
            flag = self.accelerator.reduce(flag, reduction="max")
        return bool(flag.item())

    def _log(self, metrics: dict) -> None:
        if not self.accelerator.is_main_process:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()}
        with (self.output_dir / METRICS_NAME).open("a") as f:
            f.write(json.dumps(clean) + "\n")

    def _trim_metrics(self) -> None:
        """Drop log lines past the resumed step: they are about to be recomputed (identically)."""
        path = self.output_dir / METRICS_NAME
        if not self.accelerator.is_main_process or not path.is_file():
            return
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        kept = [line for line in lines if json.loads(line)["step"] <= self.step]
        if len(kept) != len(lines):
            path.write_text("".join(line + "\n" for line in kept))

    # -------------------------------------------------------------------------------------------------------
    # Checkpoints
    # -------------------------------------------------------------------------------------------------------
    def latest_checkpoint(self, must_exist: bool = True) -> Path | None:
        pointer = self.output_dir / LATEST_NAME
        if pointer.is_file():
            return self.output_dir / pointer.read_text().strip()
        if must_exist:
            raise FileNotFoundError(f"No checkpoint to resume from in {self.output_dir}.")
        return None

    def save_checkpoint(self) -> Path:
        """Write checkpoint-<step>/ (drafter + trainer state), then atomically point ``latest`` at it."""
        acc = self.accelerator
        path = self.output_dir / f"checkpoint-{self.step:07d}"
        acc.wait_for_everyone()
        if acc.is_main_process:
            tmp = path.with_name(path.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            self.drafter.save_pretrained(tmp)
            torch.save({"step": self.step, "stream": self.stream.state_dict(),
                        "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                        "params": self._resume_params, "config": _jsonable(asdict(self.config)),
                        "torch_rng": torch.get_rng_state()}, tmp / STATE_NAME)
            shutil.rmtree(path, ignore_errors=True)
            os.replace(tmp, path)
            pointer = self.output_dir / (LATEST_NAME + ".tmp")
            pointer.write_text(path.name)
            os.replace(pointer, self.output_dir / LATEST_NAME)
            self._prune_checkpoints(keep=path)
        acc.wait_for_everyone()
        return path

    def _prune_checkpoints(self, keep: Path) -> None:
        limit = self.config.save_total_limit
        if not limit:
            return
        checkpoints = sorted(p for p in self.output_dir.glob("checkpoint-*") if p.is_dir() and p.suffix != ".tmp")
        for old in [p for p in checkpoints if p != keep][: max(0, len(checkpoints) - limit)]:
            shutil.rmtree(old, ignore_errors=True)

    def load_checkpoint(self, path: str | os.PathLike, exact: bool = True) -> None:
        """Restore weights, optimizer, scheduler and step from a checkpoint. ``exact=False`` (a continuous run whose
        data grew since): the settings may differ and the sample stream starts a fresh epoch over today's data."""
        path = Path(path)
        state, weights = _read_checkpoint(path)
        changed = {k: (v, self._resume_params.get(k)) for k, v in state["params"].items()
                   if self._resume_params.get(k) != v}
        if changed and exact:
            raise RunDirectoryError(f"Cannot resume exactly from {path}: settings changed since it was written "
                                    f"({', '.join(f'{k}: {a} -> {b}' for k, (a, b) in changed.items())}).")
        self.drafter.load_state_dict(weights, strict=True)  # copies onto the device
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        if exact:
            self.stream = SampleStream(len(self.dataset), self.config.seed, **state["stream"])
        else:
            self.replace_dataset(self.dataset)
        logger.info("Resumed from %s at step %d", path, self.step)

    def replace_dataset(self, dataset) -> None:
        """Train on ``dataset`` from the next step on (a continuous run picks up data written since it started):
        a fresh shuffled epoch, seeded by the step, so the order still depends only on where training is."""
        self.dataset = dataset
        self.stream = SampleStream(len(dataset), self.config.seed + self.step)
        self._resume_params = self._exact_resume_params()


def _read_checkpoint(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A checkpoint's trainer state and weights (on the CPU). Missing or damaged files (a copy cut short, a full
    disk) raise :class:`RunDirectoryError` naming the checkpoint and the way out: torch's "failed finding central
    directory" and safetensors' header errors named neither."""
    try:
        return load_trainer_state(path / STATE_NAME), load_file(path / "model.safetensors")
    except (OSError, EOFError, RuntimeError, SafetensorError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise RunDirectoryError(f"Cannot resume from {path}: it is missing or damaged ({reason}). Put the name of an "
                                f"earlier checkpoint-* folder in {path.parent / LATEST_NAME}, or start in a new "
                                "output directory.") from None


def load_trainer_state(path: str | os.PathLike) -> dict:
    """The trainer state of a checkpoint, unpickled with ``weights_only=True``: it holds only tensors, numbers,
    strings and containers, so anything else in the file (code a tampered run folder would execute) is refused."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(f"Refusing to resume from {path}: it holds objects other than tensors, numbers and "
                         "containers, which a trainer state never does (the file may have been tampered with). "
                         f"Resume from a checkpoint written by DSparkTrainer. Details: {err}") from None


def _raise_if_target_params(params: list[nn.Parameter], target: nn.Module) -> None:
    target_ids = {id(p) for p in target.parameters()}
    if any(id(p) in target_ids for p in params):
        raise RuntimeError("Target parameters found among the drafter's trainable parameters: the target must stay "
                           "frozen (the drafter reads its embedding / LM head through detach()).")


def _jsonable(value):
    return json.loads(json.dumps(value, default=str))


@torch.no_grad()
def evaluate_on_cache(drafter, dataset, num_anchors: int = 64, batch_size: int = 4, seed: int = 0,
                      loss_config: LossConfig | None = None) -> dict[str, float]:
    """The training metrics (loss terms, accept_rate@k, τ_probabilistic) of ``drafter`` on a held-out cache.

    Why: the training-time τ is measured on the blocks being fitted; on a small CPU data set the drafter can
    overfit, and only held-out conversations show when more epochs stop helping (choose the checkpoint here,
    never on the evaluation benchmarks). Anchors are drawn with fixed seeds, so checkpoints see the same blocks.
    """
    cfg = drafter.config
    loss_config = loss_config or LossConfig.for_head(cfg.sequential_head)
    step = _TrainingStep(drafter, loss_config)
    device = next(drafter.parameters()).device
    was_training = drafter.training
    drafter.eval()
    total = LossStats.zeros(cfg.block_size)
    for start in range(0, len(dataset), batch_size):
        samples = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        batch, targets = block_batch(samples, cfg, num_anchors, anchor_generator(seed, 0, start))
        _, stats = step({k: v.to(device) for k, v in batch.items()}, targets.to(device), None)
        total = total + LossStats.from_vector(stats.cpu(), cfg.block_size)
    drafter.train(was_training)
    return total.summary(loss_config)
