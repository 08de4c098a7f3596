"""``hf-dspark regenerate``, ``cache`` and ``train``: the training data, the target cache and the drafter.

``scripts/regenerate.py`` and ``scripts/train_drafter.py`` call these commands; the work is in
``training.training_set`` and ``training.recipe``.
"""

from __future__ import annotations

import argparse

from .arguments import (existing_file, fraction, non_negative_float, non_negative_int, output_folder, positive_float,
                        positive_int, probability)

DEFAULT_CACHE = "cache/smollm2"
HEADS = ["markov", "gated", "rnn", "none", "eagle3"]


def _device_default() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# -------------------------------------------------------------------------------------------------------
# regenerate
# -------------------------------------------------------------------------------------------------------
def add_regenerate(sub) -> None:
    p = sub.add_parser("regenerate", allow_abbrev=False,
                       help="Answer prompts with the target itself: a drafter's training data.",
                       description="Prompts from your files, templates, the target itself (Magpie) and real sources, "
                                   "de-duplicated and refused if they overlap the evaluation benchmarks, answered by "
                                   "the target (or an OpenAI-compatible server). Resumable: rerun to continue.")
    p.add_argument("--out", type=output_folder, default="data/smollm2",
                   help="folder for the prompt files and train.jsonl")
    p.add_argument("--target", default=None, help="target model directory or Hub id (default: embedded SmolLM2)")
    p.add_argument("--prompts", nargs="*", type=existing_file, default=[],
                   help="your prompt files (jsonl: turns / conversations / messages)")
    p.add_argument("--eval-dir", default=None, help="evaluation prompts that must not be trained on (default: "
                                                     "$HF_DSPARK_EVAL_DIR, else ../shared/eval_datasets)")
    p.add_argument("--sources", nargs="*", default=[], choices=["gsm8k", "code", "requests"],
                   help="more prompts: gsm8k = the GSM8K train questions (--gsm8k-file), code = requests written "
                        "from the standard library's functions and classes (prompt_sources.py), requests = "
                        "well-formed chat requests composed from frames and slot lists (chat_requests.py)")
    p.add_argument("--gsm8k-file", default="../shared/train_data/gsm8k_train.jsonl")
    p.add_argument("--num-requests", type=non_negative_int, default=4000,
                   help="with --sources requests: how many chat requests")
    p.add_argument("--num-template", type=non_negative_int, default=6000)
    p.add_argument("--num-magpie", type=non_negative_int, default=1500)
    p.add_argument("--magpie-max-new-tokens", type=positive_int, default=64,
                   help="length cap of a synthesised request (longer ones are dropped as rambling)")
    p.add_argument("--backend", choices=["generate", "engine"], default="generate",
                   help="answer with batched target.generate, or with the continuous-batching DSparkEngine (a "
                        "finished answer frees its row at once; with --engine-policy scheduled it also drafts by "
                        "lookup, which answers that repeat themselves accept)")
    p.add_argument("--engine-policy", default="scheduled", choices=["none", "scheduled"],
                   help="with --backend engine: 'scheduled' verifies lookup drafts copied from each answer's own "
                        "context (lossless: the answers keep the target's distribution), 'none' decodes plainly")
    p.add_argument("--endpoint", default=None,
                   help="answer through an OpenAI-compatible server instead (e.g. http://localhost:8000); the local "
                        "target then only tokenises and writes Magpie prompts")
    p.add_argument("--model-name", default=None, help="with --endpoint: the served model's name (default: --target)")
    p.add_argument("--api-key", default="EMPTY")
    p.add_argument("--batch-size", type=positive_int, default=24,
                   help="generate: prompts per batch; engine: requests decoding at once")
    p.add_argument("--max-new-tokens", type=positive_int, default=384)
    p.add_argument("--temperature", type=non_negative_float, default=0.2,
                   help="the target's recommended sampling (SmolLM2: 0.2, top-p 0.9); 0 = greedy")
    p.add_argument("--top-p", type=probability, default=0.9)
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_regenerate, default_log_level="info", parser=p)


