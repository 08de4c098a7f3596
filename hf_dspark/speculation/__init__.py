"""The core ``generate`` and the serving engine share: one speculative round and what it is made of.

    round.py          propose -> choose widths -> one target forward -> verify -> commit (``SpeculativeRound``)
    builder.py        how generate and the engine assemble a round (policy, proposers, cost), in one place
    proposals.py      lookup and drafter proposals assembled into one draft tensor
    verification.py   accept / recover / bonus (lossless for greedy and sampling)
    lookup.py         training-free drafts copied from the context and earlier calls; lookup_calibration.py
    ragged_batch.py   rows of different lengths in one batch (their target cache: ``hf_dspark.kv_cache``)
    row_tokens.py     each row's tokens; processing.py transformers' logits processors per row
    prefix_cache.py   a finished call's caches kept for the next call that shares its prefix
    shared_state.py   what calls on one target share (per cache salt), and who may share it
"""

from .round import RoundResult, SpeculativeRound
from .verification import PLACEHOLDER_TOKEN_ID, VerificationResult, verify

__all__ = ["PLACEHOLDER_TOKEN_ID", "RoundResult", "SpeculativeRound", "VerificationResult", "verify"]
