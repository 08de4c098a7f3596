"""Every published checkpoint dialect loads exactly, and every way a checkpoint can be wrong is a clear error.

Fixtures are written in each dialect's own key layout with names and shapes spelled out here from the public
sources (DeepSpec ``Qwen3DSparkModel``, speculators ``DSparkDraftModel``, SpecForge ``DSparkDraftModel``), not
derived from our model, so a loader that drops or misroutes a tensor fails.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_dspark import DraftCache, DSparkDraftModel
from hf_dspark.modeling.checkpoint_files import CheckpointError, read_checkpoint_index
from hf_dspark.modeling.dialects import detect_dialect
from hf_dspark.modeling.target_compatibility import embedding_signature

LAYER_IDS = [0, 1, 2]  # our 0-based decoder layers of the 4-layer tiny targets (never the last one)
NUM_DRAFT_LAYERS, BLOCK, RANK, MASK = 2, 4, 8, 90
DEEPSPEC_HEADS = {"markov": "vanilla", "gated": "gated", "rnn": "rnn"}
TARGET_TENSORS = ("embed_tokens.weight", "lm_head.weight")


# -------------------------------------------------------------------------------------------------------
# Dialect layouts (names and shapes as the upstream modules define them)
# -------------------------------------------------------------------------------------------------------
def _dims(cfg) -> dict:
    return dict(d=cfg.hidden_size, hd=cfg.head_dim, heads=cfg.num_attention_heads, kv=cfg.num_key_value_heads,
                ffn=cfg.intermediate_size, vocab=cfg.vocab_size)


def layout_shapes(cfg, head: str | None, confidence: bool, num_taps: int = len(LAYER_IDS)) -> dict[str, tuple]:
    """Qwen3-style DFlash/DSpark backbone + DeepSpec-named heads, as in Qwen3DSparkModel / DFlashDraftModel."""
    x = _dims(cfg)
    d, r = x["d"], RANK
    shapes = {"fc.weight": (d, num_taps * d), "hidden_norm.weight": (d,), "norm.weight": (d,)}
    for i in range(NUM_DRAFT_LAYERS):
        p = f"layers.{i}."
        q_rows, kv_rows = x["heads"] * x["hd"], x["kv"] * x["hd"]
        shapes.update({
            p + "self_attn.q_proj.weight": (q_rows, d), p + "self_attn.k_proj.weight": (kv_rows, d),
            p + "self_attn.v_proj.weight": (kv_rows, d), p + "self_attn.o_proj.weight": (d, q_rows),
            p + "self_attn.q_norm.weight": (x["hd"],), p + "self_attn.k_norm.weight": (x["hd"],),
            p + "mlp.gate_proj.weight": (x["ffn"], d), p + "mlp.up_proj.weight": (x["ffn"], d),
            p + "mlp.down_proj.weight": (d, x["ffn"]), p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,)})
    if head is not None:
        shapes["markov_head.markov_w1.weight"] = shapes["markov_head.markov_w2.weight"] = (x["vocab"], r)
    if head == "gated":
        shapes.update({"markov_head.gate_proj.weight": (r, d + r), "markov_head.gate_proj.bias": (r,)})
    if head == "rnn":
        shapes.update({"markov_head.joint_proj.weight": (3 * r, 2 * r + d), "markov_head.joint_proj.bias": (3 * r,)})
    if confidence:
        shapes.update({"confidence_head.proj.weight": (1, d + r), "confidence_head.proj.bias": (1,)})
    return shapes


def random_tensors(shapes: dict[str, tuple], seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) * 0.1 for name, shape in shapes.items()}


def with_target_tensors(tensors: dict, target, lm_head: bool = True) -> dict:
    """The frozen copies DeepSpec / speculators store next to the drafter's own weights."""
    out = dict(tensors, **{"embed_tokens.weight": target.get_input_embeddings().weight.detach().clone()})
    if lm_head:
        out["lm_head.weight"] = target.get_output_embeddings().weight.detach().clone()
    return out


def write(path, config: dict, tensors: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})


def deepspec_config(target, head: str | None, confidence: bool, **overrides) -> dict:
    """deepspec/modeling/dspark/qwen3/config.py: a deep copy of the target config plus unprefixed keys."""
    config = copy.deepcopy(target.config.to_dict())
    config.update(architectures=["Qwen3DSparkModel"], num_target_layers=config["num_hidden_layers"],
                  num_hidden_layers=NUM_DRAFT_LAYERS, block_size=BLOCK, tie_word_embeddings=False,
                  layer_types=["full_attention"] * NUM_DRAFT_LAYERS, mask_token_id=MASK, target_layer_ids=LAYER_IDS,
                  num_anchors=512, enable_confidence_head=confidence, markov_rank=RANK if head else 0)
    if confidence:
        config["confidence_head_with_markov"] = True
    if head:
        config["markov_head_type"] = DEEPSPEC_HEADS[head]
    config.update(overrides)
    return config


