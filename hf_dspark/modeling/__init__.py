from .configuration import DSparkConfig, default_target_layer_ids
from .eagle3 import Eagle3DraftModel
from .modeling import DraftBlock, DraftCache, DSparkDraftModel

__all__ = ["DSparkConfig", "DSparkDraftModel", "Eagle3DraftModel", "DraftBlock", "DraftCache",
           "default_target_layer_ids"]
