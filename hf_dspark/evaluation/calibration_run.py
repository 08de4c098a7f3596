"""The STS calibration flow (``hf-dspark calibrate``): held-out rounds -> temperatures -> calibrated drafter.

1. run the drafter on held-out prompts (never the evaluation sets: :class:`EvalOverlapGuard` refuses them) at
   the serving temperature with confidence threshold 0, recording every round's raw confidence logits z_k and
   accepted prefix length (real rejection sampling, so the labels are what serving will see);
2. fit one temperature per position with STS (``training.calibration.fit_sts``, paper §3.2.1), by default
   together with a per-position offset (``fit_sts_with_offsets``: temperatures alone cannot move a head whose
   logits sit on one side of 0, see ``training.calibration``);
3. save the drafter with ``confidence_temperatures`` (and ``confidence_offsets``) in its config — the
   ``greedy_`` ones for a fit at T = 0 — plus ECE / AUC per position before and after (markdown, JSON,
   reliability PNG) and the raw rounds.

The math lives in ``training/calibration.py``; this module only gathers the data and writes the results.
Temperatures are fitted for one serving temperature (the acceptance process differs between greedy and
sampling); calibrate at the temperature you serve with. A drafter holds one greedy fit and one sampling fit.
"""

from __future__ import annotations

import json
import logging
import os
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..training.calibration import PositionCalibration, calibration_report, fit_calibration, split_half_ece
from ..training.prompts import EvalOverlapGuard, Prompt, PromptFileError, read_prompts
from .benchmarks import default_eval_dir
from .harness import record_rounds
from .recorder import RoundTrace
from .report import calibration_table, to_json_safe, write_reliability

logger = logging.getLogger(__name__)


@dataclass
class CalibrationRun:
    """Fitted per-position temperatures (and offsets), the before/after report and the rounds they came from."""

    temperatures: list[float]
    report: list[PositionCalibration]
    trace: RoundTrace
    serving_temperature: float | None = None
    num_prompts: int | None = None
    offsets: list[float] | None = None  # None = temperatures only (the paper's STS)
    split_half_ece: list[float] | None = None  # out-of-sample ECE per position (see training.calibration)
    split_half_noise_floor: list[float] | None = None  # what a perfectly calibrated head would score there

    def to_dict(self) -> dict:
        return {"confidence_temperatures": self.temperatures, "confidence_offsets": self.offsets,
                "serving_temperature": self.serving_temperature,
                "num_prompts": self.num_prompts, "num_rounds": len(self.trace),
                "split_half_ece": self.split_half_ece, "split_half_noise_floor": self.split_half_noise_floor,
                "positions": [p.to_dict() for p in self.report]}

    def to_markdown(self) -> str:
        form = "σ(z_i/T_i + b_i)" if self.offsets is not None else "σ(z_i/T_i)"
        source = f"{self.num_prompts} prompts" if self.num_prompts is not None else "refitted from recorded rounds"
        head = (f"STS calibration on {len(self.trace)} held-out rounds ({source}, serving "
                f"T={self.serving_temperature}); ECE/AUC of the joint survival a_k = Π {form} per position "
                "(in-sample: fitted and scored on the same rounds).")
        label = "held-out" if self.serving_temperature is None else f"T={self.serving_temperature:g}"
        text = head + "\n\n" + calibration_table({label: self.report}) + "\n"
        if self.split_half_ece is not None:
            text += ("\nOut-of-sample ECE after STS (fit on one half of the rounds, scored on the other, both ways): "
                     + ", ".join(f"position {k + 1} {100 * e:.1f}%" for k, e in enumerate(self.split_half_ece))
                     + ".\n")
        if self.split_half_noise_floor is not None:
            text += ("\nNoise floor of those scores (the ECE a perfectly calibrated head would show on the same "
                     "rounds, mean of 200 label draws; an ECE near it is sampling noise, not miscalibration): "
                     + ", ".join(f"position {k + 1} {100 * e:.1f}%" for k, e in enumerate(self.split_half_noise_floor))
                     + ".\n")
        return text


def held_out_prompts(path: str | os.PathLike, num: int | None = None) -> list[Prompt]:
    """The last ``num`` records of a prompt file (any format ``read_prompts`` accepts).

    The default calibration set is the tail of the regenerated training data: build the target cache from the
    leading records only (``hf-dspark cache --limit``) so the tail stays unseen by the trainer. A file without
    prompts raises :class:`PromptFileError` here, before any model loads (it failed after the target had loaded)."""
    prompts = read_prompts(path)
    if not prompts:
        raise PromptFileError(f"{path} holds no prompts to calibrate on (records with 'turns', 'messages', "
                              "'conversations', 'prompt', 'instruction' or 'question').")
    return prompts[-num:] if num else prompts


def _overlap_guard(eval_dir: str | os.PathLike | None) -> EvalOverlapGuard | None:
    directory = Path(eval_dir) if eval_dir is not None else default_eval_dir()
    if not directory.is_dir():
        if eval_dir is not None:
            raise FileNotFoundError(f"evaluation folder {directory} not found (needed to refuse eval overlap)")
        logger.warning("no evaluation folder at %s: cannot check calibration prompts for eval overlap", directory)
        return None
    return EvalOverlapGuard.from_dir(directory)


