"""Train a DSpark (or DFlash: --head none) drafter on a target cache built by scripts/build_target_cache.py.

The same command runs on one CPU, one GPU, or several processes (GPUs, CPU processes, nodes).
Stops at --steps (or --epochs), or cleanly at --max-minutes with a checkpoint; --resume continues exactly.
The finished drafter is written to <out>/drafter (fp32; the target's embedding / LM head are never saved).
The log states the number of processes and the global batch (batch x grad-accum x processes) at start.

    python scripts/train_drafter.py --cache cache/smollm2 --out runs/dspark --steps 2000 --max-minutes 600
    python scripts/train_drafter.py --cache cache/smollm2 --out runs/dspark --steps 2000 --resume

Several processes. On a host with several GPUs accelerate turns --num_processes N into N processes by itself:

    accelerate launch --num_processes 8 scripts/train_drafter.py --cache cache/x --out runs/x --epochs 10 \\
        --batch-size 4 --grad-accum 16 --num-anchors 512 --num-layers 5

On a CPU-only host plain `accelerate launch --num_processes N` starts ONE process (accelerate's simple launcher;
the log then warns). These start N processes there (gloo), and on multi-GPU hosts too:

    accelerate launch --multi_gpu --num_processes 2 scripts/train_drafter.py --cache cache/x --out runs/x ...
    torchrun --nproc_per_node 2 scripts/train_drafter.py --cache cache/x --out runs/x ...
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from hf_dspark import DSparkDraftModel, Eagle3DraftModel
from hf_dspark.training.draft_vocabulary import count_answer_tokens, coverage, most_frequent_tokens
from hf_dspark.training.losses import LossConfig
from hf_dspark.training.target_cache import TargetCacheDataset, validate_manifest, write_target_logsumexp
from hf_dspark.training.trainer import DSparkTrainer, DSparkTrainingConfig, make_accelerator, steps_for_epochs
from hf_dspark.embedded import load_target

logger = logging.getLogger("train_drafter")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", required=True, help="target cache directory")
    p.add_argument("--out", required=True, help="run directory: checkpoints, metrics.jsonl, drafter/")
    p.add_argument("--target", default=None, help="target model path / id (default: embedded SmolLM2)")
    model = p.add_argument_group("drafter")
    model.add_argument("--head", default="markov", choices=["markov", "gated", "rnn", "none", "eagle3"],
                       help="sequential head of a DSpark drafter, 'none' for DFlash, or 'eagle3' for the "
                            "autoregressive Eagle3-style baseline (one layer; CE loss like DFlash)")
    model.add_argument("--num-layers", type=int, default=1)
    model.add_argument("--block-size", type=int, default=7)
    model.add_argument("--markov-rank", type=int, default=128,
                       help="rank of W1/W2 (128 keeps a SmolLM2 drafter under 40 MB in bf16)")
    model.add_argument("--init-from", default=None,
                       help="start from this trained drafter's weights (and its architecture / draft vocabulary) "
                            "with a fresh schedule, e.g. to continue a finished run on more data")
    model.add_argument("--grow-to-layers", type=int, default=None,
                       help="with --init-from: deepen the loaded drafter to this many layers; the new layers start "
                            "as zero-output copies of its last layer, so training resumes from what it proposes")
    model.add_argument("--draft-vocab-size", type=int, default=None,
                       help="propose only the N most frequent answer tokens of the cache (default: full vocabulary)")
    length = p.add_argument_group("length (--steps or --epochs sets the schedule; --max-minutes only stops early)")
    length.add_argument("--steps", type=int, default=None)
    length.add_argument("--epochs", type=float, default=None)
    length.add_argument("--max-minutes", type=float, default=None)
    opt = p.add_argument_group("optimisation")
    opt.add_argument("--batch-size", type=int, default=1, help="sequences per device per micro-batch")
    opt.add_argument("--grad-accum", type=int, default=8)
    opt.add_argument("--lr", type=float, default=6e-4)
    opt.add_argument("--warmup-ratio", type=float, default=0.04)
    opt.add_argument("--max-grad-norm", type=float, default=1.0)
    opt.add_argument("--num-anchors", type=int, default=64, help="blocks per sequence (published: 512, on GPUs)")
    opt.add_argument("--decay", type=float, default=4.0, help="slot weight w_k = exp(-k / decay)")
    opt.add_argument("--ce-weight", type=float, default=None, help="default 0.1 (DFlash: 1.0)")
    opt.add_argument("--l1-weight", type=float, default=None, help="default 0.9 (DFlash: 0)")
    opt.add_argument("--confidence-weight", type=float, default=None, help="default 1.0 (DFlash: 0)")
    opt.add_argument("--chunk-blocks", type=int, default=256, help="blocks whose full-vocab logits exist at once")
    opt.add_argument("--mixed-precision", default="auto", choices=["auto", "no", "bf16", "fp16"])
    run = p.add_argument_group("run")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--save-steps", type=int, default=500)
    run.add_argument("--save-total-limit", type=int, default=2)
    run.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out (start fresh if none)")
    run.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    run.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.grow_to_layers and not args.init_from:
        p.error("--grow-to-layers deepens a trained drafter: give --init-from (or --num-layers for a new one)")
    if (args.steps is None) == (args.epochs is None):
        p.error("give exactly one of --steps or --epochs (the LR schedule needs a length; --max-minutes only "
                "stops early)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    accelerator = make_accelerator(args.mixed_precision)
    dataset = TargetCacheDataset(args.cache)
    target, _ = load_target(args.target)
    draft_vocab = None
    if args.draft_vocab_size and not args.init_from:
        vocab = target.config.get_text_config().vocab_size
        counts = count_answer_tokens(args.cache, vocab)
        eos = target.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        draft_vocab = most_frequent_tokens(counts, args.draft_vocab_size, always_include=eos)
        logger.info("Draft vocabulary: %d of %d tokens, covering %.2f%% of the cached answer tokens "
                    "(%d distinct tokens occur)", len(draft_vocab), vocab, 100 * coverage(counts, draft_vocab),
                    int((counts > 0).sum()))
    torch.manual_seed(args.seed)  # the drafter's initialisation
    if args.init_from:
        param_dtype = next(target.parameters()).dtype
        drafter = DSparkDraftModel.from_pretrained(args.init_from, target=target).to(param_dtype)
        draft_vocab = drafter.draft_to_target
        args.head = "eagle3" if drafter.config.drafter_architecture == "eagle3" else drafter.config.sequential_head
        if args.grow_to_layers:
            logger.info("Growing the drafter from %d to %d layer(s)", drafter.config.num_hidden_layers,
                        args.grow_to_layers)
            drafter.grow_layers(args.grow_to_layers)
        logger.info("Initialised from %s (%s head, %d layer(s), draft vocabulary %s); architecture options ignored",
                    args.init_from, args.head, drafter.config.num_hidden_layers,
                    drafter.config.draft_vocab_size or "full")
    elif args.head == "eagle3":
        drafter = Eagle3DraftModel.from_target(target, block_size=args.block_size,
                                               target_layer_ids=dataset.manifest["target_layer_ids"],
                                               draft_vocab=draft_vocab)
    else:
        drafter = DSparkDraftModel.from_target(target, num_layers=args.num_layers, block_size=args.block_size,
                                               head=args.head, markov_rank=args.markov_rank,
                                               target_layer_ids=dataset.manifest["target_layer_ids"],
                                               draft_vocab=draft_vocab)
    validate_manifest(dataset.manifest, drafter.config)
    if draft_vocab is not None and not dataset.has_logsumexp:
        # the reduced-vocabulary loss reads the target's log-normaliser from disk instead of a full-vocab product
        if accelerator.is_main_process:
            write_target_logsumexp(args.cache, drafter.compute_logits, target.get_output_embeddings().weight.dtype,
                                   progress=not args.no_progress)
        accelerator.wait_for_everyone()
        dataset = TargetCacheDataset(args.cache)
    overrides = {k: v for k, v in (("ce_weight", args.ce_weight), ("l1_weight", args.l1_weight),
                                   ("confidence_weight", args.confidence_weight)) if v is not None}
    loss = LossConfig.for_head(args.head, decay=args.decay, chunk_blocks=args.chunk_blocks, **overrides)
    steps = args.steps or steps_for_epochs(args.epochs, len(dataset), args.batch_size, args.grad_accum,
                                           accelerator.num_processes)
    config = DSparkTrainingConfig(
        output_dir=args.out, max_steps=steps, max_minutes=args.max_minutes, per_device_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr, warmup_ratio=args.warmup_ratio,
        max_grad_norm=args.max_grad_norm, num_anchors=args.num_anchors, loss=loss, seed=args.seed,
        save_steps=args.save_steps, save_total_limit=args.save_total_limit, mixed_precision=args.mixed_precision,
        progress=not args.no_progress)
    num_params = sum(p.numel() for p in drafter.parameters())
    logger.info("Drafter: %s head, %d layer(s), block %d, %.1fM trainable parameters; %d samples, %d steps",
                args.head, drafter.config.num_hidden_layers, drafter.config.block_size, num_params / 1e6, len(dataset), steps)
    trainer = DSparkTrainer(drafter, dataset, config, accelerator=accelerator)
    last = trainer.train(resume=args.resume)
    if last and accelerator.is_main_process:
        logger.info("Stopped at step %d/%d: loss %.4f, tau_probabilistic %.3f", trainer.step, steps, last["loss"],
                    last["tau_probabilistic"])
    if trainer.step >= steps and accelerator.is_main_process:
        logger.info("Drafter written to %s", Path(args.out) / "drafter")


if __name__ == "__main__":
    main()