def specforge_config(target, head: str | None, confidence: bool, projector="dspark", **nested) -> dict:
    """SpecForge configs/qwen3-8b-dspark.json: Qwen3 fields at the top level, method keys in dflash_config."""
    config = copy.deepcopy(target.config.to_dict())
    config.update(architectures=["DSparkDraftModel" if projector == "dspark" else "DFlashDraftModel"],
                  auto_map={"AutoModel": "dspark.DSparkDraftModel"}, block_size=BLOCK,
                  num_target_layers=config["num_hidden_layers"], num_hidden_layers=NUM_DRAFT_LAYERS,
                  layer_types=["full_attention"] * NUM_DRAFT_LAYERS)
    config["dflash_config"] = dict(attention_mode="gqa", confidence_head_alpha=1.0 if confidence else 0.0,
                                   confidence_head_with_markov=confidence, enable_confidence_head=confidence,
                                   markov_head_type=DEEPSPEC_HEADS.get(head, "vanilla"),
                                   markov_rank=RANK if head else 0, mask_token_id=MASK, projector_type=projector,
                                   target_layer_ids=LAYER_IDS, **nested)
    return config


def speculators_config(target, head: str | None, confidence: bool, kind="dspark", **overrides) -> dict:
    """speculators models/dspark/config.py: draft layer config as a diff, hidden_states indices as aux ids."""
    from transformers import AutoConfig

    layer = target.config.to_dict()
    layer.update(num_hidden_layers=NUM_DRAFT_LAYERS, layer_types=["full_attention"] * NUM_DRAFT_LAYERS,
                 tie_word_embeddings=False)
    layer_diff = AutoConfig.for_model(**layer).to_diff_dict()
    config = dict(speculators_model_type=kind, speculators_version="0.5.0", architectures=["DSparkSpeculator"],
                  transformer_layer_config=layer_diff, draft_vocab_size=target.config.vocab_size, block_size=BLOCK,
                  target_hidden_size=None, aux_hidden_state_layer_ids=[i + 1 for i in LAYER_IDS],
                  mask_token_id=MASK, sliding_window_non_causal=False, sample_from_anchor=True,
                  speculators_config=dict(algorithm=kind, default_proposal_method="greedy",
                                          proposal_methods=[dict(proposal_type="greedy", speculative_tokens=BLOCK)],
                                          verifier=dict(name_or_path="tiny/target",
                                                        architectures=["Qwen3ForCausalLM"])))
    if kind == "dspark":
        config.update(markov_rank=RANK if head else 0, markov_head_type=DEEPSPEC_HEADS.get(head, "vanilla"),
                      enable_confidence_head=confidence, confidence_head_with_markov=True)
    config.update(overrides)
    return config


# Which stored tensors each dialect must drop (they belong to the target).
DROPPED = {"deepspec": TARGET_TENSORS, "specforge": ("embed_tokens.weight",),
           "speculators": TARGET_TENSORS}


def write_dialect(path, dialect: str, target, head: str | None, confidence: bool, seed: int = 0) -> dict:
    shapes = layout_shapes(target.config, head, confidence)
    tensors = random_tensors(shapes, seed)
    if dialect == "deepspec":
        tensors, config = with_target_tensors(tensors, target), deepspec_config(target, head, confidence)
    elif dialect == "specforge":
        tensors = with_target_tensors(tensors, target, lm_head=False)
        config = specforge_config(target, head, confidence)
    else:
        tensors, config = with_target_tensors(tensors, target), speculators_config(target, head, confidence)
    write(path, config, tensors)
    return tensors


def assert_maps_every_tensor(model, written: dict, dropped) -> None:
    state = model.state_dict()
    kept = {name: t for name, t in written.items() if name not in dropped}
    assert set(state) == set(kept), (set(state) ^ set(kept))
    for name, tensor in kept.items():
        assert torch.equal(state[name], tensor), name


# -------------------------------------------------------------------------------------------------------
# Loading each dialect
# -------------------------------------------------------------------------------------------------------
CASES = [("deepspec", "markov", True), ("deepspec", "gated", True), ("deepspec", "rnn", True),
         ("deepspec", None, False), ("specforge", "markov", True), ("specforge", "rnn", False),
         ("speculators", "markov", True), ("speculators", "gated", True), ("speculators", "rnn", True)]


@pytest.mark.parametrize(("dialect", "head", "confidence"), CASES)
def test_dialect_maps_every_tensor(tmp_path, tiny_qwen3_target, dialect, head, confidence):
    written = write_dialect(tmp_path, dialect, tiny_qwen3_target, head, confidence)
    model = DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)
    assert_maps_every_tensor(model, written, DROPPED[dialect])
    cfg = model.config
    assert cfg.sequential_head == (head or "none")
    assert cfg.use_confidence_head is confidence
    assert (cfg.block_size, cfg.mask_token_id, cfg.num_hidden_layers) == (BLOCK, MASK, NUM_DRAFT_LAYERS)
    assert cfg.target_layer_ids == LAYER_IDS  # speculators' aux ids [1, 2, 3] are hidden_states indices
    assert cfg.num_target_layers == tiny_qwen3_target.config.num_hidden_layers
    assert "embed_tokens" not in str(list(model.state_dict())) and "lm_head" not in str(list(model.state_dict()))


def test_deepspec_dflash_checkpoint_is_the_none_head(tmp_path, tiny_qwen3_target):
    write_dialect(tmp_path, "deepspec", tiny_qwen3_target, None, False)
    model = DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)
    assert model.markov_head is None and model.confidence_head is None


