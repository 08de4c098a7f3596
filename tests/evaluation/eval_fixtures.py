"""Shared test data for the evaluation tests: a tiny target, a DSpark and a DFlash drafter, a chat tokenizer
that fits the tiny vocabulary, and two tiny benchmark files in DeepSpec's ``{"turns": [...]}`` format.

A plain module (not a conftest.py), imported by name like tests/training/chat_data.py.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
from conftest import make_tiny_llama

from hf_dspark import DSparkDraftModel


def _load_chat_data():
    # tests/training is not on sys.path for tests in tests/evaluation; load its helper module by file
    spec = importlib.util.spec_from_file_location("chat_data", Path(__file__).resolve().parents[1] / "training"
                                                  / "chat_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_chat_tokenizer = _load_chat_data().make_chat_tokenizer

MATH = ["please count from one to five cat ?", "please count from two to nine dog ?",
        "please count from three to ten bird ?", "please count from four to six fish ?"]
CHAT = [["what red tree ?", "then what ?"], ["what blue sky ?", "then what ?"], ["what green hill ?"]]


def write_eval_dir(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "gsm8k.jsonl").write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in MATH))
    (directory / "mt-bench.jsonl").write_text("".join(json.dumps({"turns": t}) + "\n" for t in CHAT))
    return directory


def make_setup():
    """(target, tokenizer, DSpark drafter, DFlash drafter)."""
    target = make_tiny_llama(seed=0)
    torch.manual_seed(1)
    dspark = DSparkDraftModel.from_target(target, num_layers=1, block_size=5, markov_rank=16).eval()
    torch.manual_seed(2)
    dflash = DSparkDraftModel.from_target(target, num_layers=1, block_size=5, head="none").eval()
    return target, make_chat_tokenizer(), dspark, dflash
