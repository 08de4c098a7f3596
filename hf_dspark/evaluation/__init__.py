"""Evaluation: τ and speedup per benchmark (harness), per-round recording, STS calibration runs, and the
paper-style figures (plots.py, matplotlib optional)."""

from .calibration_run import CalibrationRun, calibrate, save_calibrated
from .harness import BenchmarkResult, EvalResult, evaluate
from .plots import plot_position_acceptance, plot_reliability, plot_threshold_sweep, plot_throughput_frontier
from .recorder import RoundRecorder, RoundTrace

__all__ = [
    "BenchmarkResult",
    "CalibrationRun",
    "EvalResult",
    "RoundRecorder",
    "RoundTrace",
    "calibrate",
    "evaluate",
    "plot_position_acceptance",
    "plot_reliability",
    "plot_threshold_sweep",
    "plot_throughput_frontier",
    "save_calibrated",
]