def test_speculators_dflash_with_anchor_sampling_loads(tmp_path, tiny_qwen3_target):
    shapes = layout_shapes(tiny_qwen3_target.config, None, False)
    written = with_target_tensors(random_tensors(shapes), tiny_qwen3_target)
    write(tmp_path, speculators_config(tiny_qwen3_target, None, False, kind="dflash", sample_from_anchor=True),
          written)
    model = DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)
    assert_maps_every_tensor(model, written, TARGET_TENSORS)
    assert model.config.sequential_head == "none"


def test_specforge_legacy_logit_head_prefix(tmp_path, tiny_qwen3_target):
    written = random_tensors(layout_shapes(tiny_qwen3_target.config, "markov", True))
    legacy = {("logit_head." + k if k.startswith(("markov_head", "confidence_head")) else k): v
              for k, v in written.items()}
    write(tmp_path, specforge_config(tiny_qwen3_target, "markov", True), legacy)
    model = DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)
    assert_maps_every_tensor(model, written, ())


@pytest.mark.parametrize("dialect", ["deepspec", "specforge", "speculators"])
def test_dialect_drafts_like_the_native_drafter_with_the_same_weights(tmp_path, tiny_qwen3_target, dialect):
    """Config mapping (block size, mask id, taps, head type) is right: same weights -> same drafts."""
    torch.manual_seed(3)
    native = DSparkDraftModel.from_target(tiny_qwen3_target, num_layers=NUM_DRAFT_LAYERS, block_size=BLOCK,
                                          head="gated", markov_rank=RANK, target_layer_ids=LAYER_IDS,
                                          mask_token_id=MASK).eval()
    native.config.sequential_top_k = 0
    tensors = {k: v.detach().clone() for k, v in native.state_dict().items()}
    configs = {"deepspec": deepspec_config, "specforge": specforge_config, "speculators": speculators_config}
    write(tmp_path, configs[dialect](tiny_qwen3_target, "gated", True),
          with_target_tensors(tensors, tiny_qwen3_target, lm_head=dialect != "specforge"))
    loaded = DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)
    loaded.config.sequential_top_k = 0
    feats = torch.randn(1, 9, len(LAYER_IDS) * 64, generator=torch.Generator().manual_seed(0))
    blocks = []
    for model in (native, loaded):
        cache = model.extend_context(DraftCache(), feats, torch.arange(9)[None])
        blocks.append(model.draft_block(cache, torch.tensor([5]), torch.tensor([9])))
    assert torch.equal(blocks[0].tokens, blocks[1].tokens)
    torch.testing.assert_close(blocks[0].draft_logits, blocks[1].draft_logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(blocks[0].confidence, blocks[1].confidence, rtol=0, atol=1e-6)


def test_sharded_checkpoint_loads(tmp_path, tiny_qwen3_target):
    written = write_dialect(tmp_path, "deepspec", tiny_qwen3_target, "markov", True)
    os.remove(tmp_path / "model.safetensors")
    names = sorted(written)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: written[k] for k in keys}, str(tmp_path / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    model = DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)
    assert_maps_every_tensor(model, written, TARGET_TENSORS)
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match=r"shard model-00002-of-00002.safetensors .* is missing"):
        DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)


def test_hub_id_resolves_from_the_offline_cache(tmp_path, tiny_qwen3_target, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "models--someone--tiny-dspark"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    written = write_dialect(repo / "snapshots" / commit, "deepspec", tiny_qwen3_target, "markov", True)
    model = DSparkDraftModel.from_pretrained("someone/tiny-dspark", target=tiny_qwen3_target, cache_dir=tmp_path)
    assert_maps_every_tensor(model, written, TARGET_TENSORS)
    with pytest.raises(FileNotFoundError, match="offline"):
        DSparkDraftModel.from_pretrained("someone/absent", target=tiny_qwen3_target, cache_dir=tmp_path)


def test_detect_dialect_names_the_format():
    assert detect_dialect({"model_type": "dspark_drafter"}).name == "native"
    assert detect_dialect({"architectures": ["Qwen3DSparkModel"], "dflash_config": {}}).name == "deepspec"
    assert detect_dialect({"architectures": ["DFlashDraftModel"]}).name == "specforge"
    assert detect_dialect({"speculators_model_type": "dspark"}).name == "speculators"
    with pytest.raises(CheckpointError, match="model_type='llama'"):
        detect_dialect({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})


# -------------------------------------------------------------------------------------------------------
# Upstream DFlash block convention (the anchor slot predicts nothing)
# -------------------------------------------------------------------------------------------------------
def _upstream_native(target, **kwargs):
    """A native drafter with the upstream block convention and the same shapes as the fixtures here."""
    torch.manual_seed(5)
    return DSparkDraftModel.from_target(target, num_layers=NUM_DRAFT_LAYERS, block_size=BLOCK - 1, head="none",
                                        use_confidence_head=False, target_layer_ids=LAYER_IDS, mask_token_id=MASK,
                                        num_unpredicted_slots=1, **kwargs).eval()


def _same_drafts(a, b, feats_len: int = 9, anchor: int = 5):
    feats = torch.randn(1, feats_len, len(LAYER_IDS) * 64, generator=torch.Generator().manual_seed(0))
    blocks = []
    for model in (a, b):
        cache = model.extend_context(DraftCache(), feats, torch.arange(feats_len)[None])
        blocks.append(model.draft_block(cache, torch.tensor([anchor]), torch.tensor([feats_len])))
    assert torch.equal(blocks[0].tokens, blocks[1].tokens)
    torch.testing.assert_close(blocks[0].draft_logits, blocks[1].draft_logits, rtol=0, atol=1e-6)
    return blocks


def test_zlab_dflash_loads_with_the_upstream_block_convention(tmp_path, tiny_qwen3_target):
    """z-lab's config: Qwen3 fields, block_size at the top level, dflash_config {target_layer_ids, mask_token_id}."""
    native = _upstream_native(tiny_qwen3_target)
    tensors = {k: v.detach().clone() for k, v in native.state_dict().items()}
    config = specforge_config(tiny_qwen3_target, None, False, projector="dflash")
    config["dflash_config"] = {"mask_token_id": MASK, "target_layer_ids": LAYER_IDS}  # z-lab's whole dflash_config
    write(tmp_path, config, tensors)
    model = DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)
    assert_maps_every_tensor(model, tensors, ())
    cfg = model.config
    assert (cfg.block_size, cfg.num_unpredicted_slots, cfg.block_slots) == (BLOCK - 1, 1, BLOCK)  # 16 -> 15 drafts
    assert cfg.sequential_head == "none" and cfg.sequential_top_k == 0
    _same_drafts(native, model)
    # newer z-lab configs put block_size inside dflash_config
    del config["block_size"]
    config["dflash_config"]["block_size"] = BLOCK
    write(tmp_path, config, tensors)
    assert DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target).config.block_size == BLOCK - 1


