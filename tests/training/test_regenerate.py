"""Regeneration: Magpie prompt synthesis (written as it goes, resumable), answering on the engine, and
scripts/regenerate.py with your own target, prompt files and an OpenAI-compatible endpoint."""

from __future__ import annotations

import json

import pytest
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


# -------------------------------------------------------------------------------------------------------
# scripts/regenerate.py: your own target and prompt files, answered locally or by an OpenAI-compatible server
# -------------------------------------------------------------------------------------------------------
def _regenerate_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "regenerate.py"
    spec = importlib.util.spec_from_file_location("regenerate_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _own_prompts(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [{"messages": [{"role": "user", "content": "count from one to five"}]},
            {"conversations": [{"from": "human", "value": "what red cat"}]},
            {"turns": ["please blue sea and sky"]},
            {"messages": [{"role": "user", "content": "count from one to five"}]}]  # a duplicate
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "bench.jsonl").write_text(json.dumps({"turns": ["door wall roof floor lamp"]}) + "\n")
    return path


def test_script_answers_your_prompts_with_your_target(tmp_path, capsys):
    model, tok = make_tiny_llama(seed=0), make_chat_tokenizer()
    model.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    prompts = _own_prompts(tmp_path)
    args = ["--target", str(tmp_path / "target"), "--prompts", str(prompts), "--num-template", "0",
            "--num-magpie", "0", "--eval-dir", str(tmp_path / "eval"), "--out", str(tmp_path / "out"),
            "--max-new-tokens", "6", "--batch-size", "2", "--threads", "1"]
    _regenerate_script().main(args)
    records = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert sorted(r["messages"][0]["content"] for r in records) == [
        "count from one to five", "please blue sea and sky", "what red cat"]
    assert all(r["messages"][1]["role"] == "assistant" and 1 <= r["num_new_tokens"] <= 6 for r in records)
    _regenerate_script().main(args)  # resumed: nothing left to answer
    assert len((tmp_path / "out" / "train.jsonl").read_text().splitlines()) == 3
    (tmp_path / "eval" / "bench.jsonl").write_text(json.dumps({"turns": ["what red cat"]}) + "\n")
    with pytest.raises(SystemExit) as exit_:  # a user's mistake: one error line, exit code 2
        _regenerate_script().main([*args, "--out", str(tmp_path / "other")])
    assert exit_.value.code == 2 and "overlap the evaluation" in capsys.readouterr().err


def test_script_answers_through_an_openai_compatible_endpoint(tmp_path):
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    seen = []

    class Server(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, body))
            reply = {"choices": [{"message": {"role": "assistant", "content": "ok: " + body["messages"][0]["content"]},
                                  "finish_reason": "stop"}], "usage": {"completion_tokens": 3}}
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        prompts = _own_prompts(tmp_path)
        _regenerate_script().main([
            "--endpoint", f"http://127.0.0.1:{server.server_port}", "--model-name", "org/served", "--prompts",
            str(prompts), "--num-template", "0", "--num-magpie", "0", "--eval-dir", str(tmp_path / "eval"),
            "--out", str(tmp_path / "out"), "--max-new-tokens", "32", "--temperature", "0.7", "--top-p", "0.8"])
    finally:
        server.shutdown()
    assert len(seen) == 3 and all(path == "/v1/chat/completions" for path, _ in seen)
    assert {(b["model"], b["temperature"], b["top_p"], b["max_tokens"]) for _, b in seen} == {("org/served", 0.7, 0.8, 32)}
    records = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert {r["messages"][1]["content"] for r in records} == {"ok: count from one to five", "ok: what red cat",
                                                              "ok: please blue sea and sky"}
    assert all(r["num_new_tokens"] == 3 and r["finish_reason"] == "stop" for r in records)


def test_answers_land_in_the_file_even_when_it_is_replaced_during_the_run(tmp_path, monkeypatch):
    """git stash / checkout / pull rewrite a tracked file as a new one: a run that kept the old handle wrote every
    later answer into the unlinked file (lost). Each batch now appends to whatever file is at the path."""
    import os

    import hf_dspark.training.regenerate as regenerate
    from hf_dspark.training.regenerate import SamplingSettings, regenerate_local

    model, tok = make_tiny_llama(seed=0).eval(), make_chat_tokenizer()
    out = tmp_path / "train.jsonl"
    real = regenerate._generate_batch

    def batch_after_a_git_rewrite(*args, **kwargs):
        if out.exists():  # what git does to a file it restores: write a new file, rename it over the old
            (tmp_path / "rewritten").write_bytes(out.read_bytes())
            os.replace(tmp_path / "rewritten", out)
        return real(*args, **kwargs)

    monkeypatch.setattr(regenerate, "_generate_batch", batch_after_a_git_rewrite)
    prompts = _chat_prompts(6)
    assert regenerate_local(model, tok, prompts, out, settings=SamplingSettings(temperature=0, max_new_tokens=4),
                            batch_size=2) == 6
    assert len(_read(out)) == 6
