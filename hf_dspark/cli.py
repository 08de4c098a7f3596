"""``hf-dspark``: argument parsing and dispatch to the library and the repository's scripts; no logic of its own.

    hf-dspark generate [--prompt TEXT]                    chat (streaming) with the embedded target, tok/s and τ
    hf-dspark train --data data/smollm2/train.jsonl --steps 2000    build the target cache, then train a drafter
    hf-dspark convert SRC DST --to speculators|native     export for vLLM, or import any published layout
    hf-dspark convert --check SRC                         report what SRC is and what loads / exports / is refused
    hf-dspark push SRC org/name [--eval-results eval.json]            upload with a generated model card
    hf-dspark regenerate | bench | eval | calibrate | serve-bench ...  run the matching scripts/*.py (options passed
                                                          through)

Commands backed by scripts (regenerate, bench, train, eval, calibrate, serve-bench) need the repository checkout, where
``scripts/`` lives next to the package; their options are the scripts' own (``hf-dspark eval --help``).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("hf_dspark.cli")

SCRIPTS_DIR = Path(__file__).resolve().parent.parent / "scripts"
# Sub-command -> (script in scripts/, one-line description); their options are passed through unchanged.
SCRIPT_COMMANDS = {
    "regenerate": ("regenerate", "Answer prompts with the target itself: the training data (scripts/regenerate.py)."),
    "bench": ("bench_generate", "Benchmark generate with and without the drafter (scripts/bench_generate.py)."),
    "eval": ("eval_drafter", "Measure τ and speedup per benchmark (scripts/eval_drafter.py)."),
    "calibrate": ("calibrate_drafter", "Fit STS temperatures of the confidence head (scripts/calibrate_drafter.py)."),
    "serve-bench": ("bench_serving", "Benchmark the continuous-batching engine (scripts/bench_serving.py)."),
}


# -------------------------------------------------------------------------------------------------------
# Running the repository's scripts
# -------------------------------------------------------------------------------------------------------
def script_path(name: str) -> Path:
    return SCRIPTS_DIR / f"{name}.py"


def run_script(name: str, argv: list[str], prog: str | None = None) -> int:
    """Import scripts/<name>.py and call its ``main`` with ``argv`` (``main()`` scripts read it from ``sys.argv``).

    ``sys.argv[0]`` is set to ``prog`` meanwhile, so the script's usage lines name the command that was typed.
    """
    path = script_path(name)
    if not path.is_file():
        raise SystemExit(f"hf-dspark: {path} is not available. This command runs the repository's scripts/: use a "
                         "source checkout (pip install -e .), or a version of hf-dspark that ships it.")
    spec = importlib.util.spec_from_file_location(f"_hf_dspark_script_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    saved, sys.argv = sys.argv, [prog or str(path), *argv]
    try:
        result = module.main(argv) if inspect.signature(module.main).parameters else module.main()
    finally:
        sys.argv = saved
    return int(result or 0)


def _script_command(name: str, parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace, list[str]], int]:
    def run(args: argparse.Namespace, rest: list[str]) -> int:
        if not script_path(name).is_file() and ({"-h", "--help"} & set(rest)):
            parser.print_help()
            print(f"\n({script_path(name)} is not in this checkout yet.)")
            return 0
        return run_script(name, rest, prog=parser.prog)

    return run


# -------------------------------------------------------------------------------------------------------
# Loading models (the embedded target and its drafter are the defaults)
# -------------------------------------------------------------------------------------------------------
def load_target(path: str | None, dtype: str = "float32"):
    """``(model, tokenizer)``: ``path`` (directory or Hub id) or the embedded SmolLM2-135M-Instruct."""
    import torch

    torch_dtype = getattr(torch, dtype)
    if path is None:
        from . import load_default_target

        return load_default_target(dtype=torch_dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval(), AutoTokenizer.from_pretrained(path)


def load_drafter(path: str | None, target, embedded_target: bool):
    """``path`` in any supported format; else the shipped drafter (embedded target only); else an untrained one."""
    import hf_dspark
    from hf_dspark import DSparkDraftModel

    if path is not None:
        return DSparkDraftModel.from_pretrained(path, target=target).eval()
    load_default = getattr(hf_dspark, "load_default_drafter", None)
    reason = "no drafter is shipped for this target"
    if embedded_target and load_default is not None:
        try:
            return load_default(target).eval()
        except FileNotFoundError as err:
            reason = str(err)
    logger.warning("No --drafter given and %s: using an UNTRAINED drafter. Output is still exactly the target's, but "
                   "expect no speedup (tau ~ 1). Train one with `hf-dspark train` and pass --drafter runs/.../drafter.",
                   reason)
    return DSparkDraftModel.from_target(target).eval()


# -------------------------------------------------------------------------------------------------------
# Commands
# -------------------------------------------------------------------------------------------------------
def cmd_generate(args: argparse.Namespace, rest: list[str]) -> int:
    import torch
    from transformers import TextStreamer

    from .generation.chat import ChatSession

    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target, args.dtype)
    drafter = None if args.no_draft else load_drafter(args.drafter, target, embedded_target=args.target is None)
    sampling = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p} if args.sample else {}
    session = ChatSession(target, tokenizer, drafter, system_prompt=args.system, max_new_tokens=args.max_new_tokens,
                          generation_kwargs=sampling)
    prompts = [args.prompt] if args.prompt is not None else _interactive_prompts()
    for prompt in prompts:
        reply = session.reply(prompt, streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True))
        print(f"[{reply.summary()}]", file=sys.stderr, flush=True)
    return 0


def _interactive_prompts():
    print("hf-dspark chat: type a message (empty line or Ctrl-D to quit).", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            return
        if not line.strip():
            return
        yield line


def cmd_train(args: argparse.Namespace, rest: list[str]) -> int:
    target = ["--target", args.target] if args.target else []
    if args.data:
        layers = ["--layers", *map(str, args.layers)] if args.layers else []
        run_script("build_target_cache", ["--data", *args.data, "--out", args.cache, *target, *layers],
                   prog="hf-dspark train (cache)")
    return run_script("train_drafter", ["--cache", args.cache, "--out", args.out, *target, *rest],
                      prog="hf-dspark train")


def cmd_convert(args: argparse.Namespace, rest: list[str]) -> int:
    from .hub import convert_checkpoint, describe_checkpoint

    target = load_target(args.target)[0] if args.target else None
    if args.check:  # report only: what SRC is, what loads, exports and is refused (exit 1 when refused)
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


def cmd_push(args: argparse.Namespace, rest: list[str]) -> int:
    from . import DSparkDraftModel
    from .hub import DraftCardInfo, push_to_hub, read_calibration, read_evaluation, save_for_hub, summarize_training

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


# -------------------------------------------------------------------------------------------------------
# Parser
# -------------------------------------------------------------------------------------------------------
def _add_generate(sub) -> None:
    p = sub.add_parser("generate", allow_abbrev=False, help="Chat with streaming output; prints tok/s and τ after each reply.",
                       description="Chat (or one --prompt) with the target, drafting with a DSpark drafter. Greedy "
                                   "output is exactly the target's own.")
    p.add_argument("--prompt", default=None, help="one-shot prompt (default: interactive chat)")
    p.add_argument("--target", default=None, help="target directory or Hub id (default: embedded SmolLM2-135M)")
    p.add_argument("--drafter", default=None, help="drafter directory or Hub id, any supported format")
    p.add_argument("--no-draft", action="store_true", help="plain decoding, for comparison")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--sample", action="store_true", help="sample (lossless: rejection sampling) instead of greedy")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.set_defaults(func=cmd_generate)


def _add_train(sub) -> None:
    p = sub.add_parser("train", allow_abbrev=False, help="Build (or extend) the target cache, then train a drafter.",
                       description="Runs scripts/build_target_cache.py (when --data is given) and then "
                                   "scripts/train_drafter.py. Any other option goes to train_drafter.py, e.g. "
                                   "--steps 2000 --max-minutes 600 --head markov --num-layers 1 --resume.")
    p.add_argument("--data", nargs="+", default=None, help="conversation jsonl file(s) to cache first")
    p.add_argument("--cache", default="cache/smollm2", help="target cache directory (default: %(default)s)")
    p.add_argument("--out", default="runs/smollm2-dspark", help="run directory (default: %(default)s)")
    p.add_argument("--target", default=None, help="target directory or Hub id (default: embedded SmolLM2)")
    p.add_argument("--layers", type=int, nargs="+", default=None, help="target layers to tap when caching")
    p.set_defaults(func=cmd_train, passthrough=True)


def _add_convert(sub) -> None:
    p = sub.add_parser("convert", allow_abbrev=False, help="Convert a drafter: to speculators (vLLM) or to hf-dspark's native format.",
                       description="Reads any format hf-dspark loads (native, DeepSpec, speculators, SpecForge / z-lab, "
                                   "transformers' DFlash assistants) and "
                                   "writes --to. Exports that vLLM would misread are refused with the reason.")
    p.add_argument("src", help="drafter directory or Hub id")
    p.add_argument("dst", nargs="?", default=None, help="output directory (not with --check)")
    p.add_argument("--check", action="store_true", help="only report what SRC is: dialect, architecture, heads, "
                                                        "vocabulary, taps, block convention, what loads / exports "
                                                        "and what is refused and why")
    p.add_argument("--to", default="speculators", choices=["speculators", "native"])
    p.add_argument("--target", default=None, help="target directory or Hub id: needed for reduced-vocabulary exports, "
                                                  "transformers' DFlash assistants and sources that do not record "
                                                  "the target's layer count")
    p.add_argument("--verifier", default=None, help="verifier vLLM pairs the drafter with (required unless the drafter "
                                                    "records its target or --target names one)")
    p.add_argument("--include-target-weights", action="store_true", help="also store the target's embedding/LM head")
    p.add_argument("--no-vllm-check", action="store_true", help="allow heads only speculators (not vLLM) implements")
    p.set_defaults(func=cmd_convert)


def _add_push(sub) -> None:
    p = sub.add_parser("push", allow_abbrev=False, help="Upload a drafter with a generated model card to the Hugging Face Hub.",
                       description="Uploads config.json, model.safetensors and a README.md generated from "
                                   "model_cards/TEMPLATE.md. Use --dry-run DIR to see exactly what would be sent.")
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
    p.add_argument("--template", default=None, help="card template (default: model_cards/TEMPLATE.md)")
    p.add_argument("--private", action="store_true", default=None)
    p.add_argument("--token", default=None)
    p.add_argument("--revision", default=None)
    p.add_argument("--create-pr", action="store_true")
    p.add_argument("--commit-message", default=None)
    p.add_argument("--dry-run", metavar="DIR", default=None, help="write the upload to DIR instead of pushing")
    p.set_defaults(func=cmd_push)


def _add_script_commands(sub) -> None:
    for command, (script, description) in SCRIPT_COMMANDS.items():
        p = sub.add_parser(command, help=description, add_help=False, allow_abbrev=False,
                           description=f"{description} All options are the script's own: see them with "
                                       f"`hf-dspark {command} --help`.")
        p.set_defaults(func=_script_command(script, p), passthrough=True)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="hf-dspark", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hf-dspark {__version__}")
    parser.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"],
                        help="configure logging (scripts configure their own by default)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_generate(sub)
    _add_train(sub)
    _add_convert(sub)
    _add_push(sub)
    _add_script_commands(sub)
    return parser


def _user_errors() -> tuple[type[Exception], ...]:
    from .hub.export import SpeculatorsExportError
    from .modeling.dialects import CheckpointError

    return CheckpointError, SpeculatorsExportError, FileNotFoundError


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if rest and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.log_level:
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        return args.func(args, rest)
    except _user_errors() as err:  # a bad checkpoint, path or export request: the message says what to do
        parser.exit(2, f"hf-dspark {args.command}: error: {err}\n")


if __name__ == "__main__":
    sys.exit(main())
