"""The shell recipes (scripts/*.sh) and the two scripts that are ``hf-dspark`` commands: every
``.venv/bin/hf-dspark <command>`` line of a recipe parses (so the recipes keep working), every ``scripts/<name>.py``
a recipe runs exists, and ``train_drafter.py`` (a file for ``accelerate launch`` / ``torchrun``) and
``regenerate.py`` hand their arguments to their command unchanged."""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

from hf_dspark.cli import build_parser
from hf_dspark.cli.arguments import existing_file, new_folder

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
COMMAND_OF_SCRIPT = {"train_drafter": "train", "regenerate": "regenerate"}


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses defined in a script look their module up
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


def _recipe_lines() -> list[tuple[str, str]]:
    """(recipe, line) of every shell recipe, continuation lines joined."""
    return [(recipe.name, line.strip()) for recipe in sorted(SCRIPTS.glob("*.sh"))
            for line in recipe.read_text().replace("\\\n", " ").splitlines()]


def recipe_invocations() -> list[tuple[str, str, list[str]]]:
    """(recipe, command, argv) of every ``.venv/bin/hf-dspark <command> ...`` line of the shell recipes, variables
    replaced by placeholder values (unquoted optional ones such as ``$GROW`` dropped)."""
    found = []
    for recipe, line in _recipe_lines():
        match = re.search(r"\.venv/bin/hf-dspark ([a-z][\w-]*)(.*?)(&\s*)?$", line)
        if not match:
            continue
        args = re.sub(r"\$\(\([^)]*\)\)", "1", match.group(2))  # $((N - HOLDOUT))
        args = re.sub(r"\$\{[A-Za-z_]+:\+([^}]*)\}", r"\1", args)  # ${GROW:+--grow "$GROW"}: check the option
        args = re.sub(r"\"\$@\"|\$@", "", args)  # a shell function's own arguments (checked where it is called)
        args = re.sub(r"(?<=\s)\$[A-Z_]+(?=\s|$)", "", args)  # unquoted $GROW / $INIT: may expand to nothing
        argv = [re.sub(r"\$\{?([A-Za-z_][^\s\"/]*)\}?", _placeholder, token) for token in shlex.split(args)]
        found.append((recipe, match.group(1), argv))
    return found


def _paths_unchecked(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The recipes' variables stand for files their earlier steps write (placeholders here): this test checks the
    options, so arguments whose type checks the file system (an input that exists, an empty output folder) are
    taken as text."""
    for action in parser._actions:
        if action.type in (existing_file, new_folder):
            action.type = str
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _paths_unchecked(sub)
    return parser


def test_every_recipe_invocation_parses():
    invocations = recipe_invocations()
    assert {command for _, command, _ in invocations} >= {"train", "cache", "calibrate", "eval", "regenerate"}
    parser = _paths_unchecked(build_parser())
    for recipe, command, argv in invocations:
        args = parser.parse_args([command, *argv])  # SystemExit(2) on an unknown option
        assert args.command == command, (recipe, argv)


def test_every_script_a_recipe_runs_exists():
    scripts = {(recipe, name) for recipe, line in _recipe_lines() for name in re.findall(r"scripts/(\w+)\.py", line)
               if not line.startswith("#")}
    assert scripts  # the recipes still run helper scripts (held-out validation, vocabularies, cache mixing)
    missing = [(recipe, name) for recipe, name in sorted(scripts) if not (SCRIPTS / f"{name}.py").is_file()]
    assert not missing, missing


@pytest.mark.parametrize("path", sorted(SCRIPTS.glob("*.py")), ids=lambda p: p.name)
def test_every_script_imports_and_documents_itself(path, monkeypatch):
    """A refactor that moves a library name must not leave a script behind (revocab_drafter.py once imported
    ``load_target`` from a module that no longer had it): each script imports, and its ``--help`` exits 0."""
    monkeypatch.syspath_prepend(str(SCRIPTS))  # scripts may import their siblings
    module = load_script(path.stem)
    assert module.__doc__, f"{path.name} has no docstring to say what it is for"
    main = getattr(module, "main", None)
    if main is None:
        return
    monkeypatch.setattr("sys.argv", [path.name, "--help"])
    with pytest.raises(SystemExit) as stop:
        main()
    assert stop.value.code == 0
