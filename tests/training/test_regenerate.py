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


def _read(path):
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def _chat_prompts(n):
    from hf_dspark.training.prompts import Prompt

    words = ["count from one to five", "what red cat", "please blue sea and sky", "a dog then a bird",
             "train boat plane", "what sun moon star", "door wall roof floor", "book pen cup hat"]
    return [Prompt((words[i % len(words)] + " " + " ".join(["two"] * (i // len(words))),), "chat") for i in range(n)]


def test_engine_regeneration_equals_generate_when_greedy(tmp_path):
    from hf_dspark.serving import DSparkEngine
    from hf_dspark.training.regenerate import SamplingSettings, regenerate_local, regenerate_with_engine

    model, tok = make_tiny_llama(seed=0).eval(), make_chat_tokenizer()
    prompts, greedy = _chat_prompts(6), SamplingSettings(temperature=0, max_new_tokens=12)
    regenerate_local(model, tok, prompts, tmp_path / "local.jsonl", settings=greedy, batch_size=1)
    engine = DSparkEngine(model, policy="none", max_running_requests=3, tokenizer=tok)
    assert regenerate_with_engine(engine, tok, prompts, tmp_path / "engine.jsonl", settings=greedy,
                                  progress=False) == 6
    assert _read(tmp_path / "engine.jsonl") == _read(tmp_path / "local.jsonl")


def test_engine_regeneration_samples_per_prompt_and_resumes(tmp_path):
    """A prompt's sampled answer depends on the prompt and the seed only: not on its batch, not on a restart."""
    from hf_dspark.serving import DSparkEngine
    from hf_dspark.training.regenerate import SamplingSettings, regenerate_with_engine

    model, tok = make_tiny_llama(seed=0).eval(), make_chat_tokenizer()
    prompts, sampled = _chat_prompts(8), SamplingSettings(temperature=0.8, top_p=0.9, max_new_tokens=16)

    def run(path, todo, running, seed=5):
        engine = DSparkEngine(model, policy="none", max_running_requests=running, tokenizer=tok)
        return regenerate_with_engine(engine, tok, todo, path, settings=sampled, seed=seed, progress=False)

    assert run(tmp_path / "wide.jsonl", prompts, running=8) == 8
    assert run(tmp_path / "narrow.jsonl", prompts[:3], running=1) == 3  # "interrupted" after three prompts
    assert run(tmp_path / "narrow.jsonl", prompts, running=2) == 5  # resumed: only the rest is answered
    wide, narrow = _read(tmp_path / "wide.jsonl"), _read(tmp_path / "narrow.jsonl")
    assert wide == narrow
    assert {r["finish_reason"] for r in wide.values()} <= {"stop", "length"}
    run(tmp_path / "reseeded.jsonl", prompts, running=8, seed=6)
    assert _read(tmp_path / "reseeded.jsonl") != wide  # the seed matters (16 sampled tokens × 8 prompts)
