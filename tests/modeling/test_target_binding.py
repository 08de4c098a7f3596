"""bind_target and from_pretrained(target=): dtype/device follow the target (or an explicit dtype is refused),
mismatch messages never print "None", a drafter config's top-level hidden_size must agree with target_config."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_llama

from hf_dspark import DSparkConfig, DSparkDraftModel


@pytest.fixture(scope="module")
def target():
    return make_tiny_llama(seed=0)


@pytest.fixture(scope="module")
def saved_bf16(target, tmp_path_factory):
    torch.manual_seed(1)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=4, markov_rank=8)
    path = tmp_path_factory.mktemp("binding") / "bf16"
    draft.to(torch.bfloat16).save_pretrained(path)
    return path


def test_bind_target_casts_to_the_target_dtype(target, saved_bf16):
    draft = DSparkDraftModel.from_pretrained(saved_bf16)
    assert draft.dtype == torch.bfloat16
    draft.bind_target(target)
    assert {p.dtype for p in draft.parameters()} == {torch.float32}
    assert draft.draft_to_target is None or draft.draft_to_target.dtype == torch.long
    # it now computes: a raw bf16 x fp32 matmul would have raised here
    assert draft.compute_logits(torch.zeros(1, 64)).dtype == torch.float32


def test_explicit_dtype_with_a_target_is_honoured_or_refused(target, saved_bf16):
    assert DSparkDraftModel.from_pretrained(saved_bf16, target=target).dtype == torch.float32  # follows the target
    assert DSparkDraftModel.from_pretrained(saved_bf16, target=target, dtype="float32").dtype == torch.float32
    with pytest.raises(ValueError, match=r"dtype=torch\.bfloat16 conflicts with the target's torch\.float32"):
        DSparkDraftModel.from_pretrained(saved_bf16, target=target, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"torch_dtype='float16' conflicts with the target's torch\.float32"):
        DSparkDraftModel.from_pretrained(saved_bf16, target=target, torch_dtype="float16")
    assert DSparkDraftModel.from_pretrained(saved_bf16, dtype=torch.float16).dtype == torch.float16  # no target


def test_mismatch_messages_describe_an_unnamed_target(target, saved_bf16):
    draft = DSparkDraftModel.from_pretrained(saved_bf16)
    assert draft.config.target_name_or_path is None
    with pytest.raises(ValueError, match=r"built for an unnamed llama target \(hidden_size=64, 4 layers, "
                                         r"vocab_size=96\)\)\.$") as shapes:
        draft.bind_target(make_tiny_llama(seed=0, num_layers=6))
    with pytest.raises(ValueError, match=r"trained with \(an unnamed llama target .*\): same shapes") as weights:
        draft.bind_target(make_tiny_llama(seed=9))
    assert "None" not in str(shapes.value) and "None" not in str(weights.value)


def test_top_level_hidden_size_must_agree_with_target_config(target, saved_bf16, tmp_path):
    tcfg = target.config.to_dict()
    with pytest.raises(ValueError, match=r"hidden_size=128 disagrees with target_config\['hidden_size'\]=64"):
        DSparkConfig(target_config=tcfg, hidden_size=128)
    assert DSparkConfig(target_config=tcfg).hidden_size == 64
    edited = tmp_path / "edited"
    edited.mkdir()
    for file in saved_bf16.iterdir():
        (edited / file.name).write_bytes(file.read_bytes())
    config = json.loads((edited / "config.json").read_text())
    config["hidden_size"] = 128  # a hand edit that the layers (built from target_config) would never see
    (edited / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="hidden_size=128 disagrees"):
        DSparkDraftModel.from_pretrained(edited)


def test_top_level_vocab_size_must_agree_with_target_config(target, saved_bf16, tmp_path):
    # loaded, then generate died with an IndexError: the step-cost profiler drew ids from the top-level vocab_size
    for file in saved_bf16.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["vocab_size"] = config["target_config"]["vocab_size"] + 100
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"vocab_size=\d+ disagrees with target_config\['vocab_size'\]"):
        DSparkDraftModel.from_pretrained(tmp_path, target=target)


def test_a_feature_tap_records_only_its_own_threads_forwards(tiny_target):
    """Two generate calls on one target in two threads each tap it: neither may read the other's features."""
    import threading

    from hf_dspark.modeling.target_taps import TargetFeatureTap

    with TargetFeatureTap(tiny_target, [0, 2]) as tap, torch.no_grad():
        tiny_target(torch.tensor([[1, 2, 3, 4, 5]]))
        other = threading.Thread(target=lambda: tiny_target(torch.tensor([[1, 2, 3, 4, 5, 6, 7]])))
        other.start()
        other.join()
        assert tap.features().shape[1] == 5


def _rope_buffers(draft) -> dict[str, torch.Tensor]:
    return {name: buffer for name, buffer in draft.named_buffers() if name.startswith("rotary_emb.")}


@torch.no_grad()
def test_rope_frequencies_stay_float32_on_every_path_to_a_bf16_drafter(target, tmp_path):
    """Binding to a bf16 target (and from_target, and a foreign load with dtype=) cast RoPE's inverse frequencies
    to bf16 with the weights: ~0.3 rad of phase at position 500 on these tiny heads (~2 rad at 2048 on Qwen3's),
    so the drafter attended to its context unlike the same weights loaded by transformers' from_pretrained(dtype=),
    which keeps them float32 (as do DeepSpec and vLLM)."""
    from hf_dspark.hub.export import save_as_speculators

    torch.manual_seed(1)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=4, markov_rank=8).eval()
    reference = {name: buffer.clone() for name, buffer in _rope_buffers(draft).items()}
    assert reference and all(buffer.dtype == torch.float32 for buffer in reference.values())
    draft.save_pretrained(tmp_path / "native")
    save_as_speculators(draft, tmp_path / "speculators", verifier_name_or_path="tiny/target")
    bf16_target = make_tiny_llama(seed=0).to(torch.bfloat16)
    drafts = {
        "transformers' dtype=": DSparkDraftModel.from_pretrained(tmp_path / "native", dtype=torch.bfloat16),
        "bound to a bf16 target": DSparkDraftModel.from_pretrained(tmp_path / "native", target=bf16_target),
        "foreign, dtype=": DSparkDraftModel.from_pretrained(tmp_path / "speculators", dtype=torch.bfloat16),
        "from_target": DSparkDraftModel.from_target(bf16_target, num_layers=1, block_size=4, markov_rank=8),
    }
    for how, loaded in drafts.items():
        assert loaded.dtype == torch.bfloat16, how
        for name, buffer in _rope_buffers(loaded).items():
            assert buffer.dtype == torch.float32 and torch.equal(buffer, reference[name]), (how, name)
    # the same weights at bf16 draft the same way, whichever path cast them (context late in a long prompt)
    from hf_dspark import DraftCache

    feats = torch.randn(1, 8, len(draft.config.target_layer_ids) * 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    positions = torch.arange(492, 500)[None]
    hidden = []
    for loaded in (drafts["transformers' dtype="].bind_target(bf16_target), drafts["bound to a bf16 target"],
                   drafts["foreign, dtype="].bind_target(bf16_target)):
        cache = loaded.extend_context(DraftCache(), feats, positions)
        hidden.append(loaded.forward_block(cache, torch.tensor([5]), torch.tensor([500])))
    assert torch.equal(hidden[0], hidden[1]) and torch.equal(hidden[0], hidden[2])