def cmd_regenerate(args: argparse.Namespace) -> int:
    import torch

    from ..evaluation.benchmarks import default_eval_dir
    from ..loading import load_target, raise_if_bad_paths
    from ..training.regenerate import SamplingSettings
    from ..training.training_set import TrainingSetRecipe, regenerate_training_set

    if args.endpoint and args.backend != "generate":
        args.parser.error("--endpoint answers on the server; --backend applies to local answering only")
    if args.endpoint and not (args.model_name or args.target):
        args.parser.error("--endpoint needs --model-name (or --target) to name the served model")
    raise_if_bad_paths(args.target)
    torch.set_num_threads(args.threads)
    needs_model = args.num_magpie or not args.endpoint
    model, tokenizer = load_target(args.target) if needs_model else (None, None)
    recipe = TrainingSetRecipe(
        prompt_files=args.prompts, num_template=args.num_template, num_magpie=args.num_magpie,
        magpie_max_new_tokens=args.magpie_max_new_tokens, sources=args.sources, gsm8k_file=args.gsm8k_file,
        num_requests=args.num_requests, seed=args.seed,
        sampling=SamplingSettings(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens))
    engine = None
    if args.backend == "engine" and not args.endpoint:
        from ..serving import DSparkEngine

        engine = DSparkEngine(model, policy=args.engine_policy, max_running_requests=args.batch_size,
                              tokenizer=tokenizer, max_batch_tokens=args.batch_size * 1024)
    regenerate_training_set(model, tokenizer, args.out, recipe, args.eval_dir or default_eval_dir(),
                            backend=args.backend, batch_size=args.batch_size, endpoint=args.endpoint,
                            model_name=args.model_name or args.target, api_key=args.api_key, engine=engine)
    return 0


def _refuse_draft_vocab_beyond_target(args: argparse.Namespace, target) -> None:
    """--draft-vocab-size checked against the loaded target: one larger than the target's vocabulary raised a
    ValueError traceback, and with --data only after every conversation had been cached."""
    vocab_size = target.config.get_text_config().vocab_size
    if args.draft_vocab_size > vocab_size:
        args.parser.error(f"argument --draft-vocab-size: must be at most the target's vocabulary of {vocab_size} "
                          f"tokens, got {args.draft_vocab_size}")


# -------------------------------------------------------------------------------------------------------
# cache
# -------------------------------------------------------------------------------------------------------
def _add_cache_options(p, *, full: bool) -> None:
    p.add_argument("--layers", type=non_negative_int, nargs="+", default=None,
                   help="0-based target layers to tap (default: DSparkConfig's spread of 5)")
    if not full:
        return
    from ..training.target_cache import MIN_LOSS_TOKENS, STORAGE_DTYPES

    p.add_argument("--max-length", type=positive_int, default=1024)
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(STORAGE_DTYPES), help="storage dtype")
    p.add_argument("--min-loss-tokens", type=non_negative_int, default=MIN_LOSS_TOKENS)
    p.add_argument("--shard-size-mb", type=positive_int, default=512)
    p.add_argument("--limit", type=positive_int, default=None, help="use only the first N records (smoke tests)")
    p.add_argument("--logsumexp", action="store_true",
                   help="also store the target's per-token log-normaliser (reduced-vocabulary training)")
    p.add_argument("--device", default=None, help="where the target runs (default: cuda if available, else cpu)")


def add_cache(sub) -> None:
    p = sub.add_parser("cache", allow_abbrev=False,
                       help="Build (or extend) a target cache: tapped-layer outputs of regenerated conversations.",
                       description="Runs the target once over each conversation and stores its tapped layers and "
                                   "final hidden states. Resumable: conversations already cached are skipped.")
    p.add_argument("--data", nargs="+", type=existing_file, required=True,
                   help="jsonl files of {'id', 'messages': [...]} records")
    p.add_argument("--out", type=output_folder, required=True,
                   help="cache directory (created, or extended when it exists)")
    p.add_argument("--target", default=None, help="target model path / id (default: embedded SmolLM2)")
    _add_cache_options(p, full=True)
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.set_defaults(func=cmd_cache, default_log_level="info")


