"""Publishing a drafter: save config + safetensors + generated card, then upload the folder in one commit.

Why not transformers' ``push_to_hub``: it writes a generic card (or keeps the remote one) over any README we save,
and tags the upload as ``transformers``. Here the card is regenerated from the drafter on every push, so it never
drifts from the weights it describes.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from ..modeling.publishing import register_hub_uploader
from .model_card import DraftCardInfo, render_model_card

logger = logging.getLogger(__name__)

CARD_NAME = "README.md"


def save_for_hub(draft, out_dir: str | os.PathLike, *, info: DraftCardInfo | None = None, repo_id: str | None = None,
                 tags: list[str] | None = None, template: str | os.PathLike | None = None,
                 max_shard_size: int | str = "5GB") -> Path:
    """Write exactly what :func:`push_to_hub` uploads (config.json, safetensors, README.md) to ``out_dir``."""
    out = Path(out_dir)
    card = render_model_card(draft, info, repo_id=repo_id, tags=tags, template=template)
    draft.save_pretrained(out, max_shard_size=max_shard_size)
    card.save(str(out / CARD_NAME))
    return out


class UploadError(OSError):
    """The Hub refused or could not be reached (no token, no network, no permission): the message says which."""


def push_to_hub(draft, repo_id: str, *, info: DraftCardInfo | None = None, commit_message: str | None = None,
                commit_description: str | None = None, private: bool | None = None, token: bool | str | None = None,
                revision: str | None = None, create_pr: bool = False, max_shard_size: int | str = "5GB",
                tags: list[str] | None = None, template: str | os.PathLike | None = None):
    """Create ``repo_id`` if needed and upload the drafter with its generated model card; returns the CommitInfo.

    The target's embedding and LM head are never uploaded (the drafter uses its target's own).
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HTTPError  # the HTTP client's base error (httpx's is no OSError)

    from ..version import __version__

    api = HfApi(library_name="hf-dspark", library_version=__version__, token=token)
    try:
        repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
        with tempfile.TemporaryDirectory() as tmp:
            save_for_hub(draft, tmp, info=info, repo_id=repo_id, tags=tags, template=template,
                         max_shard_size=max_shard_size)
            logger.info("Uploading %s to %s", sorted(os.listdir(tmp)), repo_id)
            return api.upload_folder(repo_id=repo_id, folder_path=tmp,
                                     commit_message=commit_message or "Upload DSpark drafter",
                                     commit_description=commit_description, token=token, revision=revision,
                                     create_pr=create_pr)
    except FileNotFoundError:
        raise  # a local file (the card template), not the Hub: reported as it is
    except OSError as err:  # the Hub client's errors (token, network, permission, offline mode) are OSErrors
        raise UploadError(f"uploading to {repo_id} failed: {_first_line(err)} Log in (hf auth login) or pass "
                          "--token / token=, and check the network and your write access to the repository.") from err
    except HTTPError as err:  # the HTTP client's own: DNS, refused connection, timeout
        raise UploadError(f"uploading to {repo_id} failed: could not reach the Hub ({_first_line(err)}): check the "
                          "network (and HF_ENDPOINT, if set) and try again.") from err


def _first_line(err: BaseException) -> str:
    return next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)


# DSparkDraftModel.push_to_hub uploads through this (modeling/publishing.py says why it is registered, not imported).
register_hub_uploader(push_to_hub)
