"""``hf-dspark convert`` and ``hf-dspark push``: a drafter in another format, or on the Hub with its model card."""

from __future__ import annotations

import argparse

from .arguments import new_folder


def add_convert(sub) -> None:
    p = sub.add_parser("convert", allow_abbrev=False,
                       help="Convert a drafter: to speculators (vLLM) or to hf-dspark's native format.",
                       description="Reads any format hf-dspark loads (native, DeepSpec, speculators, SpecForge / "
                                   "z-lab, transformers' DFlash assistants) and writes --to. Exports that vLLM would "
                                   "misread are refused with the reason.")
    p.add_argument("src", help="drafter directory or Hub id")
    p.add_argument("dst", nargs="?", type=new_folder, default=None,
                   help="output directory, new or empty (not with --check)")
    p.add_argument("--check", action="store_true", help="only report what SRC is: dialect, architecture, heads, "
                                                        "vocabulary, taps, block convention, what loads / exports "
                                                        "and what is refused and why (exit 1 when refused; 2, with "
                                                        "one line, when SRC is not a model directory)")
    p.add_argument("--to", default="speculators", choices=["speculators", "native"])
    p.add_argument("--target", default=None,
                   help="target directory or Hub id (HuggingFaceTB/SmolLM2-135M-Instruct: the embedded copy, offline): "
                        "needed for reduced-vocabulary exports, transformers' DFlash assistants and sources that do "
                        "not record the target's layer count")
    p.add_argument("--verifier", default=None, help="verifier vLLM pairs the drafter with (required unless the drafter "
                                                    "records its target or --target names one)")
    p.add_argument("--include-target-weights", action="store_true", help="also store the target's embedding/LM head")
    p.add_argument("--no-vllm-check", action="store_true", help="allow heads only speculators (not vLLM) implements")
    p.set_defaults(func=cmd_convert)


def cmd_convert(args: argparse.Namespace) -> int:
    from ..hub import convert_checkpoint, describe_checkpoint
    from ..loading import NAMED_TARGET_FIX, load_named_target, raise_if_bad_paths

    # a path mistake is exit 2 and one line, with --check too
    raise_if_bad_paths(args.target, [args.src], target_fix=NAMED_TARGET_FIX)
    target = load_named_target(args.target) if args.target else None
    if args.check:  # report only: what SRC is, what loads, exports and is refused
        report = describe_checkpoint(args.src, target=target)
        print(report)
        return 0 if report.loads else 1
    if args.dst is None:
        raise FileNotFoundError("the output directory DST is required (or use --check SRC)")
    options = ({"verifier_name_or_path": args.verifier, "include_target_weights": args.include_target_weights,
                "vllm_servable": not args.no_vllm_check} if args.to == "speculators" else {})
    out = convert_checkpoint(args.src, args.dst, to=args.to, target=target, **options)
    print(f"Wrote a {args.to}-format drafter to {out}")
    return 0


def add_push(sub) -> None:
    p = sub.add_parser("push", allow_abbrev=False,
                       help="Upload a drafter with a generated model card to the Hugging Face Hub.",
                       description="Uploads config.json, model.safetensors and a README.md generated from the "
                                   "model-card template shipped in the package. Use --dry-run DIR to see exactly "
                                   "what would be sent.")
    p.add_argument("src", help="drafter directory")
    p.add_argument("repo_id", help="org/name on the Hub")
    p.add_argument("--eval-results", default=None, help="JSON of benchmark -> {tau, speedup, ...} (the τ table)")
    p.add_argument("--calibration", default=None, help="JSON of per-position calibration records")
    p.add_argument("--train-cache", default=None, help="target cache used for training (its manifest)")
    p.add_argument("--train-run", default=None, help="training run directory (its metrics.jsonl)")
    p.add_argument("--train-data", default=None, help="one line describing the training data")
    p.add_argument("--license", default=None)
    p.add_argument("--datasets", nargs="+", default=None, help="Hub dataset ids used for training")
    p.add_argument("--tags", nargs="+", default=None, help="extra tags")
    p.add_argument("--template", default=None,
                   help="Jinja2 card template (default: $HF_DSPARK_CARD_TEMPLATE, else the packaged drafter_card.md)")
    p.add_argument("--private", action="store_true", default=None)
    p.add_argument("--token", default=None)
    p.add_argument("--revision", default=None)
    p.add_argument("--create-pr", action="store_true")
    p.add_argument("--commit-message", default=None)
    p.add_argument("--dry-run", metavar="DIR", type=new_folder, default=None,
                   help="write the upload to DIR (new or empty) instead of pushing")
    p.set_defaults(func=cmd_push)


def cmd_push(args: argparse.Namespace) -> int:
    from ..hub import DraftCardInfo, push_to_hub, read_calibration, read_evaluation, save_for_hub, summarize_training
    from ..modeling import DSparkDraftModel

    draft = DSparkDraftModel.from_pretrained(args.src)
    info = DraftCardInfo(
        training=summarize_training(args.train_cache, args.train_run, args.train_data),
        evaluation=read_evaluation(args.eval_results) if args.eval_results else {},
        calibration=read_calibration(args.calibration) if args.calibration else [],
        license=args.license, datasets=args.datasets or [])
    if args.dry_run:
        out = save_for_hub(draft, args.dry_run, info=info, repo_id=args.repo_id, tags=args.tags, template=args.template)
        print(f"Dry run: wrote what would be uploaded to {out}")
        return 0
    commit = push_to_hub(draft, args.repo_id, info=info, private=args.private, token=args.token,
                         revision=args.revision, create_pr=args.create_pr, commit_message=args.commit_message,
                         tags=args.tags, template=args.template)
    print(f"Uploaded to {args.repo_id}: {commit}")
    return 0
