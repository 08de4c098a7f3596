"""scripts/*.py that are ``hf-dspark`` commands: each hands its arguments to the command unchanged, and every
invocation in the shell recipes (scripts/*.sh) still parses, so the recipes keep working."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from hf_dspark.cli import build_parser

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
COMMAND_OF_SCRIPT = {"train_drafter": "train", "build_target_cache": "cache", "regenerate": "regenerate",
                     "calibrate_drafter": "calibrate", "eval_drafter": "eval", "bench_generate": "bench",
                     "bench_serving": "serve-bench"}


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", sorted(COMMAND_OF_SCRIPT))
def test_script_runs_its_command_with_its_arguments(script, monkeypatch):
    module = load_script(script)
    calls = []
    monkeypatch.setattr(module, "hf_dspark_main", lambda argv: calls.append(argv) or 0)
    assert module.main(["--out", "x", "-n", "3"]) == 0
    monkeypatch.setattr("sys.argv", [f"scripts/{script}.py", "--flag"])
    assert module.main() == 0
    assert calls == [[COMMAND_OF_SCRIPT[script], "--out", "x", "-n", "3"], [COMMAND_OF_SCRIPT[script], "--flag"]]


PLACEHOLDERS = {"head": "markov"}  # loop variables of the recipes; every other variable becomes 1


def _placeholder(match: re.Match) -> str:
    return PLACEHOLDERS.get(match.group(1), "1")


def recipe_invocations() -> list[tuple[str, str, list[str]]]:
    """(recipe, script, argv) of every ``$PY scripts/<name>.py ...`` line of the shell recipes, variables replaced
    by placeholder values (unquoted optional ones such as ``$GROW`` dropped)."""
    found = []
    for recipe in sorted(SCRIPTS.glob("*.sh")):
        text = recipe.read_text().replace("\\\n", " ")
        for line in text.splitlines():
            match = re.search(r"\$PY scripts/(\w+)\.py(.*?)(&\s*)?$", line.strip())
            if not match or match.group(1) not in COMMAND_OF_SCRIPT:
                continue
            args = re.sub(r"\$\(\([^)]*\)\)", "1", match.group(2))  # $((N - HOLDOUT))
            args = re.sub(r"\$\{[A-Za-z_]+:\+([^}]*)\}", r"\1", args)  # ${GROW:+--grow "$GROW"}: check the option
            args = re.sub(r"\"\$@\"|\$@", "", args)  # a shell function's own arguments (checked where it is called)
            args = re.sub(r"(?<=\s)\$[A-Z_]+(?=\s|$)", "", args)  # unquoted $GROW / $INIT: may expand to nothing
            argv = [re.sub(r"\$\{?([A-Za-z_][^\s\"/]*)\}?", _placeholder, token) for token in shlex.split(args)]
            found.append((recipe.name, match.group(1), argv))
    return found


def test_every_recipe_invocation_parses():
    invocations = recipe_invocations()
    assert {script for _, script, _ in invocations} >= {"train_drafter", "build_target_cache", "calibrate_drafter",
                                                         "eval_drafter", "regenerate"}
    parser = build_parser()
    for recipe, script, argv in invocations:
        args = parser.parse_args([COMMAND_OF_SCRIPT[script], *argv])  # SystemExit(2) on an unknown option
        assert args.command == COMMAND_OF_SCRIPT[script], (recipe, argv)
