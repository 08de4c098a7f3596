"""The on-disk cache of measured cost tables: what keys a table, the files it lives in, and reading and writing them.

Profiling a real target takes seconds to minutes, so measured tables are kept as JSON files and reused by later
engines, ``generate`` calls and processes. The cache only saves time: a malformed file is ignored with a warning
(the caller measures again and overwrites it), and a folder that cannot be written costs one warning per process,
the tables then kept in memory for the rest of the process. Which folder is the caller's choice
(``step_cost.py``); the key covers everything that changes the cost curve, not how busy the machine was (that is
checked when a table is used, see ``step_cost.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from .cost_tables import CACHE_VERSION, SPSProfile, StepCostProfile, number_list, save_json_atomic

logger = logging.getLogger(__name__)

#: :func:`read_cached`'s answer when nothing is cached (a file holding ``null`` reads as None)
NO_CACHE_FILE = object()

# The cache folder is an optimisation: a folder that will not take a table (read-only, under a regular file, a full
# disk) costs one warning, and the table is kept here for the rest of the process instead, so a second engine or
# generate call does not measure again.
_UNSAVED: dict[str, object] = {}  # cache file -> the JSON this process could not write there
_UNWRITABLE_FOLDERS: set[str] = set()  # folders already warned about in this process


# ---------------------------------------------------------------------------------------------------------
# Keys and file names
# ---------------------------------------------------------------------------------------------------------
def profile_cache_key(target, batch_tokens: Sequence[int], *, context_len: int, row_len: int, dtype: torch.dtype,
                      device: torch.device | str, repeats: int) -> str:
    """Hash of everything that changes the curve: model identity + config, dtype, device, CPU threads, grid,
    the kernel the linears run with (``cpu_kernels.linear_kernel``)."""
    from ..cpu_kernels import linear_kernel

    config = target.config.to_json_string(use_diff=False) if hasattr(target.config, "to_json_string") else ""
    ident = {"name": getattr(target.config, "_name_or_path", "") or type(target).__name__,
             "config": hashlib.sha256(config.encode()).hexdigest(), "dtype": str(dtype), "device": str(device),
             "threads": torch.get_num_threads(), "grid": list(batch_tokens), "context_len": context_len,
             "row_len": row_len, "repeats": repeats, "torch": torch.__version__, "version": CACHE_VERSION,
             "linears": linear_kernel(target)}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


def step_cost_file(folder: Path, verify_key: str, grid: str) -> Path:
    """The file of a target's verify table: ``verify_key`` (:func:`profile_cache_key` of its grid) and ``grid``,
    what else set how it was measured ("" for the fine grid, the key it always had)."""
    key = hashlib.sha256((verify_key + "|step-cost-isotonic|" + grid).encode()).hexdigest()[:24]
    return folder / f"step-{key}.json"


def draft_cost_file(verify_path: Path, draft_config: str) -> tuple[Path, str]:
    """(file, key) of one drafter's pass costs beside the verify table at ``verify_path`` (``draft_config``: the
    drafter config's JSON)."""
    key = hashlib.sha256((verify_path.stem + "|draft-between-forwards|" + draft_config).encode()).hexdigest()[:24]
    return verify_path.with_name(f"draft-{key}.json"), key


# ---------------------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------------------
def read_cached(path: Path):
    """The parsed JSON of a cache file (this process's copy when the folder would not take it), NO_CACHE_FILE when
    there is none. Raises ValueError (not JSON) or OSError (not readable)."""
    if str(path) in _UNSAVED:
        return _UNSAVED[str(path)]
    if not path.is_file():
        return NO_CACHE_FILE
    return json.loads(path.read_text())


