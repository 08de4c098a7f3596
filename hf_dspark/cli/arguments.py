"""argparse types for the numbers and lists of ``hf-dspark`` options: a value out of range is refused while the
command line is parsed (one ``error: argument --X: ...`` line, exit code 2), not minutes later inside a run."""

from __future__ import annotations

import argparse
import math
from pathlib import Path


def _number(kind: type, text: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _bounded(kind: type, accepts, rule: str, name: str):
    """A type for the numbers of ``kind`` that ``accepts`` admits; ``rule`` names the range in the error."""

    def parse(text: str):
        value = _number(kind, text)
        if not accepts(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}")
        return value

    parse.__name__ = name
    return parse


positive_int = _bounded(int, lambda v: v >= 1, "an integer >= 1", "positive_int")
non_negative_int = _bounded(int, lambda v: v >= 0, "an integer >= 0", "non_negative_int")
positive_float = _bounded(float, lambda v: v > 0, "a number > 0", "positive_float")
non_negative_float = _bounded(float, lambda v: v >= 0, "a number >= 0", "non_negative_float")
probability = _bounded(float, lambda v: 0 < v <= 1, "a number in (0, 1]", "probability")
# a share of a whole that must leave some of it, e.g. the warm-up part of a learning-rate schedule
fraction = _bounded(float, lambda v: 0 <= v < 1, "a number in [0, 1)", "fraction")


def _comma_list(element):
    """A type for a comma-separated list whose items ``element`` parses ("" is the empty list)."""

    def parse(text: str) -> list:
        try:
            return [element(item.strip()) for item in text.split(",") if item.strip()]
        except argparse.ArgumentTypeError as err:
            raise argparse.ArgumentTypeError(f"a comma-separated list whose items {err}") from None

    parse.__name__ = f"{element.__name__}_list"
    return parse


def existing_file(text: str) -> str:
    """An input file the command reads: a typo is reported before minutes of model loading, not after."""
    if not Path(text).expanduser().is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}" if not Path(text).exists() else
                                         f"{text!r} is not a file")
    return text


def new_folder(text: str) -> str:
    """An output folder a command writes a model into: absent or empty. Any other folder (a target's, a previous
    run's) would have its config.json and weights overwritten, and a file path failed after reporting success."""
    path = Path(text).expanduser()
    if path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is a file: give a new or empty folder")
    if path.is_dir() and any(path.iterdir()):
        raise argparse.ArgumentTypeError(f"{text!r} is not empty: give a new or empty folder (its files would be "
                                         "overwritten)")
    return text


def output_folder(text: str) -> str:
    """A folder a command writes its results or run into, new or not: a path that is a file failed only when the
    first result was written, after the work (train: after its first step; eval, bench, calibrate: after the run,
    whose results were lost)."""
    if Path(text).expanduser().is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is a file: give a folder")
    return text


positive_ints = _comma_list(positive_int)
non_negative_ints = _comma_list(non_negative_int)
non_negative_floats = _comma_list(non_negative_float)


__all__ = ["existing_file", "fraction", "new_folder", "non_negative_float", "non_negative_floats", "non_negative_int",
           "non_negative_ints", "output_folder", "positive_float",
           "positive_int", "positive_ints", "probability"]
