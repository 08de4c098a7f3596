"""push_to_hub sends exactly config + safetensors + generated card; a Hub-cache copy loads offline by repo id.

No Hub is reachable: HfApi's network methods are replaced by recorders that capture the folder being uploaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
import yaml
from conftest import make_tiny_drafter, make_tiny_llama
from safetensors.torch import load_file

from hf_dspark import DSparkDraftModel
from hf_dspark.hub import DraftCardInfo

REPO_ID = "org/tiny-dspark"
PROMPT = torch.tensor([[1, 5, 9, 22, 7, 3]])


class HubRecorder:
    """Stands in for the Hub: records create_repo calls and the files each upload_folder call would send."""

    def __init__(self, monkeypatch):
        self.repos, self.uploads = [], []
        recorder = self

        def create_repo(api, repo_id, *, private=None, token=None, exist_ok=False, **kwargs):
            recorder.repos.append({"repo_id": repo_id, "private": private, "exist_ok": exist_ok})
            return SimpleNamespace(repo_id=repo_id)

        def upload_folder(api, *, repo_id, folder_path, **kwargs):
            files = {p.relative_to(folder_path).as_posix(): p.read_bytes()
                     for p in Path(folder_path).rglob("*") if p.is_file()}
            recorder.uploads.append({"repo_id": repo_id, "files": files, **kwargs})
            return f"https://huggingface.co/{repo_id}/commit/{'0' * 40}"

        def refuse(api, *args, **kwargs):
            raise AssertionError("unexpected Hub call")

        monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
        monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
        monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", refuse)
        monkeypatch.setattr(huggingface_hub.HfApi, "upload_file", refuse)


@pytest.fixture(scope="module")
def target():
    model = make_tiny_llama()
    model.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    return model


@pytest.fixture(scope="module")
def draft(target):
    return make_tiny_drafter(target, seed=2, block_size=5, markov_rank=16)


@pytest.fixture
def pushed(draft, monkeypatch):
    hub = HubRecorder(monkeypatch)
    info = DraftCardInfo(evaluation={"gsm8k": {"tau": 2.5}})
    commit = draft.push_to_hub(REPO_ID, info=info, private=True, commit_message="first drafter", revision="main")
    assert commit.endswith("0" * 40)
    assert hub.repos == [{"repo_id": REPO_ID, "private": True, "exist_ok": True}]
    assert len(hub.uploads) == 1
    return hub.uploads[0]


def test_upload_sends_exactly_config_weights_and_card(pushed):
    assert set(pushed["files"]) == {"config.json", "model.safetensors", "README.md"}
    assert pushed["repo_id"] == REPO_ID
    assert pushed["commit_message"] == "first drafter" and pushed["revision"] == "main"


def test_uploaded_weights_are_the_drafters_and_nothing_of_the_target(pushed, draft, tmp_path):
    (tmp_path / "w.safetensors").write_bytes(pushed["files"]["model.safetensors"])
    weights = load_file(tmp_path / "w.safetensors")
    assert weights.keys() == draft.state_dict().keys()
    assert not any("embed_tokens" in name or "lm_head" in name for name in weights)
    for name, tensor in draft.state_dict().items():
        assert torch.equal(weights[name], tensor), name
    config = json.loads(pushed["files"]["config.json"])
    assert config["model_type"] == "dspark_drafter" and config["block_size"] == 5


def test_uploaded_card_is_the_generated_one(pushed):
    text = pushed["files"]["README.md"].decode()
    meta = yaml.safe_load(text.split("---\n")[1])
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert meta["library_name"] == "hf-dspark" and meta["pipeline_tag"] == "text-generation"
    assert {"speculative-decoding", "dspark", "draft-model", "transformers"} <= set(meta["tags"])
    assert f'DSparkDraftModel.from_pretrained("{REPO_ID}", target=target)' in text
    assert "| gsm8k | 2.50 |" in text


def write_hub_cache(root: Path, repo_id: str, files: dict[str, bytes], commit: str = "a1b2c3d4" * 5) -> Path:
    """The layout huggingface_hub's cache uses: models--org--name/{refs/main, snapshots/<commit>/...}."""
    repo_dir = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def offline_hub_cache(pushed, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    write_hub_cache(cache, REPO_ID, pushed["files"])
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))  # read at import time otherwise
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_cache_copy_loads_offline_by_repo_id(offline_hub_cache, draft, target):
    loaded = DSparkDraftModel.from_pretrained(REPO_ID, target=target)
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    expected = target.generate(PROMPT, max_new_tokens=16, do_sample=False)
    assert torch.equal(target.generate(PROMPT, max_new_tokens=16, do_sample=False, assistant_model=loaded), expected)


def test_hub_cache_copy_in_a_subfolder_loads_by_repo_id_and_subfolder(pushed, draft, target, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snapshot = write_hub_cache(cache, REPO_ID, {})
    (snapshot / "drafter").mkdir()
    for name, data in pushed["files"].items():
        (snapshot / "drafter" / name).write_bytes(data)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    loaded = DSparkDraftModel.from_pretrained(REPO_ID, subfolder="drafter", target=target)
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_repo_missing_from_the_offline_cache_is_a_clear_error(offline_hub_cache, target):
    with pytest.raises(FileNotFoundError, match="local Hugging Face cache \\(offline mode\\)"):
        DSparkDraftModel.from_pretrained("org/not-cached", target=target)
