"""Upstream DFlash drafters (transformers' own DFlash assistant format and z-lab's layout) run in hf-dspark exactly as
in transformers' native DFlash loop.

The reference is transformers 5.24 itself: ``target.generate(..., assistant_model=MuseGlimmerAssistantModel,
speculation_type="dflash")`` (``DFlashTokenCandidateGenerator``: block [anchor, MASK × 15], the outputs of slots
1..15 are the drafts, taps ``hidden_states[i + 1]``; batch 1, greedy). The same random weights are saved in
transformers' format and in z-lab's (Qwen3 config + ``dflash_config``, ``fc`` / ``hidden_norm``), loaded with
``DSparkDraftModel.from_pretrained`` and run through our ``generate`` (batch 1 and batch > 1 with left padding) and
the continuous-batching engine: every round proposes the same 15 tokens and every output equals the native one.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import make_tiny_qwen3
from safetensors.torch import load_file, save_file

from hf_dspark import DSparkDraftModel
from hf_dspark.modeling.checkpoint_files import CheckpointError
from hf_dspark.scheduling import SPSProfile
from hf_dspark.serving.engine import DSparkEngine

BLOCK = 16  # stored block: anchor + 15 masks -> 15 drafts per round
LAYER_IDS = [0, 2]
MASK = 95
PROMPTS = [[1, 5, 9, 22, 7, 3, 40, 41], [1, 60, 61, 17], [1, 33, 8, 8, 12, 90, 4, 5, 71, 30, 44, 2 + 7]]
NEW_TOKENS = 32

transformers_dflash = pytest.importorskip("transformers.models.muse_glimmer_assistant")


@pytest.fixture(scope="module")
def target():
    return make_tiny_qwen3()


@pytest.fixture(scope="module")
def assistant(target):
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    cfg = MuseGlimmerAssistantConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=512,
                                     layer_types=["full_attention"] * 2, block_size=BLOCK, mask_token_id=MASK,
                                     target_layer_ids=LAYER_IDS, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = MuseGlimmerAssistantModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0, 0.2)
    return model


@pytest.fixture(scope="module")
def transformers_dir(assistant, tmp_path_factory):
    path = tmp_path_factory.mktemp("transformers_dflash")
    assistant.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def zlab_dir(assistant, target, transformers_dir, tmp_path_factory):
    """The same weights in z-lab's layout (dflash/model.py DFlashDraftModel: Qwen3Config + dflash_config)."""
    path = tmp_path_factory.mktemp("zlab_dflash")
    names = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}
    tensors = {names.get(k, k): v for k, v in load_file(str(transformers_dir / "model.safetensors")).items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(target.config.to_dict())
    a = assistant.config
    config.update(architectures=["DFlashDraftModel"], auto_map={"AutoModel": "dflash.DFlashDraftModel"},
                  block_size=BLOCK, num_target_layers=config["num_hidden_layers"], num_hidden_layers=2,
                  layer_types=["full_attention"] * 2, rope_parameters=dict(a.rope_parameters),
                  rms_norm_eps=a.rms_norm_eps, dflash_config={"mask_token_id": MASK, "target_layer_ids": LAYER_IDS})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture(scope="module")
def native(target, assistant) -> dict[tuple, tuple[list[int], list[list[int]]]]:
    """transformers' own DFlash loop per prompt: the output and every round's proposal."""
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

    runs = {}
    original = DFlashTokenCandidateGenerator.get_candidates
    for prompt in PROMPTS:
        proposals = []

        def recording(self, input_ids, *args, **kwargs):
            ids, logits = original(self, input_ids, *args, **kwargs)
            if logits is not None:
                proposals.append(ids[0, input_ids.shape[1]:].tolist())
            return ids, logits

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(DFlashTokenCandidateGenerator, "get_candidates", recording)
            out = target.generate(torch.tensor([prompt]), assistant_model=assistant, speculation_type="dflash",
                                  do_sample=False, max_new_tokens=NEW_TOKENS)
        runs[tuple(prompt)] = (out[0, len(prompt):].tolist(), proposals)
    return runs


def ours(target, draft, prompt: list[int]) -> tuple[list[int], list[list[int]]]:
    proposals = []
    original = draft.draft_block

    def recording(*args, **kwargs):
        block = original(*args, **kwargs)
        proposals.append(block.tokens[0].tolist())
        return block

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(draft, "draft_block", recording)
        # every round drafts the whole block, without lookup proposals: what transformers' DFlash loop does
        out = target.generate(torch.tensor([prompt]), assistant_model=draft, do_sample=False,
                              max_new_tokens=NEW_TOKENS, dspark_confidence_threshold=0.0)
    return out[0, len(prompt):].tolist(), proposals


@pytest.fixture(params=["transformers", "zlab"])
def draft(request, target, transformers_dir, zlab_dir):
    path = transformers_dir if request.param == "transformers" else zlab_dir
    return DSparkDraftModel.from_pretrained(path, target=target)


def test_both_layouts_load_the_upstream_convention(draft, transformers_dir, target):
    cfg = draft.config
    assert (cfg.block_size, cfg.num_unpredicted_slots, cfg.block_slots) == (BLOCK - 1, 1, BLOCK)
    assert cfg.target_layer_ids == LAYER_IDS and cfg.mask_token_id == MASK
    assert cfg.sequential_head == "none" and not cfg.use_confidence_head and cfg.sequential_top_k == 0
    stored = load_file(str(transformers_dir / "model.safetensors"))
    names = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}
    state = draft.state_dict()
    assert set(state) == {names.get(k, k) for k in stored}
    for name, tensor in stored.items():
        assert torch.equal(state[names.get(name, name)], tensor), name


