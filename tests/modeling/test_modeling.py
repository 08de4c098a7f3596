"""DSparkDraftModel: the block attention pattern, the drafter cache, training/inference agreement, save/load."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from hf_dspark import DraftCache, DSparkDraftModel

GAMMA, RANK, TAPS = 4, 8, [0, 1, 2]
FEATURE_SIZE = len(TAPS) * 64
HEADS = ["markov", "gated", "rnn", "none"]


def make_drafter(target, head: str = "markov", num_layers: int = 2, seed: int = 1) -> DSparkDraftModel:
    torch.manual_seed(seed)
    model = DSparkDraftModel.from_target(target, num_layers=num_layers, block_size=GAMMA, head=head,
                                         markov_rank=RANK, target_layer_ids=TAPS).eval()
    with torch.no_grad():  # larger than the 0.02 init so every path moves the outputs measurably
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0, 0.2)
    return model


def features(num_rows: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, num_rows, FEATURE_SIZE, generator=torch.Generator().manual_seed(seed))


def block_hidden(model, feats, anchor_ids, anchor_pos) -> torch.Tensor:
    """forward_block over a cache holding every row of ``feats`` (positions 0..n-1)."""
    positions = torch.arange(feats.shape[1]).expand(feats.shape[0], -1)
    cache = model.extend_context(DraftCache(), feats, positions)
    return model.forward_block(cache, anchor_ids, anchor_pos)


@pytest.fixture(params=["llama", "qwen3"])
def target(request, tiny_target, tiny_qwen3_target):
    return {"llama": tiny_target, "qwen3": tiny_qwen3_target}[request.param]


# -------------------------------------------------------------------------------------------------------
# Attention pattern
# -------------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_forward_block_sees_only_context_before_the_anchor(target):
    model = make_drafter(target)
    feats, anchor, pos = features(10), torch.tensor([5]), torch.tensor([6])
    base = block_hidden(model, feats, anchor, pos)
    later = feats.clone()
    later[:, 6:] = torch.randn_like(later[:, 6:])  # the anchor's own row and everything after it
    torch.testing.assert_close(block_hidden(model, later, anchor, pos), base, rtol=0, atol=1e-6)
    earlier = feats.clone()
    earlier[:, 5] += 1.0
    assert (block_hidden(model, earlier, anchor, pos) - base).abs().max() > 1e-3


@torch.no_grad()
def test_training_forward_isolates_blocks(target):
    model = make_drafter(target)
    feats, positions = features(10), torch.arange(10)[None]
    valid = torch.ones(1, 10, dtype=torch.bool)
    anchors = torch.tensor([[3, 7]])
    block_ids = torch.full((1, 2, GAMMA), model.config.mask_token_id)
    block_ids[0, :, 0] = torch.tensor([11, 12])

    def run(f=feats, ids=block_ids):
        return model(f, positions, valid, anchors, ids)

    base = run()
    after = feats.clone()
    after[:, 7:] += 1.0  # at/after block 1's anchor: neither block may see it
    torch.testing.assert_close(run(after), base, rtol=0, atol=1e-6)
    between = feats.clone()
    between[:, 4] += 1.0  # after block 0's anchor, before block 1's
    out = run(between)
    torch.testing.assert_close(out[:, 0], base[:, 0], rtol=0, atol=1e-6)
    assert (out[:, 1] - base[:, 1]).abs().max() > 1e-3
    other_block = block_ids.clone()
    other_block[0, 1, 0] = 40  # block 1's anchor token: block 0 must not see it
    out = run(ids=other_block)
    torch.testing.assert_close(out[:, 0], base[:, 0], rtol=0, atol=1e-6)
    assert (out[:, 1] - base[:, 1]).abs().max() > 1e-3
    early = feats.clone()
    early[:, 1] += 1.0
    out = run(early)
    assert (out[:, 0] - base[:, 0]).abs().max() > 1e-3 and (out[:, 1] - base[:, 1]).abs().max() > 1e-3


@torch.no_grad()
def test_block_is_bidirectional(target):
    """Slot 0 sees the later slots: with a different mask id every slot changes (not a causal block)."""
    model = make_drafter(target)
    feats, anchor, pos = features(6), torch.tensor([5]), torch.tensor([6])
    base = block_hidden(model, feats, anchor, pos)
    model.config.mask_token_id = 3
    assert (block_hidden(model, feats, anchor, pos)[:, 0] - base[:, 0]).abs().max() > 1e-3


# -------------------------------------------------------------------------------------------------------
# Drafter cache and training/inference agreement
# -------------------------------------------------------------------------------------------------------
def _padded_chunks(feats, chunk_lengths: list[list[int]]):
    """Per round, each row commits its own number of rows; pad to the longest with garbage, marked invalid."""
    starts = [0] * feats.shape[0]
    for round_lengths in zip(*chunk_lengths):
        width = max(round_lengths)
        chunk = torch.randn(feats.shape[0], width, FEATURE_SIZE) * 5  # garbage in padding slots
        positions = torch.zeros(feats.shape[0], width, dtype=torch.long)
        valid = torch.zeros(feats.shape[0], width, dtype=torch.bool)
        for row, length in enumerate(round_lengths):
            chunk[row, :length] = feats[row, starts[row]:starts[row] + length]
            positions[row, :length] = torch.arange(starts[row], starts[row] + length)
            valid[row, :length] = True
            starts[row] += length
        yield chunk, positions, valid


@torch.no_grad()
def test_incremental_cache_matches_scratch(target):
    model = make_drafter(target, head="rnn")
    feats = features(9, batch=2)
    anchors, anchor_pos = torch.tensor([7, 9]), torch.tensor([9, 9])
    scratch = block_hidden(model, feats, anchors, anchor_pos)
    cache = DraftCache()
    for chunk, positions, valid in _padded_chunks(feats, [[3, 1, 5], [2, 4, 3]]):
        model.extend_context(cache, chunk, positions, valid)
    assert cache.num_slots == 3 + 4 + 5
    torch.testing.assert_close(model.forward_block(cache, anchors, anchor_pos), scratch, rtol=0, atol=1e-5)
    incremental = model.draft_block(cache, anchors, anchor_pos)
    full = model.draft_block(model.extend_context(DraftCache(), feats, torch.arange(9).expand(2, -1)), anchors,
                             anchor_pos)
    assert torch.equal(incremental.tokens, full.tokens)
    torch.testing.assert_close(incremental.draft_logits, full.draft_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(incremental.confidence, full.confidence, rtol=0, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("unpredicted", [0, 1])
def test_forward_block_matches_training_forward(target, unpredicted):
    model = make_drafter(target)
    model.config.num_unpredicted_slots = unpredicted  # 1: upstream DFlash, [anchor, MASK × γ], masks predict
    feats = features(10)
    anchor_pos, anchor_id = 6, 17
    block_ids = torch.full((1, 1, GAMMA), model.config.mask_token_id)
    block_ids[0, 0, 0] = anchor_id
    trained = model(feats, torch.arange(10)[None], torch.ones(1, 10, dtype=torch.bool), torch.tensor([[anchor_pos]]),
                    block_ids)
    drafted = block_hidden(model, feats, torch.tensor([anchor_id]), torch.tensor([anchor_pos]))
    assert trained.shape[2] == drafted.shape[1] == GAMMA  # one state per draft either way
    torch.testing.assert_close(trained[:, 0], drafted, rtol=0, atol=1e-5)


@torch.no_grad()
def test_select_rows_keeps_each_rows_context(tiny_target):
    model = make_drafter(tiny_target)
    feats = features(8, batch=3)
    cache = model.extend_context(DraftCache(), feats, torch.arange(8).expand(3, -1))
    anchors, pos = torch.tensor([4, 5, 6]), torch.tensor([8, 8, 8])
    full = model.forward_block(cache, anchors, pos)
    rows = torch.tensor([0, 2])
    torch.testing.assert_close(model.forward_block(cache.select_rows(rows), anchors[rows], pos[rows]), full[rows],
                               rtol=0, atol=1e-5)


# -------------------------------------------------------------------------------------------------------
# Target sharing and families
# -------------------------------------------------------------------------------------------------------
def test_target_embedding_and_head_are_shared_not_owned(tiny_target):
    model = make_drafter(tiny_target)
    names = [name for name, _ in model.named_parameters()]
    assert not any("embed" in name or "lm_head" in name for name in names)
    ids = torch.tensor([[3, 4]])
    assert torch.equal(model.embed(ids), tiny_target.get_input_embeddings()(ids))
    hidden = torch.randn(1, 2, 64, requires_grad=True)
    torch.testing.assert_close(model.compute_logits(hidden), tiny_target.lm_head(hidden))
    (model.compute_logits(hidden).sum() + model.embed(ids).sum()).backward()
    assert hidden.grad is not None
    assert tiny_target.lm_head.weight.grad is None and tiny_target.get_input_embeddings().weight.grad is None


def test_qwen3_drafter_has_qk_norms(tiny_qwen3_target, tiny_target):
    qwen3, llama = make_drafter(tiny_qwen3_target), make_drafter(tiny_target)
    for model in (qwen3, llama):  # new drafters build Qwen3-style layers for any target (they export to vLLM)
        assert "layers.0.self_attn.q_norm.weight" in model.state_dict()
        assert "layers.0.self_attn.k_norm.weight" in model.state_dict()
    legacy = DSparkDraftModel.from_target(tiny_target, num_layers=1, block_size=GAMMA, markov_rank=RANK,
                                          target_layer_ids=TAPS, draft_layer_style="target")
    assert not any("_norm" in name and "self_attn" in name for name in legacy.state_dict())
    assert type(llama.rotary_emb).__name__ == "LlamaRotaryEmbedding"  # RoPE stays the target's
    block = qwen3.draft_block(qwen3.extend_context(DraftCache(), features(5), torch.arange(5)[None]),
                              torch.tensor([3]), torch.tensor([5]))
    assert block.tokens.shape == (1, GAMMA) and torch.isfinite(block.draft_logits).any(-1).all()


# -------------------------------------------------------------------------------------------------------
# Save / load
# -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("head", HEADS)
def test_save_load_round_trip_is_bit_exact(tmp_path, target, head):
    model = make_drafter(target, head=head)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        stored = set(handle.keys())
    assert not any("embed_tokens" in key or "lm_head" in key for key in stored)  # no target tensors
    assert stored == set(model.state_dict())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "dspark_drafter" and config["hf_dspark_version"]
    loaded = DSparkDraftModel.from_pretrained(tmp_path, target=target)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    for name, buffer in model.named_buffers():  # non-persistent (rotary) buffers are rebuilt, not loaded
        assert torch.equal(dict(loaded.named_buffers())[name], buffer), name
    assert loaded.config.to_dict() == model.config.to_dict() | {"_name_or_path": loaded.config._name_or_path}
    cache_args = (features(6), torch.arange(6)[None])
    blocks = [m.draft_block(m.extend_context(DraftCache(), *cache_args), torch.tensor([2]), torch.tensor([6]))
              for m in (model, loaded)]
    assert torch.equal(blocks[0].tokens, blocks[1].tokens)
    # NOTE: weights are bit-identical (above); transformers memory-maps them at unaligned offsets, where BLAS may
    # sum in another order, so outputs agree to float rounding rather than bitwise.
    torch.testing.assert_close(blocks[0].draft_logits, blocks[1].draft_logits, rtol=0, atol=1e-6)



def test_output_loading_info_gives_transformers_pair(tmp_path, tiny_drafter, tiny_target):
    tiny_drafter.save_pretrained(tmp_path)  # the drafter alone was returned: `model, info = ...` raised TypeError
    model, info = DSparkDraftModel.from_pretrained(tmp_path, target=tiny_target, output_loading_info=True)
    assert isinstance(model, DSparkDraftModel) and model.target is tiny_target
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_subfolder_loads_the_drafter_in_it_not_the_one_above(tmp_path, tiny_target):
    """transformers' ``subfolder=`` was ignored: the folder above was loaded (here another drafter, silently)."""
    make_drafter(tiny_target, seed=1).save_pretrained(tmp_path)
    inner = make_drafter(tiny_target, seed=2)
    inner.save_pretrained(tmp_path / "variant")
    loaded = DSparkDraftModel.from_pretrained(tmp_path, subfolder="variant", target=tiny_target)
    for name, tensor in inner.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    with pytest.raises(FileNotFoundError, match="has no subfolder 'absent'"):
        DSparkDraftModel.from_pretrained(tmp_path, subfolder="absent", target=tiny_target)


