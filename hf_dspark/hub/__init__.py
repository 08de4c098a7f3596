"""Sharing drafters: Hub uploads with generated model cards, and export to the speculators / vLLM format.

Importing hub registers :func:`push_to_hub` as what ``DSparkDraftModel.push_to_hub`` calls (see
``modeling/publishing.py``); ``hf_dspark/__init__.py`` imports it.
"""

from .describe import CheckpointReport, describe_checkpoint
from .export import SpeculatorsExportError, convert_checkpoint, save_as_speculators, speculators_export_problems
from .model_card import DraftCardInfo, read_calibration, read_evaluation, render_model_card, summarize_training
from .upload import push_to_hub, save_for_hub

__all__ = [
    "CheckpointReport",
    "DraftCardInfo",
    "SpeculatorsExportError",
    "convert_checkpoint",
    "describe_checkpoint",
    "push_to_hub",
    "read_calibration",
    "read_evaluation",
    "render_model_card",
    "save_as_speculators",
    "save_for_hub",
    "speculators_export_problems",
    "summarize_training",
]
