"""How ``DSparkDraftModel.push_to_hub`` uploads a drafter, without modeling importing hub.

The upload with a generated model card is ``hf_dspark.hub.push_to_hub``: the card is rendered from the drafter's
config and from the files training, evaluation and calibration write, so it builds on layers above modeling, and
modeling never imports those. Hub therefore registers its uploader here when it is imported, the way generation
fills ``TARGET_BIND_HOOKS``; ``hf_dspark/__init__.py`` imports hub, so any drafter a user holds can be pushed.
Why override transformers' ``push_to_hub`` at all: it writes a generic card (or keeps the remote one) over ours.
"""

from __future__ import annotations

from collections.abc import Callable

# At most one entry: (drafter, repo_id, **kwargs) -> the Hub's CommitInfo. A list, so registering fills it in place
# instead of rebinding a module global.
_HUB_UPLOADERS: list[Callable] = []


def register_hub_uploader(upload: Callable) -> None:
    """Make ``upload`` what ``DSparkDraftModel.push_to_hub`` calls; ``hf_dspark.hub`` registers its own at import
    (registering again, e.g. from a reloaded hub, replaces it)."""
    if not callable(upload):
        raise TypeError(f"A Hub uploader must be callable (drafter, repo_id, **kwargs), got {type(upload).__name__}.")
    _HUB_UPLOADERS[:] = [upload]


def hub_uploader() -> Callable:
    """The registered uploader; raises when hub was never imported (it always is after ``import hf_dspark``)."""
    if not _HUB_UPLOADERS:
        raise RuntimeError("No Hub uploader is registered: load the hf_dspark.hub module before calling push_to_hub "
                           "(importing the hf_dspark package does).")
    return _HUB_UPLOADERS[0]