def test_upstream_convention_changes_what_is_drafted(tmp_path, tiny_qwen3_target):
    """Same weights, same slots: upstream draft k is the output of slot k+1 (the mask at position p+k+1 names its own
    token), DeepSpec's the output of slot k; reading an upstream checkpoint as DeepSpec-style would draft shifted."""
    upstream = _upstream_native(tiny_qwen3_target)
    deepspec_style = _upstream_native(tiny_qwen3_target)
    deepspec_style.config.num_unpredicted_slots = 0
    deepspec_style.config.block_size = BLOCK
    feats = torch.randn(1, 9, len(LAYER_IDS) * 64, generator=torch.Generator().manual_seed(0))
    h = [m.forward_block(m.extend_context(DraftCache(), feats, torch.arange(9)[None]), torch.tensor([5]),
                         torch.tensor([9])) for m in (upstream, deepspec_style)]
    assert h[0].shape[1] == BLOCK - 1 and h[1].shape[1] == BLOCK
    torch.testing.assert_close(h[0], h[1][:, 1:], rtol=0, atol=1e-6)
    assert not torch.allclose(h[0], h[1][:, :-1])


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_speculators_without_anchor_sampling_loads_as_the_upstream_convention(tmp_path, tiny_qwen3_target, kind):
    head = "markov" if kind == "dspark" else None
    written = write_dialect(tmp_path, "speculators", tiny_qwen3_target, head, kind == "dspark")
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(speculators_model_type=kind)
    if kind == "dflash":  # speculators' DFlash default is sample_from_anchor=False
        del config["sample_from_anchor"]
        for key in ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov"):
            config.pop(key, None)
    else:
        config["sample_from_anchor"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)
    assert_maps_every_tensor(model, written, TARGET_TENSORS)
    assert (model.config.block_size, model.config.num_unpredicted_slots) == (BLOCK - 1, 1)


def test_speculators_rnn_head_without_anchor_sampling_is_refused(tmp_path, tiny_qwen3_target):
    """speculators runs the RNN state through the unpredicted anchor slot too; ours starts at the first draft."""
    write_dialect(tmp_path, "speculators", tiny_qwen3_target, "rnn", True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["sample_from_anchor"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="rnn.*anchor slot"):
        DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)


def test_foreign_dialects_draft_over_the_full_vocabulary(tmp_path, tiny_qwen3_target):
    for dialect in ("deepspec", "specforge", "speculators"):
        write_dialect(tmp_path / dialect, dialect, tiny_qwen3_target, "markov", True)
        assert DSparkDraftModel.from_pretrained(tmp_path / dialect, target=tiny_qwen3_target).config \
            .sequential_top_k == 0, dialect


# -------------------------------------------------------------------------------------------------------
# Reduced vocabularies: d2t / t2d (speculators, SpecForge, EAGLE-style)
# -------------------------------------------------------------------------------------------------------
DRAFT_IDS = [2, 3, 5, 8, 13, 21, 34, 55, 60, 61, 62, 70, 80, 89, 90, 95]


def eagle_style_mapping(ids: list[int], vocab: int) -> dict[str, torch.Tensor]:
    """speculators build_vocab_mappings_from_distribution / EAGLE-3: d2t offsets, t2d mask."""
    d2t = torch.tensor(ids) - torch.arange(len(ids))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return {"d2t": d2t, "t2d": t2d}