def save_cached(path: Path, data: dict) -> bool:
    """Write a cache file; whether it was written. A folder that refuses it is warned about once per process and
    folder, and the table is kept in memory instead: a call must never fail for want of a cache."""
    try:
        save_json_atomic(path, data)
    except OSError as err:
        _UNSAVED[str(path)] = json.loads(json.dumps(data))  # what the file would hold, not the live metadata dict
        folder = str(path.parent)
        if folder not in _UNWRITABLE_FOLDERS:
            _UNWRITABLE_FOLDERS.add(folder)
            logger.warning("step-cost profile: cannot write the cache folder %s (%s); measured tables are kept in "
                           "memory for this process only and measured again by the next one. Point HF_DSPARK_CACHE "
                           "(or cache_dir= / DSparkEngine(sps_cache_dir=...)) at a writable folder to keep them.",
                           folder, err)
        return False
    _UNSAVED.pop(str(path), None)
    return True


def forget_cached(path: str | Path) -> None:
    """Drop a cached table (its file and this process's copy), so the next use measures it again."""
    _UNSAVED.pop(str(path), None)
    try:
        Path(path).unlink(missing_ok=True)
    except OSError as err:
        logger.warning("step-cost profile: cannot delete the stale table %s (%s)", path, err)


# ---------------------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------------------
def read_sps(path: Path) -> SPSProfile | None:
    """The SPS(B) table cached at ``path``; None when there is none or it is malformed (then with a warning)."""
    try:
        data = read_cached(path)
        return None if data is NO_CACHE_FILE else SPSProfile.from_dict(data)
    except (ValueError, OSError) as err:
        logger.warning("SPS profile: ignoring unreadable cache file %s (%s); re-profiling", path, err)
        return None


def read_step_cost(path: Path) -> tuple[StepCostProfile, str] | None:
    """(the verify table cached at ``path``, a hash of its content); None when there is none or it is malformed
    (then with a warning)."""
    try:
        data = read_cached(path)
        if data is NO_CACHE_FILE:
            return None
        profile = StepCostProfile.from_dict(data)
        _raise_if_malformed_raw_verify(profile)
    except (ValueError, OSError) as err:
        logger.warning("step-cost profile: ignoring unreadable cache file %s (%s); re-profiling", path, err)
        return None
    return profile, hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def read_draft_seconds(path: Path, rows: tuple[int, ...]) -> list[float] | None:
    """A drafter's pass costs cached at ``path`` for these row counts; None when there are none, they were measured
    at other row counts, or the file is malformed (then with a warning: it is measured again and overwritten)."""
    try:
        cached = read_cached(path)
        if cached is NO_CACHE_FILE:
            return None
        if not isinstance(cached, Mapping):
            raise ValueError(f"expected a JSON object, got {type(cached).__name__}")
        if tuple(number_list(cached.get("rows"), "rows", integers=True)) != rows:
            return None
        seconds = number_list(cached.get("raw_draft_seconds"), "raw_draft_seconds")
        if len(seconds) != len(rows) or not all(s > 0 for s in seconds):
            raise ValueError(f"raw_draft_seconds must hold one time > 0 per row count {list(rows)}, got {seconds}")
        return [float(s) for s in seconds]
    except (ValueError, OSError) as err:
        logger.warning("step-cost profile: ignoring unreadable drafter cost file %s (%s)", path, err)
        return None


def _raise_if_malformed_raw_verify(profile: StepCostProfile) -> None:
    """The raw timings a cached table keeps (read by the busy-machine check) must be [rows][widths] times > 0."""
    raw = profile.metadata.get("raw_verify_seconds")
    if raw is None:
        return
    if not isinstance(raw, list) or len(raw) != len(profile.rows):
        raise ValueError(f"metadata.raw_verify_seconds must have one line per row count {list(profile.rows)}")
    for i, line in enumerate(raw):
        if len(number_list(line, f"metadata.raw_verify_seconds[{i}]")) != len(profile.widths) or not all(
                t > 0 for t in line):
            raise ValueError(f"metadata.raw_verify_seconds[{i}] must hold one time > 0 per width "
                             f"{list(profile.widths)}, got {line}")


__all__ = ["NO_CACHE_FILE", "draft_cost_file", "forget_cached", "profile_cache_key", "read_cached",
           "read_draft_seconds", "read_sps", "read_step_cost", "save_cached", "step_cost_file"]
