"""Eagle3DraftModel (the autoregressive baseline): training/inference agreement, the chain's causality,
lossless generate (greedy and batched), save/load and the refusals (training on a cache:
tests/training/test_trainer_eagle3.py)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_llama, make_tiny_qwen3

from hf_dspark import DraftCache, DSparkConfig, DSparkDraftModel, DSparkEngine, Eagle3DraftModel
from hf_dspark.training.anchors import make_block_targets
from hf_dspark.training.losses import LossConfig

GAMMA, TAPS = 4, [0, 1, 2]


def make_eagle3(target, seed: int = 1) -> Eagle3DraftModel:
    torch.manual_seed(seed)
    model = Eagle3DraftModel.from_target(target, block_size=GAMMA, target_layer_ids=TAPS).eval()
    with torch.no_grad():  # larger than the 0.02 init so every path moves the outputs measurably
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.2)
    return model


@pytest.fixture(params=["llama", "qwen3"])
def target(request):
    return make_tiny_llama(seed=0) if request.param == "llama" else make_tiny_qwen3(seed=0)


def _sequence(target, length: int = 14, seed: int = 0):
    """Token ids [1, T] and the target's tapped features [1, T, m·d] for them."""
    from hf_dspark.modeling.target_taps import TargetFeatureTap

    ids = torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad(), TargetFeatureTap(target, TAPS) as tap:
        target(input_ids=ids)
        feats = tap.features()
    return ids, feats


@torch.no_grad()
def test_training_forward_equals_drafting_along_the_same_tokens(target):
    """Slot k of the unrolled training chain is exactly draft_block's state k when the chain is fed the tokens
    draft_block drafted: training optimises the computation that drafts."""
    model = make_eagle3(target)
    ids, feats = _sequence(target)
    p = 8  # the anchor: positions < p committed
    cache = model.extend_context(DraftCache(), feats[:, :p], torch.arange(p)[None], next_ids=ids[:, 1:p + 1])
    block = model.draft_block(cache, ids[:, p], torch.tensor([p]))
    assert block.tokens.shape == (1, GAMMA) and block.confidence is None
    prev_ids = torch.cat([ids[:, p:p + 1], block.tokens[:, :-1]], dim=1)[:, None]  # [1, A=1, γ]
    hidden = model(feats, torch.arange(ids.shape[1])[None], torch.ones_like(ids, dtype=torch.bool),
                   torch.tensor([[p]]), prev_ids, ids)
    torch.testing.assert_close(hidden[0, 0], block.hidden[0], rtol=1e-4, atol=1e-5)
    assert torch.equal(model.compute_draft_logits(hidden[0, 0]).argmax(-1), block.tokens[0])


@torch.no_grad()
def test_context_is_causal_and_extending_in_pieces_equals_at_once(target):
    model = make_eagle3(target)
    ids, feats = _sequence(target)
    pos = torch.arange(10)[None]
    whole = model.extend_context(DraftCache(), feats[:, :10], pos, next_ids=ids[:, 1:11])
    pieces = model.extend_context(DraftCache(), feats[:, :4], pos[:, :4], next_ids=ids[:, 1:5])
    pieces = model.extend_context(pieces, feats[:, 4:10], pos[:, 4:], next_ids=ids[:, 5:11])
    torch.testing.assert_close(pieces.tail, whole.tail, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pieces.keys[0], whole.keys[0], rtol=1e-4, atol=1e-5)
    assert int(whole.tail_positions) == 9
    later = feats.clone()
    later[:, 10:] += 1.0  # positions after the context never matter
    again = model.extend_context(DraftCache(), later[:, :10], pos, next_ids=ids[:, 1:11])
    torch.testing.assert_close(again.tail, whole.tail, rtol=0, atol=0)


def test_out_of_step_context_and_missing_next_ids_are_refused(target):
    model = make_eagle3(target)
    ids, feats = _sequence(target)
    with pytest.raises(ValueError, match="next_ids"):
        model.extend_context(DraftCache(), feats[:, :5], torch.arange(5)[None])
    cache = model.extend_context(DraftCache(), feats[:, :5], torch.arange(5)[None], next_ids=ids[:, 1:6])
    with pytest.raises(ValueError, match="out of step"):
        model.draft_block(cache, ids[:, 7], torch.tensor([7]))


def test_config_refuses_heads_and_layers_eagle3_does_not_have(tiny_target):
    base = DSparkDraftModel.from_target(tiny_target, head="none", use_confidence_head=False).config.to_dict()
    for bad in ({"sequential_head": "markov"}, {"num_hidden_layers": 2}, {"drafter_architecture": "medusa"}):
        with pytest.raises(ValueError):
            DSparkConfig(**{**base, "drafter_architecture": "eagle3", **bad})