def reduced_vocab_tensors(target, ids=DRAFT_IDS, head="markov", confidence=True, seed=0) -> dict:
    tensors = with_target_tensors(random_tensors(layout_shapes(target.config, head, confidence), seed), target)
    tensors["markov_head.markov_w2.weight"] = torch.randn(len(ids), RANK)
    tensors["lm_head.weight"] = target.get_output_embeddings().weight.detach()[ids].clone()  # draft rows
    tensors.update(eagle_style_mapping(ids, target.config.vocab_size))
    return tensors


@pytest.mark.parametrize("dialect", ["speculators", "specforge"])
def test_reduced_draft_vocabulary_loads(tmp_path, tiny_qwen3_target, dialect):
    tensors = reduced_vocab_tensors(tiny_qwen3_target)
    config = (speculators_config(tiny_qwen3_target, "markov", True, draft_vocab_size=len(DRAFT_IDS))
              if dialect == "speculators" else specforge_config(tiny_qwen3_target, "markov", True))
    write(tmp_path, config, tensors)
    model = DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)
    assert model.config.draft_vocab_size == len(DRAFT_IDS)
    assert model.draft_to_target.tolist() == DRAFT_IDS  # vLLM's map_draft_to_target: index + d2t[index]
    assert torch.equal(model.markov_head.markov_w2.weight, tensors["markov_head.markov_w2.weight"])
    dropped = {"d2t", "t2d", "embed_tokens.weight", "lm_head.weight", "draft_to_target"}
    for name, tensor in model.state_dict().items():
        if name not in dropped:
            assert torch.equal(tensor, tensors[name]), name
    # drafts are target ids inside the draft vocabulary
    cache = model.extend_context(DraftCache(), torch.randn(1, 7, len(LAYER_IDS) * 64), torch.arange(7)[None])
    block = model.draft_block(cache, torch.tensor([4]), torch.tensor([7]))
    assert set(block.tokens.flatten().tolist()) <= set(DRAFT_IDS)


def test_reduced_vocabulary_in_any_stored_order_drafts_identically(tmp_path, tiny_qwen3_target):
    """A d2t whose target ids are not ascending is the same drafter with its draft rows permuted."""
    tensors = reduced_vocab_tensors(tiny_qwen3_target)
    config = speculators_config(tiny_qwen3_target, "markov", True, draft_vocab_size=len(DRAFT_IDS))
    write(tmp_path / "sorted", config, tensors)
    perm = torch.randperm(len(DRAFT_IDS), generator=torch.Generator().manual_seed(1))
    shuffled = dict(tensors, **{"markov_head.markov_w2.weight": tensors["markov_head.markov_w2.weight"][perm],
                                "lm_head.weight": tensors["lm_head.weight"][perm]})
    shuffled["d2t"] = torch.tensor(DRAFT_IDS)[perm] - torch.arange(len(DRAFT_IDS))
    write(tmp_path / "shuffled", config, shuffled)
    a, b = (DSparkDraftModel.from_pretrained(tmp_path / name, target=tiny_qwen3_target)
            for name in ("sorted", "shuffled"))
    assert torch.equal(a.draft_to_target, b.draft_to_target)
    assert torch.equal(a.markov_head.markov_w2.weight, b.markov_head.markov_w2.weight)


@pytest.mark.parametrize(("change", "message"), [
    ("no_mapping", r"declares draft_vocab_size=16 < vocab_size=96 but the checkpoint stores no d2t / t2d"),
    ("disagree", "d2t and t2d disagree"),
    ("declared", r"declares draft_vocab_size=20 but d2t/t2d hold 16"),
    ("repeated", "invalid or repeated target ids"),
    ("foreign_head", "not the target's LM head"),
    ("w2_rows", r"'markov_head\.markov_w2\.weight' has shape \(96, 8\) but .* expects \(16, 8\)"),
])
def test_broken_vocabulary_mappings_are_refused(tmp_path, tiny_qwen3_target, change, message):
    tensors = reduced_vocab_tensors(tiny_qwen3_target)
    config = speculators_config(tiny_qwen3_target, "markov", True, draft_vocab_size=len(DRAFT_IDS))
    if change == "no_mapping":
        del tensors["d2t"], tensors["t2d"]
    elif change == "disagree":
        tensors["t2d"][DRAFT_IDS[0]], tensors["t2d"][1] = False, True
    elif change == "declared":
        config["draft_vocab_size"] = 20
    elif change == "repeated":
        tensors["d2t"][1] = tensors["d2t"][0] - 1  # two draft tokens -> one target id
        del tensors["t2d"]
    elif change == "foreign_head":
        tensors["lm_head.weight"] = torch.randn_like(tensors["lm_head.weight"])  # a head trained on its own
    elif change == "w2_rows":
        tensors["markov_head.markov_w2.weight"] = torch.randn(96, RANK)
    write(tmp_path, config, tensors)
    with pytest.raises(CheckpointError, match=message):
        DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)


def test_full_vocabulary_mapping_is_the_full_vocabulary(tmp_path, tiny_qwen3_target):
    """speculators accepts and ignores identity full-vocabulary t2d/d2t; so do we."""
    vocab = tiny_qwen3_target.config.vocab_size
    written = write_dialect(tmp_path, "speculators", tiny_qwen3_target, "markov", True)
    write(tmp_path, speculators_config(tiny_qwen3_target, "markov", True),
          dict(written, **eagle_style_mapping(list(range(vocab)), vocab)))
    model = DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)
    assert model.config.draft_vocab_size is None and model.draft_to_target is None


