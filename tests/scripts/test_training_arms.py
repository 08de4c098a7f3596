"""``compare_training_arms.py``: the arms' loss is the continuous run's unless --ce-weight / --l1-weight / --decay say
otherwise, and the row records which weights an arm trained with."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_wrappers import load_script

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # the script imports train_continuous


@pytest.fixture(scope="module")
def arms():
    return load_script("compare_training_arms")


def drafter_with(head: str):
    return SimpleNamespace(config=SimpleNamespace(sequential_head=head))


def test_arms_default_to_the_heads_own_loss(arms):
    args = arms.parse_args(["--start", "D", "--arms", "onpolicy-constant", "--out", "O"])
    dspark = arms.loss_config(drafter_with("markov"), args)
    assert (dspark.ce_weight, dspark.l1_weight) == (0.1, 0.9)
    dflash = arms.loss_config(drafter_with("none"), args)
    assert (dflash.ce_weight, dflash.l1_weight) == (1.0, 0.0)


def test_weights_given_override_only_themselves(arms):
    args = arms.parse_args(["--start", "D", "--arms", "onpolicy-constant", "--out", "O", "--ce-weight", "1.0"])
    config = arms.loss_config(drafter_with("markov"), args)
    assert (config.ce_weight, config.l1_weight, config.confidence_weight, config.decay) == (1.0, 0.9, 1.0, 4.0)
    config = arms.loss_config(drafter_with("markov"), arms.parse_args(
        ["--start", "D", "--arms", "onpolicy-constant", "--out", "O", "--decay", "2"]))
    assert (config.ce_weight, config.l1_weight, config.decay) == (0.1, 0.9, 2.0)


def test_arms_keep_the_starts_depth_unless_told(arms):
    base = ["--start", "D", "--arms", "onpolicy-constant", "--out", "O"]
    assert arms.parse_args(base).num_layers is None
    assert arms.parse_args(base + ["--num-layers", "3"]).num_layers == 3


def test_a_bad_arm_is_refused(arms):
    with pytest.raises(SystemExit):
        arms.parse_args(["--start", "D", "--arms", "onpolicy-hourly", "--out", "O"])


def test_the_composed_requests_are_an_arm_of_their_own(arms):
    args = arms.parse_args(["--start", "D", "--arms", "requests-constant", "onpolicy-constant", "--out", "O"])
    assert args.arms == ["requests-constant", "onpolicy-constant"]
    assert arms.DATA["requests"] == ["data/smollm2-requests/train.jsonl"]
