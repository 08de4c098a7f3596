"""describe_checkpoint: what a checkpoint is and what loads / exports / is refused, without loading its weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_llama, make_tiny_qwen3

from hf_dspark import DSparkDraftModel
from hf_dspark.hub import describe_checkpoint, save_as_speculators

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspec"
SHIPPED = Path(__file__).resolve().parents[2] / "hf_dspark" / "checkpoints" / "smollm2-135m-instruct-dspark"


def facts(report) -> dict[str, str]:
    return dict(report.facts)


def test_deepspec_rnn_checkpoint():
    report = describe_checkpoint(FIXTURES / "dspark_rnn")
    f = facts(report)
    assert report.loads and report.dialect == "deepspec"
    assert f["heads"].startswith("sequential rnn (rank 8); confidence head")
    assert f["vocabulary"] == "the target's full vocabulary (96 tokens)"
    assert f["taps"].startswith("decoder layers [0, 2] of 4 (hidden_states[i + 1])")
    assert f["block"].startswith("DeepSpec (the anchor slot predicts)") and "5 drafts per round" in f["block"]
    assert "full (draft) vocabulary" in f["drafting"]
    assert "embed_tokens.weight, lm_head.weight" in f["tensors"]
    assert report.export and not report.export_speculators_only  # rnn: speculators library only
    text = str(report)
    assert "to the speculators library only" in text and "vanilla Markov head" in text


def test_reduced_vocabulary_speculators_export(tmp_path):
    target = make_tiny_qwen3()
    torch.manual_seed(0)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=4, markov_rank=8,
                                         draft_vocab=list(range(10, 50)))
    save_as_speculators(draft, tmp_path, verifier_name_or_path="org/target")
    f = facts(describe_checkpoint(tmp_path))
    assert f["vocabulary"].startswith("reduced: 40 of 96 target tokens, read from d2t+t2d")
    assert "aux_hidden_state_layer_ids = decoder layer + 1" in f["taps"]
    assert "d2t, lm_head.weight, t2d" in f["tensors"] and f["target"] == "org/target"


def test_transformers_dflash_assistant_needs_its_target(tmp_path):
    pytest.importorskip("transformers.models.muse_glimmer_assistant")
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    cfg = MuseGlimmerAssistantConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, layer_types=["full_attention"],
                                     mask_token_id=95, target_layer_ids=[0, 2])
    MuseGlimmerAssistantModel(cfg).save_pretrained(tmp_path)
    refused = describe_checkpoint(tmp_path)
    assert not refused.loads and refused.dialect == "transformers-dflash" and "pass target=" in refused.refused
    report = describe_checkpoint(tmp_path, target=make_tiny_qwen3())
    assert report.loads and not report.export  # upstream-convention DFlash: vLLM's dflash method
    assert "upstream DFlash (the anchor slot predicts nothing" in facts(report)["block"]
    assert "15 drafts per round" in facts(report)["block"]
    assert "--verifier" in str(report)


def test_shipped_drafter_says_what_it_records_and_that_it_exports():
    report = describe_checkpoint(SHIPPED)
    f = facts(report)
    assert report.loads and report.dialect == "native"
    assert "over the full (draft) vocabulary" in f["drafting"]  # as trained; its fits hold there (BENCHMARKS.md)
    assert f["vocabulary"].startswith("reduced: 12288 of 49152")
    assert "qwen3-style (q/k norms) for a llama target" in f["architecture"]  # the layer speculators / vLLM build
    assert not report.export and not report.export_speculators_only  # nothing stands in the way of either
    assert "exports       to speculators / vLLM" in str(report)


def test_a_drafter_with_its_targets_llama_layers_says_why_it_does_not_export(tmp_path):
    torch.manual_seed(0)  # Llama-style layers have no q/k norms, which speculators / vLLM always build
    draft = DSparkDraftModel.from_target(make_tiny_llama(), num_layers=1, block_size=4, markov_rank=8,
                                         draft_layer_style="target")
    draft.save_pretrained(tmp_path)
    report = describe_checkpoint(tmp_path)
    assert "llama-style (the target family's layer)" in facts(report)["architecture"]
    assert report.export and "not to speculators" in str(report) and "q/k" in str(report)


def test_unknown_format_is_refused_with_the_reason(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    report = describe_checkpoint(tmp_path)
    assert not report.loads and "not a checkpoint format hf-dspark can read" in report.refused
    assert "REFUSED" in str(report)
