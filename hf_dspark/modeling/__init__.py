from .configuration import DSparkConfig, default_target_layer_ids
from .draft_cache import DraftCache
from .drafting import DraftBlock
from .eagle3 import Eagle3DraftModel
from .modeling import DSparkDraftModel

__all__ = ["DSparkConfig", "DSparkDraftModel", "Eagle3DraftModel", "DraftBlock", "DraftCache",
           "default_target_layer_ids"]
