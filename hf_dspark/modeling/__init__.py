from .configuration import DSparkConfig, default_target_layer_ids
from .modeling import DraftBlock, DraftCache, DSparkDraftModel

__all__ = ["DSparkConfig", "DSparkDraftModel", "DraftBlock", "DraftCache", "default_target_layer_ids"]
