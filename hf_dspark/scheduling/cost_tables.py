"""The cost tables the scheduler prices rounds with: SPS(B) (verify steps per second for B tokens, the paper's
form) and the padded step cost (drafter pass for R rows + verify of R rows × W tokens, what ``generate`` and the
engine actually run). Both look up in O(1) and are saved as JSON; ``step_cost.py`` measures them and
``profile_cache.py`` keeps them on disk."""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

#: Stamped into saved tables and part of every cache key: raised whenever the way a table is measured changes, so
#: tables measured the old way are measured again (2: cells timed in interleaved passes over the widths; 3: skinny
#: row counts; 4: the target cache appends in place, speculation/kv_cache.py)
CACHE_VERSION = 4


@dataclass(frozen=True)
class SPSProfile:
    """Monotone-ish table batch tokens B -> verify steps/s, with O(1) lookup.

    Between measured points SPS is interpolated linearly; below the first point it equals the first value
    (smaller batches are never slower); beyond the last point it falls as SPS(B_max)·B_max/B, i.e. the cost
    keeps growing linearly with tokens (compute-bound), which is the conservative reading.
    """

    batch_tokens: tuple[int, ...]  # strictly increasing, >= 1
    steps_per_second: tuple[float, ...]  # > 0
    metadata: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        tokens, sps = tuple(int(b) for b in self.batch_tokens), tuple(float(s) for s in self.steps_per_second)
        if not tokens or len(tokens) != len(sps):
            raise ValueError(f"SPSProfile needs equally long, non-empty batch_tokens and steps_per_second, got "
                             f"{len(tokens)} and {len(sps)} entries")
        if tokens[0] < 1 or any(b >= c for b, c in zip(tokens, tokens[1:])):
            raise ValueError(f"SPSProfile.batch_tokens must be strictly increasing integers >= 1, got {tokens}")
        if any(not s > 0 or s != s or s == float("inf") for s in sps):
            raise ValueError(f"SPSProfile.steps_per_second must be finite and > 0, got {sps}")
        object.__setattr__(self, "batch_tokens", tokens)
        object.__setattr__(self, "steps_per_second", sps)
        object.__setattr__(self, "_dense", _dense_table(tokens, sps))

    # ---- lookup ------------------------------------------------------------------------------------------
    @property
    def max_batch_tokens(self) -> int:
        return self.batch_tokens[-1]

    def is_monotone(self) -> bool:
        return all(b <= a for a, b in zip(self.steps_per_second, self.steps_per_second[1:]))

    def __call__(self, num_tokens: int) -> float:
        """SPS(B) for one batch size."""
        return float(self.lookup(np.array([int(num_tokens)]))[0])

    def lookup(self, num_tokens) -> np.ndarray:
        """Vectorised SPS(B): integer array/tensor of batch sizes -> float64 array (O(1) per entry).

        numpy, not torch: the scheduler calls this every engine step on a few thousand numbers, where torch's
        intra-op threading costs more than the work."""
        if isinstance(num_tokens, torch.Tensor):
            num_tokens = num_tokens.detach().cpu().numpy()
        num_tokens = np.asarray(num_tokens, dtype=np.int64)
        dense = self._dense  # type: ignore[attr-defined]
        top = dense.size - 1
        inside = dense[np.clip(num_tokens, 0, top)]
        beyond = dense[top] * top / np.maximum(num_tokens, 1)
        return np.where(num_tokens > top, beyond, inside)

    def tokens_per_second(self, num_tokens: int) -> float:
        """Verify tokens processed per second at batch size B (B · SPS(B))."""
        return num_tokens * self(num_tokens)

    # ---- construction / persistence ----------------------------------------------------------------------
    @classmethod
    def from_user_table(cls, table: Mapping[int, float] | Sequence[tuple[int, float]],
                        **metadata) -> "SPSProfile":
        """A profile from a user's measurements ({B: steps/s} or [(B, steps/s)]), kept exactly as given."""
        pairs = sorted((int(b), float(s)) for b, s in (table.items() if isinstance(table, Mapping) else table))
        profile = cls(tuple(b for b, _ in pairs), tuple(s for _, s in pairs), {"source": "user", **metadata})
        if not profile.is_monotone():
            logger.warning("user SPS table is not monotone non-increasing in B; using it as given: %s", pairs)
        return profile

    def to_dict(self) -> dict:
        return {"version": CACHE_VERSION, "batch_tokens": list(self.batch_tokens),
                "steps_per_second": list(self.steps_per_second), "metadata": self.metadata}

    @classmethod
    def from_dict(cls, data: Mapping) -> "SPSProfile":
        """The table :meth:`to_dict` wrote; a ValueError naming the field for anything else (a cache file that
        parses as JSON can still hold a list, ``null`` or strings)."""
        data = _table_object(data, cls.__name__)
        return cls(tuple(number_list(data.get("batch_tokens"), "batch_tokens", integers=True)),
                   tuple(number_list(data.get("steps_per_second"), "steps_per_second")), _metadata(data))

    def save(self, path: str | os.PathLike) -> None:
        save_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SPSProfile":
        return cls.from_dict(json.loads(Path(path).read_text()))


