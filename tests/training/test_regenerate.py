"""Magpie prompt synthesis: written as it goes and resumable (a resumed run equals an uninterrupted one)."""

from __future__ import annotations

import json

from chat_data import make_chat_tokenizer
from conftest import make_tiny_llama

from hf_dspark.training.regenerate import synthesise_magpie_prompts


def _synthesise(model, tok, num, path):
    return synthesise_magpie_prompts(model, tok, num, batch_size=16, max_new_tokens=48, seed=3, out_path=path,
                                     progress=False, system_prompts=(None, "you are a helpful assistant"))


def test_magpie_synthesis_resumes_exactly(tmp_path):
    model, tok = make_tiny_llama(seed=0).eval(), make_chat_tokenizer()
    whole = _synthesise(model, tok, 8, tmp_path / "whole.jsonl")
    assert len(whole) == 8 and len({p.turns for p in whole}) == 8
    assert all(p.category == "magpie" and len(p.turns[0]) >= 12 for p in whole)

    first = _synthesise(model, tok, 1, tmp_path / "resumed.jsonl")  # stops after its first useful batch
    assert len(first) == 1
    with (tmp_path / "resumed.jsonl").open("a") as f:
        f.write('{"turns": ["a write cut sh')  # an interrupted append
    resumed = _synthesise(model, tok, 8, tmp_path / "resumed.jsonl")
    assert [p.turns for p in resumed] == [p.turns for p in whole]
    lines = (tmp_path / "resumed.jsonl").read_text().splitlines()
    assert [json.loads(line)["turns"] for line in lines][:8] == [list(p.turns) for p in whole]
    again = _synthesise(model, tok, 8, tmp_path / "resumed.jsonl")  # nothing left to do: no model call
    assert [p.turns for p in again] == [p.turns for p in whole]
