from . import unbound_targets  # noqa: F401 (guards transformers' generate on targets never bound)
from .generate import dspark_decode
from .integration import disable, enable
from .verification import PLACEHOLDER_TOKEN_ID, VerificationResult, verify

__all__ = ["dspark_decode", "enable", "disable", "verify", "VerificationResult", "PLACEHOLDER_TOKEN_ID"]