def test_same_proposals_and_output_as_transformers_native_dflash(target, native, draft):
    for prompt in PROMPTS:
        expected, native_rounds = native[tuple(prompt)]
        got, our_rounds = ours(target, draft, prompt)
        assert got == expected
        assert all(len(p) == BLOCK - 1 for p in native_rounds)
        assert our_rounds[:len(native_rounds)] == native_rounds  # the same 15 drafts every round
        # transformers skips drafting when a single token is left (a plain target step); we draft a block whose
        # verification commits that one token: the same output, at most one extra (unused) proposal
        assert len(our_rounds) - len(native_rounds) in (0, 1)


def test_batch_generate_equals_native_per_prompt(target, native, draft):
    expected = [native[tuple(p)][0] for p in PROMPTS]
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    out = target.generate(ids, attention_mask=mask, assistant_model=draft, do_sample=False,
                          max_new_tokens=NEW_TOKENS)
    for row, want in zip(out, expected):
        got = row[width:].tolist()
        assert got[:len(want)] == want and set(got[len(want):]) <= {0}  # rows that hit EOS are padded after it


@pytest.mark.parametrize("policy", ["fixed", "scheduled"])
def test_engine_equals_native(target, native, draft, policy):
    expected = [native[tuple(p)][0] for p in PROMPTS]
    sps = SPSProfile.from_user_table({1: 100.0, 16: 90.0, 64: 40.0})  # no profiling on a tiny CPU target
    engine = DSparkEngine(target, draft, policy, sps=sps)
    outputs = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    assert [o.token_ids for o in outputs] == expected


def test_sliding_window_assistant_is_refused(assistant, target, tmp_path):
    config = assistant.config.to_dict()
    config["layer_types"] = ["sliding_attention", "full_attention"]
    assistant.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="sliding_attention.*window 2048"):
        DSparkDraftModel.from_pretrained(tmp_path, target=target)


def test_transformers_assistant_needs_a_qwen3_target(transformers_dir):
    from conftest import make_tiny_llama

    with pytest.raises(CheckpointError, match="pass target="):
        DSparkDraftModel.from_pretrained(transformers_dir)
    with pytest.raises(CheckpointError, match="Qwen3-family targets only"):
        DSparkDraftModel.from_pretrained(transformers_dir, target=make_tiny_llama())
