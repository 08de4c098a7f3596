"""``hf-dspark``: argument parsing and dispatch to the library; no logic of its own.

``DESCRIPTION`` is what ``hf-dspark --help`` shows users; each command's module adds its sub-parser. Every command
runs from an installed package (nothing is read from a repository checkout); the benchmark prompts are found through
$HF_DSPARK_EVAL_DIR or ../shared/eval_datasets. ``scripts/*.py`` call these same commands.
"""

from __future__ import annotations

import argparse
import logging
import sys

from .chat import add_generate
from .measuring import add_bench, add_calibrate, add_eval, add_serve_bench
from .sharing import add_convert, add_push
from .training import add_cache, add_regenerate, add_train

DESCRIPTION = """\
Speculative decoding for Hugging Face transformers with DSpark drafters: a small drafter proposes blocks of tokens
that the target checks in one pass, so the target generates faster and its greedy output stays exactly its own.
Without --target, commands use the embedded SmolLM2-135M-Instruct and the drafter shipped for it.

  hf-dspark generate [--prompt TEXT]                chat (streaming) with the target; prints tok/s and τ
  hf-dspark bench                                   generate speed, plain vs drafted
  hf-dspark regenerate --out data/smollm2           training data: the target answers prompts
  hf-dspark train --data data/smollm2/train.jsonl   train a drafter for your target (then calibrate, eval)
  hf-dspark eval --drafter DIR --out DIR            τ and speedup per benchmark
  hf-dspark convert SRC DST --to speculators        export a drafter for vLLM (convert --check SRC: what SRC is)
  hf-dspark push SRC org/name                       upload a drafter with a generated model card
"""
EPILOG = "Run `hf-dspark COMMAND --help` for a command's options."
LOG_FORMAT = "%(asctime)s %(name)s %(message)s"
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a Ctrl-C


def build_parser() -> argparse.ArgumentParser:
    from ..version import __version__

    parser = argparse.ArgumentParser(prog="hf-dspark", description=DESCRIPTION, epilog=EPILOG, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hf-dspark {__version__}")
    parser.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"],
                        help="logging level (default: each command's own, e.g. info for train)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in (add_generate, add_regenerate, add_cache, add_train, add_calibrate, add_eval, add_bench,
                add_serve_bench, add_convert, add_push):
        add(sub)
    return parser


def user_errors() -> tuple[type[BaseException], ...]:
    """Mistakes a user fixes by changing the command (a bad path, a drafter for another target, a refused export,
    a target cache of another target, a used run folder, prompts overlapping the evaluation sets, missing benchmark
    prompts, a conversation, prompt or model-card file that cannot be read or holds nothing): reported as one line,
    exit code 2. Anything else is a bug and keeps its traceback."""
    from ..hub.export import SpeculatorsExportError
    from ..hub.model_card import CardInputError
    from ..hub.upload import UploadError
    from ..loading import ModelLoadError
    from ..modeling.checkpoint_files import CheckpointError
    from ..training.prompts import EvalOverlapError, PromptFileError
    from ..training.target_cache import ConversationFileError, TargetCacheError
    from ..training.trainer import RunDirectoryError

    return (ModelLoadError, CheckpointError, SpeculatorsExportError, TargetCacheError, RunDirectoryError,
            EvalOverlapError, UploadError, ConversationFileError, PromptFileError, CardInputError,
            FileNotFoundError, NotADirectoryError)


def _configure_logging(args: argparse.Namespace) -> None:
    level = args.log_level or getattr(args, "default_log_level", None)
    if level:
        logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    if getattr(args, "quiet_generate_summaries", False) and not args.log_level:
        # one DSparkStats summary per generate call would flood the log; the results carry the same numbers
        logging.getLogger("hf_dspark").addFilter(lambda record: record.levelno > logging.INFO)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    _configure_logging(args)
    try:
        return int(args.func(args) or 0)
    except user_errors() as err:
        message = " ".join(str(err).split())  # one line, whatever the library wrote
        parser.exit(EXIT_USER_ERROR, f"hf-dspark {args.command}: error: {message}\n")
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED


__all__ = ["EXIT_INTERRUPTED", "EXIT_USER_ERROR", "build_parser", "main", "user_errors"]