def test_deepspec_has_no_vocabulary_mapping(tmp_path, tiny_qwen3_target):
    written = write_dialect(tmp_path, "deepspec", tiny_qwen3_target, "markov", True)
    write(tmp_path, deepspec_config(tiny_qwen3_target, "markov", True),
          dict(written, **eagle_style_mapping(DRAFT_IDS, tiny_qwen3_target.config.vocab_size)))
    with pytest.raises(CheckpointError, match=r"deepspec checkpoint stores \['d2t', 't2d'\]"):
        DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)


# -------------------------------------------------------------------------------------------------------
# Refusals: conventions we cannot map exactly
# -------------------------------------------------------------------------------------------------------
def test_embedding_taps_are_refused(tmp_path, tiny_qwen3_target):
    write_dialect(tmp_path, "speculators", tiny_qwen3_target, "markov", True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["aux_hidden_state_layer_ids"] = [0, 1, 2]  # hidden_states[0] is the embedding output
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="embedding output"):
        DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)


def test_confidence_head_without_markov_input_is_refused(tmp_path, tiny_qwen3_target):
    write_dialect(tmp_path, "deepspec", tiny_qwen3_target, "markov", True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["confidence_head_with_markov"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="confidence_head_with_markov=false"):
        DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)


def test_speculators_qwen3_layers_on_a_llama_target_are_refused(tmp_path, tiny_target):
    """speculators always builds Qwen3-style draft layers (q/k norms); a Llama-family drafter has none."""
    written = with_target_tensors(random_tensors(layout_shapes(tiny_target.config, "markov", True)), tiny_target)
    config = speculators_config(tiny_target, "markov", True)
    write(tmp_path, config, written)
    with pytest.raises(CheckpointError, match=r"\['layers\.0\.self_attn\.k_norm\.weight'.* no parameter for"):
        DSparkDraftModel.from_pretrained(tmp_path, target=tiny_target)


# -------------------------------------------------------------------------------------------------------
# Broken files
# -------------------------------------------------------------------------------------------------------
def test_truncated_file_names_the_tensor(tmp_path, tiny_qwen3_target):
    write_dialect(tmp_path, "deepspec", tiny_qwen3_target, "markov", True)
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"model.safetensors is truncated: tensor '[\w.]+' needs bytes"):
        DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)


def test_corrupt_header_is_reported(tmp_path, tiny_qwen3_target):
    write_dialect(tmp_path, "deepspec", tiny_qwen3_target, "markov", True)
    file = tmp_path / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:16] = b"\xff\xfe garbl"
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt: its safetensors header is not valid JSON"):
        DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)
    file.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="truncated or not a safetensors file"):
        read_checkpoint_index(tmp_path)


def _write_raw_safetensors(path, header) -> None:
    import struct

    path.mkdir(parents=True, exist_ok=True)
    encoded = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(16))


@pytest.mark.parametrize(("header", "message"), [
    ([], "its safetensors header is not a JSON object"),
    ({"fc.weight": {"shape": [2], "data_offsets": [0, 8]}}, "the header entry of tensor 'fc.weight' is malformed"),
    ({"fc.weight": {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}},
     "the header entry of tensor 'fc.weight' is malformed"),
    ({"fc.weight": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}},
     "the header entry of tensor 'fc.weight' is malformed"),
])
def test_malformed_safetensors_header_is_one_error(tmp_path, header, message):
    """Headers that are valid JSON but not safetensors' layout raised AttributeError / KeyError / TypeError (or
    passed, with a negative offset)."""
    _write_raw_safetensors(tmp_path, header)
    with pytest.raises(CheckpointError, match=f"model.safetensors is corrupt: {message}"):
        read_checkpoint_index(tmp_path)


@pytest.mark.parametrize(("index", "message"), [
    ([1], "no valid 'weight_map'"),
    ({"weight_map": [1]}, "no valid 'weight_map'"),
    ({"weight_map": {"fc.weight": 5}}, "no valid 'weight_map'"),
    ({"weight_map": {"fc.weight": "../other/model.safetensors"}}, "names a shard outside the checkpoint folder"),
])
def test_malformed_index_is_one_error(tmp_path, index, message):
    _write_raw_safetensors(tmp_path.parent / "other", {})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint_index(tmp_path)


def test_missing_tensor_is_named(tmp_path, tiny_qwen3_target):
    written = write_dialect(tmp_path, "deepspec", tiny_qwen3_target, "rnn", True)
    del written["layers.1.mlp.down_proj.weight"]
    write(tmp_path, deepspec_config(tiny_qwen3_target, "rnn", True), written)
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) \['layers\.1\.mlp\.down_proj\.weight'\]"):
        DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)