def number_list(value, name: str, *, integers: bool = False) -> list:
    """``value`` when it is a list of finite numbers (of integers with ``integers``; booleans are neither), else a
    ValueError naming ``name`` and what it holds: what a cache file's field must pass before a table is built."""
    def fits(x) -> bool:
        if isinstance(x, bool):
            return False
        return isinstance(x, numbers.Integral) if integers else isinstance(x, numbers.Real) and math.isfinite(x)

    if not isinstance(value, (list, tuple)) or not all(fits(x) for x in value):
        kind = "integers" if integers else "finite numbers"
        raise ValueError(f"{name} must be a list of {kind}, got {_preview(value)}")
    return list(value)


def _table_object(data, kind: str) -> Mapping:
    if not isinstance(data, Mapping):
        raise ValueError(f"a saved {kind} is a JSON object, got {_preview(data)}")
    return data


def _metadata(data: Mapping) -> dict:
    metadata = data.get("metadata", {})
    if not isinstance(metadata, Mapping):
        raise ValueError(f"metadata must be a JSON object, got {_preview(metadata)}")
    return dict(metadata)


def _preview(value) -> str:
    """A short repr for messages: a malformed cache file can be megabytes."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def save_json_atomic(path: str | os.PathLike, data: dict) -> None:
    """Write via a temporary file and rename: a concurrent reader never sees half a file. The temporary file is this
    process's and thread's own (two processes measuring the same table at once each rename a whole file, the last
    wins), and is created as any file (the umask sets its permissions)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def _dense_table(tokens: tuple[int, ...], sps: tuple[float, ...]) -> np.ndarray:
    """SPS for every B in 0..B_max (index = B), linearly interpolated between measured points (flat below)."""
    dense = np.interp(np.arange(tokens[-1] + 1), tokens, sps)
    dense.setflags(write=False)
    return dense


def make_monotone(values: Sequence[float]) -> list[float]:
    """Running minimum: measured timing noise must not make a bigger batch look faster than a smaller one."""
    out, low = [], float("inf")
    for value in values:
        low = min(low, value)
        out.append(low)
    return out


def default_batch_grid(max_batch_tokens: int) -> list[int]:
    """1..16 densely (where verify cost is flat and Algorithm 1 decides most), then ~×1.25 steps."""
    grid = list(range(1, min(16, max_batch_tokens) + 1))
    while grid[-1] < max_batch_tokens:
        grid.append(min(max_batch_tokens, max(grid[-1] + 1, int(grid[-1] * 1.25))))
    return grid


