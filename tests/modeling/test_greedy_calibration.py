"""A drafter holds one confidence fit for greedy decoding and one for sampling (greedy matching accepts more
drafts than rejection sampling, so one fit cannot be calibrated for both); every consumer picks the right one."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama

from hf_dspark import DSparkConfig, DSparkDraftModel
from hf_dspark.evaluation.calibration_run import fit_from_trace, save_calibrated
from hf_dspark.evaluation.recorder import RoundTrace
from hf_dspark.hub.model_card import DraftCardInfo, render_model_card
from hf_dspark.modeling.draft_cache import DraftCache
from hf_dspark.modeling.target_taps import TargetFeatureTap

SAMPLING_T, SAMPLING_B = [2.0] * 5, [-1.0] * 5
GREEDY_T, GREEDY_B = [0.5] * 5, [1.0] * 5


@pytest.fixture()
def drafter():
    target = make_tiny_llama(seed=0)
    torch.manual_seed(0)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=5, markov_rank=16).eval()
    draft.config.confidence_temperatures, draft.config.confidence_offsets = list(SAMPLING_T), list(SAMPLING_B)
    draft.config.greedy_confidence_temperatures = list(GREEDY_T)
    draft.config.greedy_confidence_offsets = list(GREEDY_B)
    return target, draft


def test_config_picks_the_fit_per_mode_and_validates():
    config = DSparkConfig(target_config={"model_type": "llama", "vocab_size": 32, "hidden_size": 8,
                                         "num_hidden_layers": 4, "num_attention_heads": 2},
                          target_layer_ids=[0, 1], block_size=3, confidence_temperatures=[2.0] * 3,
                          greedy_confidence_temperatures=[0.5] * 3, greedy_confidence_offsets=[1.0] * 3)
    assert config.calibration_for(greedy=True) == ([0.5] * 3, [1.0] * 3)
    assert config.calibration_for(greedy=False) == ([2.0] * 3, None)
    config.greedy_confidence_temperatures, config.greedy_confidence_offsets = None, None
    assert config.calibration_for(greedy=True) == ([2.0] * 3, None)  # no greedy fit: the general one
    kwargs = {"target_config": config.target_config, "target_layer_ids": [0, 1], "block_size": 3}
    with pytest.raises(ValueError, match="greedy_confidence_temperatures has 2 entries"):
        DSparkConfig(greedy_confidence_temperatures=[1.0, 1.0], **kwargs)
    with pytest.raises(ValueError, match="needs greedy_confidence_temperatures"):
        DSparkConfig(greedy_confidence_offsets=[0.0] * 3, **kwargs)


def test_confidences_per_mode_and_per_row(drafter):
    _, draft = drafter
    z = torch.tensor([[0.5, -1.0, 2.0], [1.0, 0.0, -2.0]])
    sampling = torch.sigmoid(z / 2.0 - 1.0)
    greedy = torch.sigmoid(z / 0.5 + 1.0)
    torch.testing.assert_close(draft.confidence_from_logits(z), sampling)
    torch.testing.assert_close(draft.confidence_from_logits(z, greedy=True), greedy)
    mixed = draft.confidence_from_logits(z, greedy=torch.tensor([True, False]))
    torch.testing.assert_close(mixed, torch.stack([greedy[0], sampling[1]]))
    torch.testing.assert_close(draft.confidence_from_logits(z[:, 1:], first_position=1, greedy=True), greedy[:, 1:])


@torch.no_grad()
def test_draft_block_uses_the_greedy_fit_when_decoding_greedily(drafter):
    target, draft = drafter
    ids = torch.tensor([[5, 9, 3, 17, 4, 8], [7, 2, 11, 6, 13, 1]])
    with TargetFeatureTap(target, draft.config.target_layer_ids) as tap:
        target(input_ids=ids)
        cache = draft.extend_context(DraftCache(), tap.features(), torch.arange(ids.shape[1]).expand(2, -1))
    anchors, positions = torch.tensor([3, 4]), torch.tensor([6, 6])
    greedy = draft.draft_block(cache, anchors, positions, confidence_threshold=0.0)
    sampled = draft.draft_block(cache, anchors, positions, do_sample=True, confidence_threshold=0.0,
                                generator=torch.Generator().manual_seed(0))
    z = greedy.confidence_logits
    torch.testing.assert_close(greedy.confidence, torch.sigmoid(z / 0.5 + 1.0))
    torch.testing.assert_close(sampled.confidence, torch.sigmoid(sampled.confidence_logits / 2.0 - 1.0))
    rows = draft.draft_block(cache, anchors, positions, confidence_threshold=0.0, greedy_rows=torch.tensor([0, 1]).bool())
    torch.testing.assert_close(rows.confidence[0], torch.sigmoid(z[0] / 2.0 - 1.0))
    torch.testing.assert_close(rows.confidence[1], torch.sigmoid(z[1] / 0.5 + 1.0))
    # the early exit reads the same fit: a flat, confident greedy fit drafts, a flat, unconfident sampling fit
    # (used for greedy decoding once the greedy fit is gone) stops at slot 0
    assert bool((z.abs() < 5).all())
    draft.config.greedy_confidence_temperatures, draft.config.greedy_confidence_offsets = [10.0] * 5, [3.0] * 5
    draft.config.confidence_temperatures, draft.config.confidence_offsets = [10.0] * 5, [-3.0] * 5
    assert bool((draft.draft_block(cache, anchors, positions, confidence_threshold=0.5).num_drafts == 5).all())
    draft.config.greedy_confidence_temperatures = draft.config.greedy_confidence_offsets = None
    assert bool((draft.draft_block(cache, anchors, positions, confidence_threshold=0.5).num_drafts == 0).all())


def test_a_greedy_calibration_is_saved_beside_the_sampling_one(drafter, tmp_path):
    target, draft = drafter
    draft.config.greedy_confidence_temperatures = draft.config.greedy_confidence_offsets = None
    gen = torch.Generator().manual_seed(0)
    n = 600
    logits = torch.randn(n, 5, generator=gen) * 2
    accepted = (torch.rand(n, 5, generator=gen) < torch.sigmoid(logits)).long().cumprod(1).sum(1)
    trace = RoundTrace.from_rounds(torch.full((n,), 5), accepted, confidence_logits=logits)
    run = fit_from_trace(trace, serving_temperature=0.0, num_prompts=0, offsets=False)
    save_calibrated(draft, run, tmp_path / "greedy")
    assert draft.config.greedy_confidence_temperatures is None  # the passed drafter is left as it was
    loaded = DSparkDraftModel.from_pretrained(tmp_path / "greedy", target=target)
    assert loaded.config.greedy_confidence_temperatures == pytest.approx(run.temperatures)
    assert loaded.config.confidence_temperatures == pytest.approx(SAMPLING_T)  # the sampling fit is kept
    assert loaded.config.confidence_offsets == pytest.approx(SAMPLING_B)
    resampled = fit_from_trace(trace, serving_temperature=1.0, num_prompts=0, offsets=False)
    save_calibrated(loaded, resampled, tmp_path / "both")
    both = DSparkDraftModel.from_pretrained(tmp_path / "both", target=target)
    assert both.config.confidence_temperatures == pytest.approx(resampled.temperatures)
    assert both.config.greedy_confidence_temperatures == pytest.approx(run.temperatures)
    rows = [{"position": k, "ece_before": 0.1, "ece_after": 0.02, "auc_after": 0.8} for k in range(1, 6)]
    card = str(render_model_card(both, DraftCardInfo(calibration=rows, greedy_calibration=rows)))
    assert "| greedy decoding: T_k |" in card and "own fit" in card
    assert "| greedy decoding: ECE after STS (in-sample) | 2.00% |" in card
    assert "| ECE after STS (in-sample) | 2.00% |" in card
