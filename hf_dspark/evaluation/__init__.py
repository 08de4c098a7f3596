"""Evaluation: τ and speedup per benchmark (harness) and the paper-style figures (plots.py, matplotlib optional)."""

from .plots import plot_position_acceptance, plot_reliability, plot_threshold_sweep, plot_throughput_frontier

__all__ = ["plot_position_acceptance", "plot_reliability", "plot_threshold_sweep", "plot_throughput_frontier"]