def test_an_eagle3_config_is_not_built_by_the_block_class(tmp_path, tiny_target):
    # it built block layers under an eagle3 config: a drafter whose saved checkpoint could not be loaded back
    with pytest.raises(ValueError, match="is built by Eagle3DraftModel, not DSparkDraftModel"):
        DSparkDraftModel.from_target(tiny_target, head="none", use_confidence_head=False, drafter_architecture="eagle3")
    with pytest.raises(ValueError, match="is built by DSparkDraftModel, not Eagle3DraftModel"):
        Eagle3DraftModel(DSparkDraftModel.from_target(tiny_target).config)

def _left_pad(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    return ids, mask


@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_generate_is_identical_to_plain(batch_size):
    target = make_tiny_llama(seed=0)
    draft = make_eagle3(target)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 96, (int(torch.randint(3, 12, (1,), generator=gen)),), generator=gen)
               for _ in range(6)]
    rounds = proposed = 0
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        ids, mask = _left_pad(chunk)
        # the fixed policy drafts every round: the remembered scheduled policy would (rightly) stop proposing an
        # untrained drafter after a few calls, and the identity must hold on the drafting path
        got = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, assistant_model=draft,
                              dspark_policy="fixed", dspark_lookup=False)
        rounds, proposed = rounds + draft.stats.rounds, proposed + draft.stats.proposed_tokens
        for row, prompt in enumerate(chunk):
            expected = target.generate(prompt[None], do_sample=False, max_new_tokens=20)[0, len(prompt):].tolist()
            assert got[row, ids.shape[1]:].tolist()[: len(expected)] == expected
        assert draft.stats.proposed_tokens > 0
    assert rounds > 0 and proposed > 0


def test_an_oracle_trained_chain_is_accepted():
    """A drafter fitted to the target (few steps on the target's own continuation) gets drafts accepted, so the
    acceptance path, not only rejection, runs through generate."""
    target = make_tiny_llama(seed=0)
    draft = make_eagle3(target)
    prompt = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(5))
    plain = target.generate(prompt, do_sample=False, max_new_tokens=40)
    from hf_dspark.modeling.target_taps import TargetFeatureTap

    with torch.no_grad(), TargetFeatureTap(target, TAPS) as tap:
        target(input_ids=plain)
        feats = tap.features()
        target_hidden = target.model(input_ids=plain).last_hidden_state
    n, t = plain.shape
    loss_mask = torch.zeros_like(plain)
    loss_mask[:, 6:] = 1
    anchors = torch.arange(6, t - 1)[None]
    targets = make_block_targets(plain, loss_mask, anchors, torch.ones_like(anchors, dtype=torch.bool), GAMMA,
                                 draft.config.mask_token_id)
    from hf_dspark.training.losses import compute_loss

    optimizer = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    draft.train()
    for _ in range(60):
        hidden = draft(feats, torch.arange(t)[None], torch.ones_like(plain, dtype=torch.bool), anchors,
                       targets.prev_ids, plain)
        loss = compute_loss(draft, hidden, targets, target_hidden, LossConfig.for_head("none")).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    draft.eval()
    out = target.generate(prompt, do_sample=False, max_new_tokens=40, assistant_model=draft)
    assert torch.equal(out, plain)
    assert draft.stats.accepted_tokens > 0


def test_sampling_runs_losslessly_shaped(tiny_target):
    draft = make_eagle3(tiny_target)
    prompt = torch.randint(3, 96, (2, 5), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    out = tiny_target.generate(prompt, do_sample=True, temperature=0.8, top_k=20, max_new_tokens=16,
                               assistant_model=draft)
    assert out.shape[0] == 2 and out.shape[1] <= 5 + 16 and draft.stats.rounds > 0


def test_save_load_round_trip_and_served_by_the_engine(tmp_path, tiny_target):
    draft = Eagle3DraftModel.from_target(tiny_target, block_size=GAMMA, target_layer_ids=TAPS).eval()
    draft.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["drafter_architecture"] == "eagle3"
    loaded = DSparkDraftModel.from_pretrained(tmp_path, target=tiny_target).eval()
    assert type(loaded) is Eagle3DraftModel
    for name, value in draft.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name]), name
    # the engine runs the same round as generate, so an autoregressive drafter is servable (issue #15)
    prompts = [[5, 9, 11, 40, 7, 3], [8, 60, 12], [33, 21, 17, 90, 4]]
    engine = DSparkEngine(tiny_target, loaded, policy="fixed", max_running_requests=3)
    outputs = engine.generate(prompts, 10)
    for prompt, out in zip(prompts, outputs):
        plain = tiny_target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10)[0, len(prompt):]
        assert out.token_ids == plain.tolist()[: len(out.token_ids)] and len(out.token_ids) == 10