# -------------------------------------------------------------------------------------------------------
# Growing a trained drafter
# -------------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_grown_drafter_proposes_what_it_did_and_trains_the_new_layer(tmp_path, tiny_target):
    model = make_drafter(tiny_target, num_layers=1)
    cache_args, anchor, pos = (features(8), torch.arange(8)[None]), torch.tensor([3]), torch.tensor([8])
    before = model.draft_block(model.extend_context(DraftCache(), *cache_args), anchor, pos)
    model.grow_layers(3)
    assert len(model.layers) == 3 and model.config.num_hidden_layers == 3
    after = model.draft_block(model.extend_context(DraftCache(), *cache_args), anchor, pos)
    assert torch.equal(after.tokens, before.tokens)
    torch.testing.assert_close(after.draft_logits, before.draft_logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(after.confidence, before.confidence, rtol=0, atol=1e-6)
    # the zeroed output projections get a gradient at once (otherwise the new layer would never train)
    with torch.enable_grad():
        hidden = block_hidden(model, features(8), anchor, pos)
        hidden.square().sum().backward()
    assert model.layers[1].self_attn.o_proj.weight.grad.abs().sum() > 0
    assert model.layers[2].mlp.down_proj.weight.grad.abs().sum() > 0
    model.save_pretrained(tmp_path)
    assert len(DSparkDraftModel.from_pretrained(tmp_path, target=tiny_target).layers) == 3
    with pytest.raises(ValueError, match="shrink"):
        model.grow_layers(2)


def test_drafters_saved_before_layer_styles_load_with_their_targets_layers(tiny_target, tmp_path):
    legacy = DSparkDraftModel.from_target(tiny_target, num_layers=1, block_size=GAMMA, markov_rank=RANK,
                                          target_layer_ids=TAPS, draft_layer_style="target")
    legacy.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["draft_layer_style"]  # what every checkpoint written before the field holds
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = DSparkDraftModel.from_pretrained(tmp_path, target=tiny_target)
    assert loaded.config.draft_layer_style == "target"
    assert loaded.state_dict().keys() == legacy.state_dict().keys()
    with pytest.raises(ValueError, match="draft_layer_style='gpt2' is not one of"):
        DSparkDraftModel.from_target(tiny_target, num_layers=1, draft_layer_style="gpt2")


def test_resaving_with_the_other_layout_loads_what_was_saved_last(tmp_path, tiny_target):
    """transformers' save_pretrained leaves the other layout's weights in the folder (a single file beside new
    shards, or an index whose shards it deleted): the drafter saved before was loaded, silently."""
    first, second = make_drafter(tiny_target, seed=1), make_drafter(tiny_target, seed=2)
    for sizes in (({}, {"max_shard_size": "20KB"}), ({"max_shard_size": "20KB"}, {})):
        path = tmp_path / ("sharded_last" if sizes[1] else "single_last")
        first.save_pretrained(path, **sizes[0])
        second.save_pretrained(path, **sizes[1])
        loaded = DSparkDraftModel.from_pretrained(path, target=tiny_target)
        for name, tensor in second.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), (path.name, name)


def test_a_folder_with_a_single_file_and_a_sharded_checkpoint_is_refused(tmp_path, tiny_target):
    from hf_dspark.modeling.checkpoint_files import CheckpointError

    make_drafter(tiny_target, seed=1).save_pretrained(tmp_path / "single")
    make_drafter(tiny_target, seed=2).save_pretrained(tmp_path, max_shard_size="20KB")
    (tmp_path / "model.safetensors").write_bytes((tmp_path / "single" / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match=r"holds two checkpoints: model\.safetensors and a sharded one"):
        DSparkDraftModel.from_pretrained(tmp_path, target=tiny_target)