def cmd_cache(args: argparse.Namespace) -> int:
    import torch

    from ..loading import load_target, raise_if_bad_paths
    from ..training.recipe import CacheRecipe, cache_conversations

    raise_if_bad_paths(args.target)
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target, device=args.device or _device_default())
    recipe = CacheRecipe(layers=args.layers, max_length=args.max_length, batch_size=args.batch_size,
                         dtype=args.dtype, min_loss_tokens=args.min_loss_tokens, shard_size_mb=args.shard_size_mb,
                         limit=args.limit, logsumexp=args.logsumexp)
    cache_conversations(target, tokenizer, args.data, args.out, recipe)
    return 0


# -------------------------------------------------------------------------------------------------------
# train
# -------------------------------------------------------------------------------------------------------
def add_train(sub) -> None:
    p = sub.add_parser("train", allow_abbrev=False,
                       help="Train a drafter on a target cache (built first from --data when given).",
                       description="Trains a DSpark (or DFlash: --head none, or Eagle3-style: --head eagle3) drafter "
                                   "on accelerate (one CPU, one GPU, or `accelerate launch` on many). Stops at --steps "
                                   "(or --epochs), or cleanly at --max-minutes with a checkpoint; --resume continues "
                                   "exactly. The drafter is written to <out>/drafter.")
    p.add_argument("--data", nargs="+", type=existing_file, default=None,
                   help="conversation jsonl file(s) to cache first")
    p.add_argument("--cache", type=output_folder, default=DEFAULT_CACHE,
                   help="target cache directory (default: %(default)s)")
    p.add_argument("--out", type=output_folder, default="runs/smollm2-dspark",
                   help="run directory: checkpoints, metrics.jsonl, drafter/")
    p.add_argument("--target", default=None, help="target model path / id (default: embedded SmolLM2)")
    _add_cache_options(p.add_argument_group("cache (with --data)"), full=False)
    model = p.add_argument_group("drafter")
    model.add_argument("--head", default="markov", choices=HEADS,
                       help="sequential head of a DSpark drafter, 'none' for DFlash, or 'eagle3' for the "
                            "autoregressive Eagle3-style baseline (one layer; CE loss like DFlash)")
    model.add_argument("--num-layers", type=positive_int, default=1)
    model.add_argument("--block-size", type=positive_int, default=7)
    model.add_argument("--markov-rank", type=positive_int, default=128,
                       help="rank of W1/W2 (128 keeps a SmolLM2 drafter under 40 MB in bf16)")
    model.add_argument("--init-from", default=None,
                       help="start from this trained drafter's weights (and its architecture / draft vocabulary) "
                            "with a fresh schedule, e.g. to continue a finished run on more data")
    model.add_argument("--grow-to-layers", type=positive_int, default=None,
                       help="with --init-from: deepen the loaded drafter to this many layers; the new layers start "
                            "as zero-output copies of its last layer, so training resumes from what it proposes")
    model.add_argument("--draft-vocab-size", type=positive_int, default=None,
                       help="propose only the N most frequent answer tokens of the cache (default: full vocabulary)")
    length = p.add_argument_group("length (--steps or --epochs sets the schedule; --max-minutes only stops early)")
    length.add_argument("--steps", type=positive_int, default=None)
    length.add_argument("--epochs", type=positive_float, default=None)
    length.add_argument("--max-minutes", type=positive_float, default=None)
    opt = p.add_argument_group("optimisation")
    opt.add_argument("--batch-size", type=positive_int, default=1, help="sequences per device per micro-batch")
    opt.add_argument("--grad-accum", type=positive_int, default=8)
    opt.add_argument("--lr", type=non_negative_float, default=6e-4,
                     help="peak learning rate (0 keeps the starting weights: a check of --init-from)")
    opt.add_argument("--warmup-ratio", type=fraction, default=0.04,
                     help="share of the steps whose learning rate ramps up, in [0, 1)")
    opt.add_argument("--max-grad-norm", type=positive_float, default=1.0)
    opt.add_argument("--num-anchors", type=positive_int, default=64,
                     help="blocks per sequence (published: 512, on GPUs)")
    opt.add_argument("--decay", type=positive_float, default=4.0, help="slot weight w_k = exp(-k / decay)")
    opt.add_argument("--ce-weight", type=non_negative_float, default=None, help="default 0.1 (DFlash: 1.0)")
    opt.add_argument("--l1-weight", type=non_negative_float, default=None, help="default 0.9 (DFlash: 0)")
    opt.add_argument("--confidence-weight", type=non_negative_float, default=None, help="default 1.0 (DFlash: 0)")
    opt.add_argument("--chunk-blocks", type=positive_int, default=256,
                     help="blocks whose full-vocab logits exist at once")
    opt.add_argument("--mixed-precision", default="auto", choices=["auto", "no", "bf16", "fp16"])
    run = p.add_argument_group("run")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--save-steps", type=positive_int, default=500)
    run.add_argument("--save-total-limit", type=non_negative_int, default=2,
                     help="checkpoints kept, oldest deleted first (0: keep every one)")
    run.add_argument("--resume", action="store_true",
                     help="continue from the newest checkpoint in --out (start fresh if none)")
    run.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    run.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_train, default_log_level="info", parser=p)


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    from ..loading import load_drafter, load_target, raise_if_bad_paths
    from ..training.recipe import CacheRecipe, DrafterRecipe, TrainingRecipe, cache_conversations, train_drafter

    if args.grow_to_layers and not args.init_from:
        args.parser.error("--grow-to-layers deepens a trained drafter: give --init-from (or --num-layers for a new "
                          "one)")
    if (args.steps is None) == (args.epochs is None):
        args.parser.error("give exactly one of --steps or --epochs (the LR schedule needs a length; --max-minutes "
                          "only stops early)")
    raise_if_bad_paths(args.target, [args.init_from])
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target, device=_device_default() if args.data else None)
    if args.draft_vocab_size and not args.init_from:  # a continued drafter keeps its own vocabulary
        _refuse_draft_vocab_beyond_target(args, target)
    if args.init_from:  # a drafter of another target, or one deeper than --grow-to-layers: before the cache is built
        layers = load_drafter(args.init_from, target).model.config.num_hidden_layers
        if args.grow_to_layers and args.grow_to_layers < layers:
            args.parser.error(f"argument --grow-to-layers: the drafter {args.init_from} already has {layers} layers "
                              f"(a drafter grows, it is not cut), got {args.grow_to_layers}")
    if args.data:
        cache_conversations(target, tokenizer, args.data, args.cache, CacheRecipe(layers=args.layers))
    drafter = DrafterRecipe(head=args.head, num_layers=args.num_layers, block_size=args.block_size,
                            markov_rank=args.markov_rank, init_from=args.init_from,
                            grow_to_layers=args.grow_to_layers, draft_vocab_size=args.draft_vocab_size)
    training = TrainingRecipe(
        steps=args.steps, epochs=args.epochs, max_minutes=args.max_minutes, batch_size=args.batch_size,
        grad_accum=args.grad_accum, lr=args.lr, warmup_ratio=args.warmup_ratio, max_grad_norm=args.max_grad_norm,
        num_anchors=args.num_anchors, decay=args.decay, ce_weight=args.ce_weight, l1_weight=args.l1_weight,
        confidence_weight=args.confidence_weight, chunk_blocks=args.chunk_blocks,
        mixed_precision=args.mixed_precision, seed=args.seed, save_steps=args.save_steps,
        save_total_limit=args.save_total_limit, progress=not args.no_progress)
    train_drafter(target, args.cache, args.out, drafter, training, resume=args.resume)
    return 0