def test_shape_mismatch_names_expected_and_found(tmp_path, tiny_qwen3_target):
    written = write_dialect(tmp_path, "speculators", tiny_qwen3_target, "markov", True)
    written["fc.weight"] = torch.randn(64, 128)  # two taps' worth instead of three
    write(tmp_path, speculators_config(tiny_qwen3_target, "markov", True), written)
    with pytest.raises(CheckpointError, match=r"'fc\.weight' has shape \(64, 128\) but .* expects \(64, 192\)"):
        DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)


def test_unexpected_tensor_is_named(tmp_path, tiny_qwen3_target):
    written = write_dialect(tmp_path, "deepspec", tiny_qwen3_target, "markov", True)
    written["layers.0.self_attn.sinks"] = torch.zeros(4)
    write(tmp_path, deepspec_config(tiny_qwen3_target, "markov", True), written)
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.sinks"):
        DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)


def test_pickle_only_checkpoint_asks_for_safetensors(tmp_path, tiny_qwen3_target):
    (tmp_path / "config.json").write_text(json.dumps(deepspec_config(tiny_qwen3_target, "markov", True)))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match=r"only pytorch_model\.bin.*safetensors only"):
        DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)


def test_native_checkpoint_missing_a_parameter_is_refused(tmp_path, tiny_drafter, tiny_target):
    tiny_drafter.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["markov_head.markov_w2.weight"]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"native format\) is missing tensor\(s\) \['markov_head\.markov_w2"):
        DSparkDraftModel.from_pretrained(tmp_path, target=tiny_target)


def test_integer_tensor_for_a_float_parameter_is_refused(tmp_path, tiny_drafter, tiny_target):
    tiny_drafter.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["fc.weight"] = (state["fc.weight"] * 100).to(torch.int32)  # was cast back to float silently
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"tensor 'fc\.weight' is stored as I32 but the drafter's parameter is "
                                              "floating point"):
        DSparkDraftModel.from_pretrained(tmp_path, target=tiny_target)


def _drop(key):
    return lambda config: config.pop(key)


def _set(key, value):
    return lambda config: config.__setitem__(key, value)


@pytest.mark.parametrize(("damage", "message"), [
    # a default would silently build another drafter (block_size 7 instead of the trained 5)
    (_drop("block_size"), r"it has no \['block_size'\], which every hf-dspark drafter saves"),
    (_set("block_size", "5"), "block_size='5' must be an integer"),
    (_set("block_size", 2.5), "block_size=2.5 must be an integer"),
    (_set("target_layer_ids", "1"), "target_layer_ids='1' must be a list of integers"),
    (_set("use_confidence_head", "no"), "use_confidence_head='no' must be true or false"),
    (_set("target_config", {}), "target_config={} must be the target's text config"),
    (lambda config: config["target_config"].pop("vocab_size"), r"target_config has no \['vocab_size'\]"),
    (_drop("model_type"), "model_type=None on an hf-dspark drafter config"),  # not read as another dialect
    # these loaded, then failed inside drafting (TypeError / ValueError) or skipped the target check silently
    (_set("confidence_threshold", "0.5"), r"confidence_threshold='0\.5' must be a finite number >= 0"),
    (_set("confidence_temperatures", ["1"] * 5), r"confidence_temperatures=\['1', .* must be a list of finite "
                                                 r"numbers > 0"),
    (_set("confidence_temperatures", [0.0] * 5), r"confidence_temperatures=\[0\.0, .* must be a list of finite "
                                                 r"numbers > 0"),
    (_set("confidence_offsets", [None] * 5), r"confidence_offsets=\[None, .* must be a list of finite numbers"),
    (_set("target_embedding_signature", "abc"), "target_embedding_signature='abc' must be a list of finite numbers"),
    # a confusing "vocab_size=96 disagrees with target_config['vocab_size']=96", and transformers' own
    # StrictDataclassError from inside the model's construction for the other target fields
    (lambda config: config["target_config"].__setitem__("vocab_size", "96"),
     r"target_config\['vocab_size'\]='96' must be an integer"),
    (lambda config: config["target_config"].__setitem__("rms_norm_eps", "1e-6"),
     r"target_config is not a valid 'llama' config: .*'rms_norm_eps'"),
    (lambda config: config["target_config"].__setitem__("num_attention_heads", 3),
     r"target_config is not a valid 'llama' config: .*not a multiple of the number of attention heads"),
])
def test_damaged_native_config_is_one_error_naming_the_field(tmp_path, tiny_drafter, tiny_target, damage, message):
    from hf_dspark.loading import ModelLoadError, load_drafter

    tiny_drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    damage(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config\.json \(native format\) is not a valid drafter config: "
                                              + message):
        DSparkDraftModel.from_pretrained(tmp_path, target=tiny_target)
    with pytest.raises(ModelLoadError, match=message):  # the CLI's loader: one line, not a KeyError / TypeError
        load_drafter(tmp_path, tiny_target)


def test_mistyped_foreign_layer_config_is_one_error_naming_the_file(tmp_path, tiny_qwen3_target):
    write_dialect(tmp_path, "speculators", tiny_qwen3_target, "markov", True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["transformer_layer_config"]["hidden_size"] = "64"  # transformers' StrictDataclassError before the fix
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config\.json \(speculators format\) is not a valid drafter config: "
                                              r".*'hidden_size'"):
        DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)


