"""Speculators export: the layout vLLM reads, an exact round trip through our loader, and clear refusals.

The expected layout is spelled out here from the public sources (speculators ``DSparkSpeculatorConfig`` /
``DSparkDraftModel`` with its Qwen3 DFlash backbone; vLLM's speculators config loader), not derived from the
exporter, so a wrong key, index convention or tensor name fails.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_llama, make_tiny_qwen3
from safetensors import safe_open

from hf_dspark import DSparkDraftModel
from hf_dspark.hub import SpeculatorsExportError, convert_checkpoint, save_as_speculators, speculators_export_problems

LAYER_IDS = [0, 2]
PROMPT = torch.tensor([[1, 5, 9, 22, 7, 3, 40, 41]])


def speculators_tensor_names(num_layers: int, head: str, confidence: bool) -> set[str]:
    """Parameter names of speculators' DSparkDraftModel (minus the verifier's embed_tokens / lm_head)."""
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        names |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        names |= {f"layers.{i}.self_attn.{n}_norm.weight" for n in "qk"}
        names |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        names |= {f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"}
    names |= {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
    if head == "gated":
        names |= {"markov_head.gate_proj.weight", "markov_head.gate_proj.bias"}
    if head == "rnn":
        names |= {"markov_head.joint_proj.weight", "markov_head.joint_proj.bias"}
    if confidence:
        names |= {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    return names


def vllm_view(config: dict) -> dict:
    """What vLLM derives from a speculators DSpark config (its speculators loader: update_dflash + update_dspark)."""
    spec = config["speculators_config"]
    method = next(m for m in spec["proposal_methods"] if m["proposal_type"] == spec["default_proposal_method"])
    aux = config["aux_hidden_state_layer_ids"]
    return {"method": config["speculators_model_type"], "num_speculative_tokens": method["speculative_tokens"],
            "eagle_aux_hidden_state_layer_ids": aux, "target_layer_ids": [i - 1 for i in aux],
            "mask_token_id": config["mask_token_id"], "markov_rank": config["markov_rank"],
            "markov_head_type": config["markov_head_type"], "sample_from_anchor": config["sample_from_anchor"],
            "verifier": spec["verifier"]["name_or_path"], "layers": config["transformer_layer_config"]}


@pytest.fixture(scope="module")
def target():
    model = make_tiny_qwen3()
    model.name_or_path = "Qwen/Qwen3-0.6B"
    return model


def make_drafter(target, head: str = "markov", **kwargs) -> DSparkDraftModel:
    torch.manual_seed(3)
    draft = DSparkDraftModel.from_target(target, num_layers=2, block_size=5, head=head, markov_rank=16,
                                         target_layer_ids=LAYER_IDS, **kwargs).eval()
    with torch.no_grad():  # make every norm and bias non-trivial so a dropped tensor cannot hide
        for name, p in draft.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return draft


def test_config_is_what_vllm_reads(target, tmp_path):
    draft = make_drafter(target)
    save_as_speculators(draft, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    view = vllm_view(config)
    assert view["method"] == "dspark" and config["speculators_config"]["algorithm"] == "dspark"
    assert view["num_speculative_tokens"] == 5  # sample_from_anchor: all block_size slots draft
    assert view["sample_from_anchor"] is True
    assert view["eagle_aux_hidden_state_layer_ids"] == [1, 3]  # hidden_states index = decoder layer + 1
    assert view["target_layer_ids"] == LAYER_IDS
    assert view["mask_token_id"] == draft.config.mask_token_id
    assert (view["markov_rank"], view["markov_head_type"]) == (16, "vanilla")
    assert config["enable_confidence_head"] is True and config["confidence_head_with_markov"] is True
    assert view["verifier"] == "Qwen/Qwen3-0.6B"
    layers = view["layers"]
    assert layers["model_type"] == "qwen3" and layers["num_hidden_layers"] == 2
    assert layers["layer_types"] == ["full_attention"] * 2
    assert (layers["hidden_size"], layers["head_dim"], layers["vocab_size"]) == (64, 16, 96)
    assert config["draft_vocab_size"] == 96 and config["target_hidden_size"] == 64 and config["block_size"] == 5
    assert "model_type" not in config  # speculators configs are recognised by speculators_model_type


def test_tensors_are_speculators_names_without_target_weights(target, tmp_path):
    draft = make_drafter(target)
    save_as_speculators(draft, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.metadata() == {"format": "pt"}
    assert names == speculators_tensor_names(2, "markov", confidence=True)
    assert not names & {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight"}


def test_include_target_weights_stores_the_targets_embedding_and_head(target, tmp_path):
    draft = make_drafter(target)
    save_as_speculators(draft, tmp_path, include_target_weights=True)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("embed_tokens.weight"), target.get_input_embeddings().weight)
        assert torch.equal(f.get_tensor("lm_head.weight"), target.get_output_embeddings().weight)


@pytest.mark.parametrize("head", ["markov", "gated", "rnn"])
def test_round_trip_every_tensor_and_draft_equal(target, tmp_path, head):
    draft = make_drafter(target, head=head, sequential_top_k=8, confidence_threshold=0.3)
    draft.config.confidence_temperatures = [0.9, 1.1, 1.3, 1.7, 2.0]
    draft.config.confidence_offsets = [-1.5, -0.5, 0.0, 0.25, 1.0]
    draft.config.greedy_confidence_temperatures = [1.0, 1.2, 1.4, 1.6, 1.8]
    draft.config.greedy_confidence_offsets = [0.5, 0.0, -0.5, 0.0, 0.0]
    save_as_speculators(draft, tmp_path, vllm_servable=head == "markov")
    loaded = DSparkDraftModel.from_pretrained(tmp_path, target=target)
    ours, theirs = draft.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    for key in ("block_size", "target_layer_ids", "mask_token_id", "sequential_head", "markov_rank",
                "use_confidence_head", "confidence_temperatures", "confidence_offsets", "confidence_threshold",
                "greedy_confidence_temperatures", "greedy_confidence_offsets", "sequential_top_k",
                "num_target_layers", "target_embedding_signature", "target_name_or_path"):
        assert getattr(loaded.config, key) == getattr(draft.config, key), key
    # no lookup: the second call's lookup would replay the first call's output from the target's history; the
    # drafter's own threshold (the calibration decides the rounds) rather than the default scheduler, whose
    # choices follow the machine's timing and could differ between the two calls
    threshold = draft.config.confidence_threshold
    expected = target.generate(PROMPT, max_new_tokens=24, do_sample=False, assistant_model=draft, dspark_lookup=False,
                               dspark_confidence_threshold=threshold)
    expected_rounds = draft.stats.rounds
    got = target.generate(PROMPT, max_new_tokens=24, do_sample=False, assistant_model=loaded, dspark_lookup=False,
                          dspark_confidence_threshold=threshold)
    assert torch.equal(got, expected) and loaded.stats.rounds == expected_rounds  # same drafts, same rounds


def test_convert_round_trip_native_speculators_native(target, tmp_path):
    draft = make_drafter(target)
    draft.save_pretrained(tmp_path / "native")
    convert_checkpoint(tmp_path / "native", tmp_path / "spec", to="speculators")
    convert_checkpoint(tmp_path / "spec", tmp_path / "back", to="native")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "dspark_drafter"
    back = DSparkDraftModel.from_pretrained(tmp_path / "back", target=target)
    for name, tensor in draft.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_llama_target_drafter_with_its_targets_layers_is_refused(tmp_path):
    target = make_tiny_llama()
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=5, markov_rank=16,
                                         draft_layer_style="target")
    with pytest.raises(SpeculatorsExportError, match="Qwen3 layer with q/k norms"):
        save_as_speculators(draft, tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_new_llama_target_drafter_has_qwen3_layers_and_round_trips_exactly(tmp_path):
    target = make_tiny_llama()
    target.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    draft = make_drafter(target)
    assert draft.config.draft_layer_style == "qwen3" and not speculators_export_problems(draft.config)
    save_as_speculators(draft, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2
    assert layer["rope_parameters"] == target.config.rope_parameters
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == speculators_tensor_names(2, "markov", confidence=True)
    for bound in (target, None):  # bound: the target's family; unbound: the one the export recorded
        loaded = DSparkDraftModel.from_pretrained(tmp_path, target=bound)
        assert loaded.config.target_family == "llama" and loaded.config.draft_layer_style == "qwen3"
        ours, theirs = draft.state_dict(), loaded.state_dict()
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)
    expected = target.generate(PROMPT, max_new_tokens=16, do_sample=False, assistant_model=draft, dspark_lookup=False,
                               dspark_confidence_threshold=0.0)
    loaded = DSparkDraftModel.from_pretrained(tmp_path, target=target)
    got = target.generate(PROMPT, max_new_tokens=16, do_sample=False, assistant_model=loaded, dspark_lookup=False,
                          dspark_confidence_threshold=0.0)
    assert torch.equal(got, expected)


def test_dflash_drafter_is_refused(target, tmp_path):
    draft = make_drafter(target, head="none", use_confidence_head=False)
    with pytest.raises(SpeculatorsExportError, match="sample_from_anchor=false"):
        save_as_speculators(draft, tmp_path)


@pytest.mark.parametrize("head", ["gated", "rnn"])
def test_heads_vllm_cannot_run_need_an_explicit_opt_out(target, head):
    draft = make_drafter(target, head=head)
    assert any("vanilla Markov head" in p for p in speculators_export_problems(draft.config))
    assert speculators_export_problems(draft.config, vllm_servable=False) == []


DRAFT_VOCAB = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89]


def test_reduced_draft_vocabulary_is_written_as_vllm_reads_it(target, tmp_path):
    """vLLM's Qwen3DSpark: lm_head [draft_vocab, d] and d2t are required for a reduced vocabulary; a draft id maps
    to draft_id + d2t[draft_id]; speculators' load_vocab_mappings checks t2d's size and true count."""
    draft = make_drafter(target, draft_vocab=DRAFT_VOCAB)
    save_as_speculators(draft, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["draft_vocab_size"] == len(DRAFT_VOCAB)
    assert config["transformer_layer_config"]["vocab_size"] == 96  # markov_w1 / t2d span the target vocabulary
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        d2t, t2d, lm_head = f.get_tensor("d2t"), f.get_tensor("t2d"), f.get_tensor("lm_head.weight")
        w2 = f.get_tensor("markov_head.markov_w2.weight")
    assert names == speculators_tensor_names(2, "markov", confidence=True) | {"d2t", "t2d", "lm_head.weight"}
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    draft_ids = torch.arange(len(DRAFT_VOCAB))
    assert (draft_ids + d2t[draft_ids]).tolist() == DRAFT_VOCAB  # vLLM map_draft_to_target
    assert t2d.shape == (96,) and int(t2d.sum()) == len(DRAFT_VOCAB)
    assert t2d.nonzero().flatten().tolist() == DRAFT_VOCAB
    assert torch.equal(lm_head, target.get_output_embeddings().weight[DRAFT_VOCAB])  # speculators: lm_head[t2d]
    assert w2.shape == (len(DRAFT_VOCAB), 16)


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_reduced_vocabulary_round_trip_is_bit_exact(target, tmp_path, head):
    draft = make_drafter(target, head=head, draft_vocab=DRAFT_VOCAB)
    save_as_speculators(draft, tmp_path, vllm_servable=head == "markov")
    loaded = DSparkDraftModel.from_pretrained(tmp_path, target=target)
    assert loaded.state_dict().keys() == draft.state_dict().keys()
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    expected = target.generate(PROMPT, max_new_tokens=24, do_sample=False, assistant_model=draft)
    got = target.generate(PROMPT, max_new_tokens=24, do_sample=False, assistant_model=loaded)
    assert torch.equal(got, expected)


def test_reduced_vocabulary_export_needs_the_target(target, tmp_path):
    draft = make_drafter(target, draft_vocab=DRAFT_VOCAB)
    draft.save_pretrained(tmp_path / "native")
    unbound = DSparkDraftModel.from_pretrained(tmp_path / "native")
    with pytest.raises(SpeculatorsExportError, match="bind it to its target"):
        save_as_speculators(unbound, tmp_path / "out")
    convert_checkpoint(tmp_path / "native", tmp_path / "out", to="speculators", target=target)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["draft_vocab_size"] == len(DRAFT_VOCAB)


def test_verifier_is_required_and_inferred(tmp_path):
    anonymous = make_tiny_qwen3()  # built in-process: no name_or_path
    draft = make_drafter(anonymous)
    assert draft.config.target_name_or_path is None
    with pytest.raises(SpeculatorsExportError, match="--verifier"):
        save_as_speculators(draft, tmp_path / "none")
    assert not (tmp_path / "none" / "config.json").exists()
    save_as_speculators(draft, tmp_path / "explicit", verifier_name_or_path="org/target")
    assert vllm_view(json.loads((tmp_path / "explicit" / "config.json").read_text()))["verifier"] == "org/target"
    anonymous.name_or_path = "/models/qwen3-tiny"  # the bound target's own name, when the drafter records none
    save_as_speculators(draft, tmp_path / "bound")
    assert vllm_view(json.loads((tmp_path / "bound" / "config.json").read_text()))["verifier"] == "/models/qwen3-tiny"


def test_upstream_dflash_drafter_exports_as_speculators_dflash(target, tmp_path):
    """vLLM's dflash method: sample_from_anchor=false, block_size slots, block_size - 1 speculative tokens."""
    draft = make_drafter(target, head="none", use_confidence_head=False, num_unpredicted_slots=1)
    save_as_speculators(draft, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    view = vllm_view({**config, "markov_rank": None, "markov_head_type": None})
    assert view["method"] == "dflash" and config["speculators_config"]["algorithm"] == "dflash"
    assert view["sample_from_anchor"] is False
    assert (config["block_size"], view["num_speculative_tokens"]) == (6, 5)
    assert "markov_rank" not in config and "enable_confidence_head" not in config
    loaded = DSparkDraftModel.from_pretrained(tmp_path, target=target)
    assert (loaded.config.block_size, loaded.config.num_unpredicted_slots) == (5, 1)
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_deepspec_convention_dflash_exports_only_for_speculators(target, tmp_path):
    draft = make_drafter(target, head="none", use_confidence_head=False)
    save_as_speculators(draft, tmp_path, vllm_servable=False)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["speculators_model_type"], config["sample_from_anchor"], config["block_size"]) == ("dflash", True, 5)
    loaded = DSparkDraftModel.from_pretrained(tmp_path, target=target)
    assert (loaded.config.block_size, loaded.config.num_unpredicted_slots) == (5, 0)


def test_upstream_convention_dspark_needs_the_opt_out(target, tmp_path):
    draft = make_drafter(target, num_unpredicted_slots=1)
    assert any("sample_from_anchor=true" in p for p in speculators_export_problems(draft.config))
    save_as_speculators(draft, tmp_path, vllm_servable=False)
    assert json.loads((tmp_path / "config.json").read_text())["sample_from_anchor"] is False
    rnn = make_drafter(target, head="rnn", num_unpredicted_slots=1)
    assert any("rnn head" in p for p in speculators_export_problems(rnn.config, vllm_servable=False))


def test_unknown_output_format_is_refused(target, tmp_path):
    make_drafter(target).save_pretrained(tmp_path / "native")
    with pytest.raises(ValueError, match="to='gguf' is not one of"):
        convert_checkpoint(tmp_path / "native", tmp_path / "out", to="gguf")