def verify_batch_shape(num_tokens: int, row_len: int) -> tuple[int, int]:
    """(rows, tokens per row) for B verify tokens split as evenly as possible into rows of ≤ row_len (= 1 + γ),
    the way an engine step lays out requests; rows·len ≥ B by less than one row."""
    rows = -(-num_tokens // row_len)
    return rows, -(-num_tokens // rows)


# ---------------------------------------------------------------------------------------------------------
# The engine's real step cost: drafter pass + padded verify
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepCostProfile:
    """Seconds of one engine decode step on this machine, as the engine lays it out.

    ``verify_seconds[i][k]``: target forward over ``rows[i]`` rows × ``widths[k]`` tokens (W = 1 + max ℓ_r);
    ``draft_seconds[i]``: one batched drafter pass for ``rows[i]`` requests (0 where unknown). Between measured
    row counts the cost is interpolated linearly; beyond the last a verify costs what the last row count pays for
    as many tokens (``_beyond_rows``) and a drafter pass grows in proportion to the rows. Widths are clipped to
    the measured range (the engine never verifies wider than 1 + γ).

    It also answers SPS(B) like :class:`SPSProfile` (B tokens in rows of ``widths[-1]``), so SPS-based policies
    and user code keep working when handed a step-cost profile.
    """

    rows: tuple[int, ...]  # strictly increasing, >= 1
    widths: tuple[int, ...]  # strictly increasing, >= 1
    verify_seconds: tuple[tuple[float, ...], ...]  # [len(rows)][len(widths)], > 0
    draft_seconds: tuple[float, ...]  # [len(rows)], >= 0
    metadata: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        rows, widths = tuple(int(r) for r in self.rows), tuple(int(w) for w in self.widths)
        verify = tuple(tuple(float(x) for x in line) for line in self.verify_seconds)
        draft = tuple(float(x) for x in self.draft_seconds)
        for name, grid in (("rows", rows), ("widths", widths)):
            if not grid or grid[0] < 1 or any(a >= b for a, b in zip(grid, grid[1:])):
                raise ValueError(f"StepCostProfile.{name} must be non-empty, strictly increasing integers >= 1, "
                                 f"got {grid}")
        if len(verify) != len(rows) or any(len(line) != len(widths) for line in verify) or len(draft) != len(rows):
            raise ValueError(f"StepCostProfile: verify_seconds must be [{len(rows)}][{len(widths)}] and "
                             f"draft_seconds [{len(rows)}], got {[len(line) for line in verify]} and {len(draft)}")
        values = np.array(verify)
        if not np.all(np.isfinite(values)) or (values <= 0).any() or any(not (d >= 0 and d < float("inf"))
                                                                          for d in draft):
            raise ValueError("StepCostProfile: verify seconds must be finite and > 0, draft seconds finite and >= 0")
        for name, value in (("rows", rows), ("widths", widths), ("verify_seconds", verify), ("draft_seconds", draft)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_verify", values)
        object.__setattr__(self, "_sps", None)
        object.__setattr__(self, "_widths_at", {})  # num_rows -> verify_widths(num_rows) (the table never changes)

    # ---- lookup ------------------------------------------------------------------------------------------
    def _at_rows(self, column: Sequence[float], num_rows: int) -> float:
        """One column of the table at a row count (linear between measured rows, proportional beyond)."""
        value = np.interp(min(num_rows, self.rows[-1]), self.rows, column)
        return float(value) * max(num_rows / self.rows[-1], 1.0)

    def verify_widths(self, num_rows: int) -> np.ndarray:
        """Verify seconds for ``num_rows`` rows at every width widths[0]..widths[-1] (index = width − widths[0]),
        read-only. Computed once per row count: the scheduler asks for it several times in every step."""
        cached = self._widths_at.get(num_rows)  # type: ignore[attr-defined]
        if cached is not None:
            return cached
        all_widths = np.arange(self.widths[0], self.widths[-1] + 1)
        if num_rows > self.rows[-1]:
            seconds = self._beyond_rows(num_rows, all_widths)
        else:
            measured = [self._at_rows(self._verify[:, k], num_rows) for k in range(len(self.widths))]  # type: ignore
            seconds = np.interp(all_widths, self.widths, measured)
        seconds.flags.writeable = False
        self._widths_at[num_rows] = seconds  # type: ignore[attr-defined]
        return seconds

    def _beyond_rows(self, num_rows: int, widths: np.ndarray) -> np.ndarray:
        """A row count past the last measured one, priced by its tokens: a padded verify of R × W tokens runs its
        linears on R·W rows of activations and its attention on R·W queries, so it costs what the last measured
        row count pays for as many tokens (a wider step), and proportionally more past the widest one measured.
        Why not in proportion to rows: a 1-token step is far from compute-bound (the weights are read once for all
        rows), so scaling by rows prices plain steps too dear and wide ones too cheap, and drafting looks cheaper
        than it is exactly at the loads where it cannot pay."""
        last, widest, tokens = self.rows[-1], self.widths[-1], num_rows * widths
        equivalent = tokens / last  # the width with as many tokens at the last measured row count
        line = self._verify[-1]  # type: ignore[attr-defined]
        return np.where(equivalent <= widest, np.interp(equivalent, self.widths, line),
                        line[-1] * tokens / (last * widest))

    def verify(self, num_rows: int, width: int) -> float:
        """Seconds of a padded verify forward of ``num_rows`` rows × ``width`` tokens."""
        width = int(np.clip(width, self.widths[0], self.widths[-1]))
        return float(self.verify_widths(num_rows)[width - self.widths[0]])

    def draft(self, num_rows: int) -> float:
        """Seconds of one drafter pass for ``num_rows`` requests (0 when the profile has no drafter timings)."""
        return self._at_rows(self.draft_seconds, num_rows)

    @property
    def max_width(self) -> int:
        return self.widths[-1]

    def as_sps(self) -> SPSProfile:
        """SPS(B) for B tokens laid out in rows of ``max_width`` (as ``profile_verify_sps`` measures it)."""
        if self._sps is None:  # type: ignore[attr-defined]
            grid = default_batch_grid(self.rows[-1] * self.max_width)
            sps = [1.0 / self.verify(*verify_batch_shape(b, self.max_width)) for b in grid]
            object.__setattr__(self, "_sps", SPSProfile(tuple(grid), tuple(make_monotone(sps)),
                                                        {"source": "step-cost", **self.metadata}))
        return self._sps  # type: ignore[attr-defined]

    def __call__(self, num_tokens: int) -> float:
        return self.as_sps()(num_tokens)

    def lookup(self, num_tokens) -> np.ndarray:
        return self.as_sps().lookup(num_tokens)

    # ---- construction / persistence ----------------------------------------------------------------------
    @classmethod
    def from_sps(cls, sps: SPSProfile, max_width: int, max_rows: int | None = None) -> "StepCostProfile":
        """A step-cost view of an SPS(B) table (a user's, typically): verify(R, W) = 1/SPS(R·W), no drafter cost."""
        max_rows = max_rows or max(1, -(-sps.max_batch_tokens // max_width))
        rows = tuple(sorted({1, *[r for r in (2, 4, 8, 16, 32, 64, 128, 256) if r < max_rows], max_rows}))
        widths = tuple(range(1, max_width + 1))
        verify = tuple(tuple(1.0 / sps(r * w) for w in widths) for r in rows)
        return cls(rows, widths, verify, tuple(0.0 for _ in rows), {**sps.metadata, "derived_from": "sps"})

    def to_dict(self) -> dict:
        return {"version": CACHE_VERSION, "kind": "step-cost", "rows": list(self.rows), "widths": list(self.widths),
                "verify_seconds": [list(line) for line in self.verify_seconds],
                "draft_seconds": list(self.draft_seconds), "metadata": self.metadata}

    @classmethod
    def from_dict(cls, data: Mapping) -> "StepCostProfile":
        """The table :meth:`to_dict` wrote; a ValueError naming the field for anything else (see
        :meth:`SPSProfile.from_dict`)."""
        data = _table_object(data, cls.__name__)
        verify = data.get("verify_seconds")
        if not isinstance(verify, (list, tuple)):
            raise ValueError(f"verify_seconds must be a list of lists of finite numbers, got {_preview(verify)}")
        return cls(tuple(number_list(data.get("rows"), "rows", integers=True)),
                   tuple(number_list(data.get("widths"), "widths", integers=True)),
                   tuple(tuple(number_list(line, f"verify_seconds[{i}]")) for i, line in enumerate(verify)),
                   tuple(number_list(data.get("draft_seconds"), "draft_seconds")), _metadata(data))

    def save(self, path: str | os.PathLike) -> None:
        save_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "StepCostProfile":
        return cls.from_dict(json.loads(Path(path).read_text()))


def isotonic_fit(values: Sequence[float]) -> np.ndarray:
    """Least-squares non-decreasing fit (pool adjacent violators): one slow timing is averaged with its
    neighbours instead of raising every later entry, as a running max would."""
    blocks: list[list[float]] = []  # [mean, weight]
    for value in map(float, values):
        blocks.append([value, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, weight = blocks.pop()
            blocks[-1] = [(blocks[-1][0] * blocks[-1][1] + mean * weight) / (blocks[-1][1] + weight),
                          blocks[-1][1] + weight]
    return np.concatenate([np.full(int(weight), mean) for mean, weight in blocks]) if blocks else np.zeros(0)


def make_nondecreasing(table: np.ndarray) -> np.ndarray:
    """Non-decreasing along every axis (timing noise must not make more rows or a wider batch look cheaper):
    an isotonic fit per axis, then a running max for what fitting one axis undid on another."""
    out = np.array(table, dtype=np.float64)
    for axis in range(out.ndim):
        out = np.apply_along_axis(isotonic_fit, axis, out)
    for axis in range(out.ndim):
        out = np.maximum.accumulate(out, axis=axis)
    return out


__all__ = ["CACHE_VERSION", "SPSProfile", "StepCostProfile", "default_batch_grid", "isotonic_fit", "make_monotone",
           "make_nondecreasing", "number_list", "save_json_atomic", "verify_batch_shape"]
