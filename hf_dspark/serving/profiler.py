"""SPS(B): verify steps per second as a function of the verify batch size B (tokens), measured on this machine.

The scheduler trades expected accepted tokens against step time, so it needs the real cost curve of the
target's verify forward: flat while the hardware is latency-bound (verifying more is almost free), falling
once it is compute-bound. The paper profiles it once at engine start and looks it up in O(1); so do we, and
cache the table on disk because profiling a real target takes seconds to minutes.

``SPSProfile`` is the table; ``profile_verify_sps`` measures it (or returns a cached / user-supplied one).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

_CACHE_VERSION = 1
_CACHE_SUBDIR = "sps"


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
        return {"version": _CACHE_VERSION, "batch_tokens": list(self.batch_tokens),
                "steps_per_second": list(self.steps_per_second), "metadata": self.metadata}

    @classmethod
    def from_dict(cls, data: Mapping) -> "SPSProfile":
        return cls(tuple(data["batch_tokens"]), tuple(data["steps_per_second"]), dict(data.get("metadata", {})))

    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)  # atomic: a concurrent reader never sees half a file

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SPSProfile":
        return cls.from_dict(json.loads(Path(path).read_text()))


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


# ---------------------------------------------------------------------------------------------------------
# Measuring the target
# ---------------------------------------------------------------------------------------------------------
def profile_cache_key(target, batch_tokens: Sequence[int], *, context_len: int, row_len: int, dtype: torch.dtype,
                      device: torch.device | str, repeats: int) -> str:
    """Hash of everything that changes the curve: model identity + config, dtype, device, CPU threads, grid."""
    config = target.config.to_json_string(use_diff=False) if hasattr(target.config, "to_json_string") else ""
    ident = {"name": getattr(target.config, "_name_or_path", "") or type(target).__name__,
             "config": hashlib.sha256(config.encode()).hexdigest(), "dtype": str(dtype), "device": str(device),
             "threads": torch.get_num_threads(), "grid": list(batch_tokens), "context_len": context_len,
             "row_len": row_len, "repeats": repeats, "torch": torch.__version__, "version": _CACHE_VERSION}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


def verify_batch_shape(num_tokens: int, row_len: int) -> tuple[int, int]:
    """(rows, tokens per row) for B verify tokens split as evenly as possible into rows of ≤ row_len (= 1 + γ),
    the way an engine step lays out requests; rows·len ≥ B by less than one row."""
    rows = -(-num_tokens // row_len)
    return rows, -(-num_tokens // rows)


@torch.inference_mode()
def time_verify_forward(target, num_tokens: int, *, context_len: int, row_len: int, repeats: int,
                        device: torch.device, generator: torch.Generator) -> float:
    """Median wall time (s) of one verify forward over B tokens on top of a prefilled KV cache of context_len."""
    from transformers import DynamicCache

    rows, length = verify_batch_shape(num_tokens, row_len)
    vocab = target.config.get_text_config().vocab_size
    context = torch.randint(0, vocab, (1, context_len), generator=generator).to(device)
    cache = DynamicCache(config=target.config)
    cache_kwarg = _cache_kwarg(target)
    target(input_ids=context, use_cache=True, **{cache_kwarg: cache})
    cache.batch_repeat_interleave(rows)
    ids = torch.randint(0, vocab, (rows, length), generator=generator).to(device)
    positions = (context_len + torch.arange(length, device=device)).expand(rows, -1)
    times = []
    for i in range(repeats + 1):  # the first forward is a warm-up and is not timed
        _synchronize(device)
        start = time.perf_counter()
        target(input_ids=ids, position_ids=positions, use_cache=True, **{cache_kwarg: cache})
        _synchronize(device)
        if i:
            times.append(time.perf_counter() - start)
        cache.crop(-length)  # transformers >= 5.24: negative = number of tokens to drop
    return statistics.median(times)


def _cache_kwarg(target) -> str:
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns until 5.40)."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_verify_sps(target, batch_token_sizes: Sequence[int] | None = None, *, max_batch_tokens: int = 256,
                       context_len: int = 256, row_len: int = 8, repeats: int = 5,
                       user_table: Mapping[int, float] | Sequence[tuple[int, float]] | SPSProfile | None = None,
                       cache_dir: str | os.PathLike | None = None, use_cache: bool = True,
                       seed: int = 0) -> SPSProfile:
    """SPS(B) of ``target``'s verify forward on this machine, made monotone non-increasing (running min).

    ``user_table`` wins when given (no measuring). Otherwise a cached table for the same model/config, dtype,
    device, thread count and grid is reused from ``<cache_dir or hf_dspark cache>/sps/``; else each B in the
    grid is timed (median of ``repeats`` after a warm-up) and the result cached. Dtype and device are the
    target's own.
    """
    if user_table is not None:
        return user_table if isinstance(user_table, SPSProfile) else SPSProfile.from_user_table(user_table)
    grid = sorted(set(int(b) for b in (batch_token_sizes or default_batch_grid(max_batch_tokens))))
    if not grid or grid[0] < 1:
        raise ValueError(f"batch_token_sizes must be positive integers, got {batch_token_sizes}")
    param = next(target.parameters())
    dtype, device = param.dtype, param.device
    key = profile_cache_key(target, grid, context_len=context_len, row_len=row_len, dtype=dtype, device=device,
                            repeats=repeats)
    path = _cache_root(cache_dir) / f"{key}.json"
    if use_cache and path.is_file():
        try:
            profile = SPSProfile.load(path)
            logger.info("SPS profile: cache hit %s (%d sizes, B=%d..%d)", path, len(grid), grid[0], grid[-1])
            return SPSProfile(profile.batch_tokens, profile.steps_per_second, {**profile.metadata, "source": "cache"})
        except (ValueError, KeyError, json.JSONDecodeError) as err:
            logger.warning("SPS profile: ignoring unreadable cache file %s (%s); re-profiling", path, err)
    profile = _measure(target, grid, context_len=context_len, row_len=row_len, repeats=repeats, device=device,
                       seed=seed)
    profile.metadata.update(key=key, dtype=str(dtype), device=str(device), threads=torch.get_num_threads())
    if use_cache:
        profile.save(path)
        logger.info("SPS profile cached at %s", path)
    return profile


def _measure(target, grid: list[int], *, context_len: int, row_len: int, repeats: int, device: torch.device,
             seed: int) -> SPSProfile:
    was_training = target.training
    target.eval()
    generator = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    seconds = []
    try:
        # A global warm-up first: the very first forwards of a process pay one-off allocation / kernel
        # selection costs that would otherwise make small B look slow and, via the running min, drag the
        # whole curve down.
        time_verify_forward(target, grid[-1], context_len=context_len, row_len=row_len, repeats=1, device=device,
                            generator=generator)
        for num_tokens in grid:
            seconds.append(time_verify_forward(target, num_tokens, context_len=context_len, row_len=row_len,
                                               repeats=repeats, device=device, generator=generator))
            logger.debug("SPS profile: B=%d %.2f ms", num_tokens, 1e3 * seconds[-1])
    finally:
        target.train(was_training)
    raw = [1.0 / s for s in seconds]
    sps = make_monotone(raw)
    logger.info("SPS profile: %d sizes B=%d..%d in %.1fs; SPS(%d)=%.1f/s, SPS(%d)=%.1f/s", len(grid), grid[0],
                grid[-1], time.perf_counter() - start, grid[0], sps[0], grid[-1], sps[-1])
    return SPSProfile(tuple(grid), tuple(sps), {"source": "measured", "raw_steps_per_second": raw,
                                                "context_len": context_len, "row_len": row_len,
                                                "repeats": repeats})


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is None:
        from ..embedded import default_cache_dir

        cache_dir = default_cache_dir()
    return Path(cache_dir) / _CACHE_SUBDIR


__all__ = ["SPSProfile", "default_batch_grid", "make_monotone", "profile_cache_key", "profile_verify_sps",
           "time_verify_forward", "verify_batch_shape"]
