"""transformers glue: ``target.generate(..., assistant_model=draft)`` runs hf-dspark's speculative loop."""

from . import unbound_targets  # noqa: F401 (guards transformers' generate on targets never bound)
from .generate import dspark_decode
from .integration import disable, enable

__all__ = ["dspark_decode", "enable", "disable"]
