"""hf-dspark: DSpark speculative decoding for Hugging Face transformers."""

from .version import __version__

from transformers import AutoConfig, AutoModel

from . import hub  # noqa: F401 (registers the uploader behind DSparkDraftModel.push_to_hub; see modeling/publishing.py)
from .cpu_kernels import loop_kernels, skinny_linears
from .embedded import load_default_drafter, load_default_target
from .generation import disable, enable
from .metrics import DSparkStats
from .modeling import DraftBlock, DraftCache, DSparkConfig, DSparkDraftModel, Eagle3DraftModel
from .serving import DSparkEngine

AutoConfig.register(DSparkConfig.model_type, DSparkConfig, exist_ok=True)
AutoModel.register(DSparkConfig, DSparkDraftModel, exist_ok=True)

__all__ = [
    "__version__",
    "DSparkConfig",
    "DSparkDraftModel",
    "DSparkEngine",
    "Eagle3DraftModel",
    "DraftBlock",
    "DraftCache",
    "DSparkStats",
    "load_default_target",
    "load_default_drafter",
    "enable",
    "disable",
    "loop_kernels",
    "skinny_linears",
]
