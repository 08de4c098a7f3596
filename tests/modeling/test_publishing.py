"""push_to_hub reaches hub's uploader through the registry in modeling/publishing.py, and modeling imports nothing
above it (the reason the registry exists): every import in hf_dspark/modeling, lazy ones included, is checked."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import hf_dspark
from hf_dspark import DSparkDraftModel
from hf_dspark.modeling import publishing
from hf_dspark.modeling.publishing import hub_uploader, register_hub_uploader

MODELING_DIR = Path(hf_dspark.__file__).parent / "modeling"
# Layers above modeling (STYLE.md: imports point down cli > hub > evaluation > serving > generation > speculation >
# scheduling > training > modeling) and the top-level modules that load drafters. The package root itself is not
# one: configuration.py reads ``__version__``, which hf_dspark/__init__.py sets before it imports anything.
ABOVE_MODELING = {"cli", "hub", "evaluation", "serving", "generation", "speculation", "scheduling", "training",
                  "loading", "embedded"}


def _imported_hf_dspark_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module path below hf_dspark) of every import in ``path`` that leaves the modeling package."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level >= 2:  # from ..x import y: relative to hf_dspark
            found.append((node.lineno, node.module or ""))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("hf_dspark"):
            found.append((node.lineno, (node.module or "").removeprefix("hf_dspark").lstrip(".")))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.removeprefix("hf_dspark").lstrip("."))
                      for alias in node.names if alias.name.startswith("hf_dspark")]
    return found


def test_modeling_imports_nothing_above_it():
    offenders = [f"{path.name}:{line}: {module or '(package root)'}"
                 for path in sorted(MODELING_DIR.glob("*.py"))
                 for line, module in _imported_hf_dspark_modules(path)
                 if module.split(".")[0] in ABOVE_MODELING]
    assert offenders == []


def test_hub_registers_its_uploader():
    assert hub_uploader() is hf_dspark.hub.push_to_hub


def test_push_to_hub_calls_the_registered_uploader(tiny_drafter, monkeypatch):
    calls = []
    monkeypatch.setattr(publishing, "_HUB_UPLOADERS", [])
    register_hub_uploader(lambda drafter, repo_id, **kwargs: calls.append((drafter, repo_id, kwargs)) or "commit")
    assert tiny_drafter.push_to_hub("org/drafter", private=True) == "commit"
    assert calls == [(tiny_drafter, "org/drafter", {"private": True})]


def test_push_to_hub_without_an_uploader_says_what_to_import(tiny_drafter, monkeypatch):
    monkeypatch.setattr(publishing, "_HUB_UPLOADERS", [])
    with pytest.raises(RuntimeError, match=r"load the hf_dspark\.hub module"):
        tiny_drafter.push_to_hub("org/drafter")


def test_an_uploader_must_be_callable(monkeypatch):
    monkeypatch.setattr(publishing, "_HUB_UPLOADERS", [])
    with pytest.raises(TypeError, match="must be callable"):
        register_hub_uploader("hf_dspark.hub.push_to_hub")


def test_eagle3_drafters_push_through_the_same_uploader():
    from hf_dspark import Eagle3DraftModel

    assert Eagle3DraftModel.push_to_hub is DSparkDraftModel.push_to_hub


def test_save_pretrained_with_push_to_hub_uploads_through_the_registered_uploader(tiny_drafter, monkeypatch, tmp_path):
    """save_pretrained(push_to_hub=True) ran transformers' own upload: a generic model card written over ours, the
    upload tagged 'transformers' (what push_to_hub is overridden to prevent)."""
    calls = []
    monkeypatch.setattr(publishing, "_HUB_UPLOADERS", [])
    register_hub_uploader(lambda drafter, repo_id, **kwargs: calls.append((drafter, repo_id, kwargs)) or "commit")
    tiny_drafter.save_pretrained(tmp_path / "my-drafter", push_to_hub=True, commit_message="first", private=True)
    tiny_drafter.save_pretrained(tmp_path / "other", push_to_hub=True, repo_id="org/named", max_shard_size="1GB")
    assert calls == [(tiny_drafter, "my-drafter", {"commit_message": "first", "private": True}),
                     (tiny_drafter, "org/named", {"max_shard_size": "1GB"})]
    assert {path.name for path in (tmp_path / "my-drafter").iterdir()} == {"config.json", "model.safetensors"}
    loaded = DSparkDraftModel.from_pretrained(tmp_path / "my-drafter")
    assert all(loaded.state_dict()[name].equal(tensor) for name, tensor in tiny_drafter.state_dict().items())
