"""Drafter architectures and sequential heads live in registries: capabilities are asked, never name-compared."""

from __future__ import annotations

import pytest
import torch

from hf_dspark import DSparkDraftModel, Eagle3DraftModel
from hf_dspark.modeling.architectures import (
    DrafterArchitecture,
    architecture_of,
    available_architectures,
    method_label,
    register_drafter_architecture,
    uses_baseline_loss,
)
from hf_dspark.modeling.heads import SEQUENTIAL_HEAD_CLASSES, MarkovHead, register_sequential_head


def test_registered_architectures_and_their_capabilities(tiny_target):
    assert {"block", "eagle3"} <= set(available_architectures())
    dspark = DSparkDraftModel.from_target(tiny_target, num_layers=1, block_size=3, markov_rank=8)
    dflash = DSparkDraftModel.from_target(tiny_target, num_layers=1, block_size=3, head="none")
    eagle3 = Eagle3DraftModel.from_target(tiny_target, block_size=3)
    assert [method_label(d.config) for d in (dspark, dflash, eagle3)] == ["DSpark", "DFlash", "Eagle3"]
    assert architecture_of(dspark.config).exports_to_speculators and not architecture_of(eagle3.config).exports_to_speculators
    assert architecture_of(eagle3.config).autoregressive and architecture_of(eagle3.config).servable
    assert [uses_baseline_loss(d.config) for d in (dspark, dflash, eagle3)] == [False, True, True]


def test_unknown_and_duplicate_architectures_are_refused():
    class Fake:
        drafter_architecture = "tree"

    with pytest.raises(ValueError, match="not registered"):
        architecture_of(Fake())
    with pytest.raises(ValueError, match="already registered"):
        register_drafter_architecture(DrafterArchitecture("block", DSparkDraftModel))


def test_a_registered_sequential_head_is_accepted_by_the_config(tiny_target):
    class DoubledMarkov(MarkovHead):
        def step(self, hidden, prev_emb, state):
            return 2 * prev_emb, state

    register_sequential_head("doubled-markov", DoubledMarkov)
    try:
        draft = DSparkDraftModel.from_target(tiny_target, num_layers=1, block_size=3, head="doubled-markov",
                                             markov_rank=8).eval()
        assert isinstance(draft.markov_head, DoubledMarkov)
        with torch.no_grad():
            ids = torch.tensor([[5, 9, 11, 40]])
            out = tiny_target.generate(ids, do_sample=False, max_new_tokens=6, assistant_model=draft,
                                       dspark_confidence_threshold=0.0)
            assert torch.equal(out, tiny_target.generate(ids, do_sample=False, max_new_tokens=6))
    finally:
        SEQUENTIAL_HEAD_CLASSES.pop("doubled-markov")
    with pytest.raises(ValueError, match="register_sequential_head"):
        DSparkDraftModel.from_target(tiny_target, num_layers=1, block_size=3, head="doubled-markov")