def load_rounds_for(drafter, path: str | os.PathLike) -> RoundTrace:
    """The rounds an earlier run recorded (``calibration_rounds.npz``), refused unless ``drafter`` could have
    recorded them: a refit reuses their raw confidence logits, which only that drafter produces. A file that is
    not such rounds raises ValueError naming it (numpy's own "contains pickled (object) data" named neither the
    file nor what it should hold)."""
    try:
        trace = RoundTrace.load(path)
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as err:
        raise ValueError(f"{path} is not the calibration_rounds.npz of an hf-dspark calibrate run ({err}).") from None
    if trace.block_size != drafter.config.block_size:
        raise ValueError(f"{path} holds rounds of block size {trace.block_size}, the drafter drafts "
                         f"{drafter.config.block_size}: they were not recorded with this drafter")
    return trace


def fit_from_trace(trace: RoundTrace, grid=None, serving_temperature: float | None = None,
                   num_prompts: int | None = None, offsets: bool = True, offset_grid=None) -> CalibrationRun:
    """STS on recorded rounds (the offline half of :func:`calibrate`); ``offsets=False`` fits temperatures only."""
    if not trace.has_confidence:
        raise ValueError("no confidence logits in the rounds: STS needs a drafter with a confidence head "
                         "(use_confidence_head=True)")
    temps, shifts = fit_calibration(trace.confidence_logits, trace.num_accepted, trace.num_proposed, offsets=offsets,
                                    grid=grid, offset_grid=offset_grid)
    report = calibration_report(trace.confidence_logits, trace.num_accepted, trace.num_proposed, temperatures=temps,
                                offsets=shifts)
    held_out, floor = None, None
    if len(trace) >= 2:
        held_out, floor = (x.tolist() for x in split_half_ece(
            trace.confidence_logits, trace.num_accepted, trace.num_proposed, offsets=offsets, grid=grid,
            offset_grid=offset_grid, return_noise_floor=True))
    return CalibrationRun(temps, report, trace, serving_temperature, num_prompts, shifts, held_out, floor)


def calibrate(target, tokenizer, drafter, prompts: Sequence[Prompt | str], *, temperature: float = 1.0,
              max_new_tokens: int = 256, batch_size: int = 1, seed: int = 0,
              eval_dir: str | os.PathLike | None = None, grid=None, progress: bool = True,
              offsets: bool = True) -> CalibrationRun:
    """Record held-out rounds at the serving ``temperature`` and fit STS temperatures.

    ``prompts`` are checked against the evaluation prompts in ``eval_dir`` (default: the shared eval folder)
    and refused on overlap. The drafter is not modified: pass the result to :func:`save_calibrated`, or set
    ``drafter.config.confidence_temperatures = run.temperatures`` (and ``confidence_offsets = run.offsets``;
    the ``greedy_`` fields for ``temperature=0``) to use it in memory. ``offsets=False`` fits the paper's
    temperatures only."""
    if drafter.confidence_head is None:
        raise ValueError("this drafter has no confidence head, so there is nothing to calibrate "
                         "(DFlash-style drafters verify every draft)")
    prompts = [p if isinstance(p, Prompt) else Prompt((str(p),)) for p in prompts]
    if not prompts:
        raise ValueError("calibration needs at least one held-out prompt")
    guard = _overlap_guard(eval_dir)
    if guard is not None:
        guard.raise_if_overlapping(prompts)
    trace = record_rounds(target, tokenizer, drafter, [p.first_turn for p in prompts], temperature=temperature,
                          max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed, tag="calibration",
                          progress=progress)
    if not len(trace):
        raise ValueError("the calibration prompts produced no verification rounds; raise max_new_tokens")
    logger.info("calibration: %d rounds from %d prompts at T=%g (tau %.2f)", len(trace), len(prompts), temperature,
                trace.tau)
    return fit_from_trace(trace, grid=grid, serving_temperature=temperature, num_prompts=len(prompts),
                          offsets=offsets)


def save_calibrated(drafter, run: CalibrationRun, out_dir: str | os.PathLike, plots: bool = True) -> dict[str, str]:
    """Save the drafter with the fit in its config to ``out_dir`` (the passed drafter is left as it was), plus
    calibration.md / .json, rounds.npz and reliability.png.

    A fit on greedy rounds (serving temperature 0) goes to ``greedy_confidence_temperatures`` / ``_offsets`` and
    one on sampled rounds to ``confidence_temperatures`` / ``_offsets``; the other mode's fit is kept, so a
    drafter calibrated twice (T = 0 and the sampling temperature) is calibrated for both."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = drafter.config
    greedy = run.serving_temperature == 0
    names = (("greedy_confidence_temperatures", "greedy_confidence_offsets") if greedy
             else ("confidence_temperatures", "confidence_offsets"))
    saved = tuple(getattr(config, name, None) for name in names)
    setattr(config, names[0], list(run.temperatures))
    setattr(config, names[1], list(run.offsets) if run.offsets is not None else None)
    try:
        drafter.save_pretrained(out)
    finally:
        for name, value in zip(names, saved):
            setattr(config, name, value)
    written = {"drafter": out, "markdown": out / "calibration.md", "json": out / "calibration.json"}
    written["markdown"].write_text(run.to_markdown(), encoding="utf-8")
    written["json"].write_text(json.dumps(to_json_safe(run.to_dict()), indent=2), encoding="utf-8")
    written["rounds"] = run.trace.save(out / "calibration_rounds.npz")
    if plots:
        written["reliability"] = write_reliability(run.report, out / "reliability.png",
                                                   title=f"STS calibration, T={run.serving_temperature}")
    logger.info("calibrated drafter written to %s (temperatures %s%s)", out,
                " ".join(f"{t:.3f}" for t in run.temperatures),
                "; offsets " + " ".join(f"{b:+.2f}" for b in run.offsets) if run.offsets is not None else "")
    return {k: str(v) for k, v in written.items()}


__all__ = ["CalibrationRun", "calibrate", "fit_from_trace", "held_out_prompts", "save_calibrated"]