# -------------------------------------------------------------------------------------------------------
# Wrong target
# -------------------------------------------------------------------------------------------------------
def _qwen3_variant(base, seed: int = 0, **changes):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = base.config.to_dict()
    config.pop("layer_types")  # rebuilt for the new layer count
    config.update(changes)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**config)).eval()


@pytest.mark.parametrize(("changes", "message"), [
    ({"hidden_size": 32, "intermediate_size": 64}, "hidden_size=64, but the given target has hidden_size=32"),
    ({"vocab_size": 100}, "vocab_size=96, but the given target has vocab_size=100"),
    ({"num_hidden_layers": 6}, "num_hidden_layers=4, but the given target has num_hidden_layers=6"),
    ({"seed": 7}, "same shapes, different weights"),
])
def test_wrong_target_is_refused(tmp_path, tiny_qwen3_target, changes, message):
    write_dialect(tmp_path, "deepspec", tiny_qwen3_target, "markov", True)
    other = _qwen3_variant(tiny_qwen3_target, **changes)
    with pytest.raises(ValueError, match=message):
        DSparkDraftModel.from_pretrained(tmp_path, target=other)


def test_wrong_family_is_refused(tmp_path, tiny_qwen3_target, tiny_target):
    write_dialect(tmp_path, "deepspec", tiny_qwen3_target, "markov", True)
    with pytest.raises(ValueError, match="model_type=qwen3, but the given target has model_type=llama"):
        DSparkDraftModel.from_pretrained(tmp_path, target=tiny_target)


def test_checkpoint_embedding_gives_the_target_signature(tmp_path, tiny_qwen3_target):
    write_dialect(tmp_path, "speculators", tiny_qwen3_target, "markov", True)
    model = DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)
    assert model.config.target_embedding_signature == embedding_signature(tiny_qwen3_target)


def test_unindexed_weight_files_storing_one_tensor_twice_are_refused(tmp_path, tiny_qwen3_target):
    """Without model.safetensors or an index every *.safetensors is read; one tensor in two files was taken from
    whichever file sorted last, silently."""
    written = write_dialect(tmp_path, "deepspec", tiny_qwen3_target, "markov", True)
    os.rename(tmp_path / "model.safetensors", tmp_path / "drafter.safetensors")
    save_file({"fc.weight": torch.zeros_like(written["fc.weight"])}, str(tmp_path / "old_fc.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor 'fc\.weight' is stored in both drafter\.safetensors and "
                                              r"old_fc\.safetensors"):
        DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)


def test_foreign_load_refuses_options_it_would_ignore_and_honours_device_map(tmp_path, tiny_qwen3_target,
                                                                             monkeypatch):
    """A foreign checkpoint is filled by assignment, not by transformers: its from_pretrained options beyond dtype
    and where to find the files were dropped silently (a typo, a config override, device_map, a bad dtype name)."""
    write_dialect(tmp_path, "deepspec", tiny_qwen3_target, "markov", True)
    with pytest.raises(TypeError, match=r"\['torch_dtpye'\], which a deepspec-format drafter does not take"):
        DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target, torch_dtpye=torch.float16)
    with pytest.raises(TypeError, match=r"\['block_size'\]"):  # native checkpoints take config overrides
        DSparkDraftModel.from_pretrained(tmp_path, block_size=2)
    with pytest.raises(ValueError, match=r"dtype='float1' is not a torch dtype"):
        DSparkDraftModel.from_pretrained(tmp_path, dtype="float1")
    with pytest.raises(ValueError, match=r"device_map=\{'fc': 'cpu', 'layers': 'cuda:1'\}: .* one device"):
        DSparkDraftModel.from_pretrained(tmp_path, device_map={"fc": "cpu", "layers": "cuda:1"})
    casts = []
    cast = DSparkDraftModel._cast_to
    monkeypatch.setattr(DSparkDraftModel, "_cast_to", lambda self, dtype, device=None: casts.append(
        (dtype, device)) or cast(self, dtype, device))
    for device_map in ("cpu", torch.device("cpu"), {"": "cpu"}):
        model = DSparkDraftModel.from_pretrained(tmp_path, device_map=device_map, dtype="bfloat16",
                                                 trust_remote_code=True)
        assert model.device == torch.device("cpu") and model.dtype == torch.bfloat16
    assert casts == [(torch.bfloat16, torch.device("cpu"))] * 3


def test_speculators_export_for_a_deeper_target_is_refused(tmp_path, tiny_qwen3_target):
    """Our speculators export records the target's layer count (hf_dspark block); the given target's count was used
    instead, so a drafter for a 6-layer target loaded for a 4-layer one sharing its embedding, tapping other layers."""
    shapes = layout_shapes(tiny_qwen3_target.config, "markov", True)
    config = speculators_config(tiny_qwen3_target, "markov", True, hf_dspark={"num_target_layers": 6})
    write(tmp_path, config, with_target_tensors(random_tensors(shapes), tiny_qwen3_target))
    with pytest.raises(ValueError, match="num_hidden_layers=6, but the given target has num_hidden_layers=4"):
        DSparkDraftModel.from_pretrained(tmp_path, target=tiny_qwen3_target)
    assert DSparkDraftModel.from_pretrained(tmp_path).config.num_target_layers == 6  # no target: the recorded count
