"""evaluation.generate_bench (``hf-dspark bench``): the configurations, interleaved timed runs on a tiny target,
greedy identity per configuration, ratios and the printed table."""

from __future__ import annotations

import json

import pytest
import torch

from hf_dspark.evaluation.generate_bench import (BENCHMARKS, GenerateBenchSettings, benchmark_prompts, build_configs,
                                                 SKINNY, headline_table, heldout_prompts, results_table,
                                                 run_generate_bench)


class WordTokenizer:
    """Prompts are words "w<i>"; the chat template is the user text itself."""

    def apply_chat_template(self, messages, add_generation_prompt=True, return_tensors="pt", return_dict=True):
        ids = [int(word[1:]) for word in messages[-1]["content"].split()]
        return {"input_ids": torch.tensor([ids])}


def test_the_default_is_the_headline(tiny_target, tiny_drafter):
    """No variant asked for: plain generate, transformers' prompt lookup and hf-dspark, each divided by plain."""
    configs = build_configs(tiny_target, tiny_drafter, GenerateBenchSettings())
    assert {name: base for name, (_, _, base) in configs.items()} == {
        "plain fp32": "plain fp32", "prompt lookup fp32": "plain fp32", "hf-dspark fp32": "plain fp32"}
    assert all(model is tiny_target for model, _, _ in configs.values())  # no prepacked or bf16 copy is built
    assert configs["hf-dspark fp32"][1] == {"assistant_model": tiny_drafter}
    assert GenerateBenchSettings(variants=True).runs_variants()
    assert GenerateBenchSettings(thresholds=[0.5]).runs_variants()  # a setting only a variant uses implies them


def test_configurations_and_their_baselines(tiny_target, tiny_drafter):
    settings = GenerateBenchSettings(thresholds=[0.5], num_tokens=[2], unpacked_thresholds=[0.25], skip_bf16=True)
    configs = build_configs(tiny_target, tiny_drafter, settings, dflash=tiny_drafter)
    assert {name: base for name, (_, _, base) in configs.items()} == {
        "plain fp32": "plain fp32", "plain fp32 prepacked": "plain fp32", "prompt lookup fp32": "plain fp32",
        # hf-dspark's loop runs the skinny kernel: divided by plain with that kernel; the stock loop by stock plain
        "plain fp32 skinny linears": "plain fp32", "hf-dspark fp32": "plain fp32 skinny linears",
        "hf-dspark fp32, stock linears": "plain fp32", "hf-dspark fp32 prepacked": "plain fp32 prepacked",
        "hf-dspark fp32 prepacked, threshold 0.5": "plain fp32 prepacked",
        "hf-dspark fp32, threshold 0.25": "plain fp32", "hf-dspark fp32 prepacked, γ=2": "plain fp32 prepacked",
        "hf-dflash fp32": "plain fp32"}
    assert configs["hf-dspark fp32 prepacked, γ=2"][1]["dspark_num_tokens"] == 2
    assert configs["plain fp32 skinny linears"][1] == {SKINNY: True}
    assert configs["hf-dspark fp32, stock linears"][1]["dspark_cpu_linears"] is False
    packed_drafter = configs["hf-dspark fp32 prepacked"][1]["assistant_model"]
    assert packed_drafter is not tiny_drafter and packed_drafter.target is configs["plain fp32 prepacked"][0]
    assert tiny_drafter.target is tiny_target  # the original stays bound to the stock target
    only = build_configs(tiny_target, tiny_drafter, GenerateBenchSettings(prepacked_only=True))
    assert set(only) == {"plain fp32 prepacked", "hf-dspark fp32 prepacked"}
    assert set(build_configs(tiny_target, tiny_drafter, GenerateBenchSettings(variants=True))) == {
        "plain fp32", "plain fp32 skinny linears", "plain fp32 prepacked", "prompt lookup fp32", "hf-dspark fp32",
        "hf-dspark fp32, stock linears", "hf-dspark fp32 prepacked", "plain bf16"}


def test_greedy_runs_are_identical_to_plain_and_reported(tiny_target, tiny_drafter):
    settings = GenerateBenchSettings(max_new_tokens=6, temperatures=[0.0, 1.0], skip_bf16=True, num_tokens=[2])
    configs = build_configs(tiny_target, tiny_drafter, settings)
    prompts = [("gsm8k", "w5 w17 w33"), ("mt-bench", "w8 w9")]
    rows = run_generate_bench(WordTokenizer(), configs, prompts, settings)
    greedy = [r for r in rows if r["temperature"] == 0]
    assert {r["config"] for r in greedy} == set(configs)
    assert all(r["identical_to_plain_greedy"] for r in greedy)  # lossless, and prepacked vs prepacked
    sampled = [r for r in rows if r["temperature"] == 1]
    assert "prompt lookup fp32" not in {r["config"] for r in sampled}  # greedy-only configuration skipped
    assert all(r["identical_to_plain_greedy"] is None for r in sampled)
    spec = next(r for r in greedy if r["config"] == "hf-dspark fp32")
    assert spec["tau"] >= 1 and spec["c_draft"] > 0 and spec["bound_speedup"] > 0
    assert next(r for r in greedy if r["config"] == "plain fp32")["ratio_vs_baseline"] == 1.0
    table = results_table(rows)
    assert table.count("\n") == len(rows) + 1 and "| 0 | hf-dspark fp32 |" in table
    json.dumps(rows)  # results.json holds them


def test_the_headline_table_compares_with_plain_and_prompt_lookup(tiny_target, tiny_drafter):
    settings = GenerateBenchSettings(max_new_tokens=6, temperatures=[0.0, 1.0])
    configs = build_configs(tiny_target, tiny_drafter, settings)
    rows = run_generate_bench(WordTokenizer(), configs, [("gsm8k", "w5 w17 w33"), ("mt-bench", "w8 w9")], settings)
    greedy = {r["config"]: r for r in rows if r["temperature"] == 0}
    assert set(greedy) == set(configs) and all(r["identical_to_plain_greedy"] for r in greedy.values())
    assert greedy["plain fp32"]["ratio_vs_plain_fp32"] == 1.0
    assert greedy["prompt lookup fp32"]["ratio_vs_prompt_lookup"] == 1.0
    spec = greedy["hf-dspark fp32"]
    assert spec["tokens"] == greedy["plain fp32"]["tokens"] == 12 and spec["seconds"] > 0
    assert spec["ratio_vs_prompt_lookup"] == pytest.approx(
        spec["ratio_vs_plain_fp32"] / greedy["prompt lookup fp32"]["ratio_vs_plain_fp32"])
    sampled = {r["config"]: r for r in rows if r["temperature"] == 1}
    assert set(sampled) == {"plain fp32", "hf-dspark fp32"}  # prompt lookup runs greedy only
    assert sampled["hf-dspark fp32"]["ratio_vs_prompt_lookup"] is None
    table = headline_table(rows)
    lines = table.splitlines()
    assert lines[0].startswith("| T | configuration | seconds | new tokens | speed × plain | speed × prompt lookup |")
    assert len(lines) == 2 + len(rows)
    assert "| 0 | **hf-dspark** |" in table and "| 0 | transformers prompt lookup |" in table
    assert table.count("| yes |") == 3
    assert "| 1 | plain generate |" in table and lines[-1].endswith("| – | – |")  # sampled: no lookup, no identity


def test_prompts_from_the_benchmarks_or_held_out_records(tmp_path):
    for name in BENCHMARKS:
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"turns": [f"{name} {i}", "x"]}) + "\n"
                                                        for i in range(5)))
    prompts = benchmark_prompts(tmp_path, per_benchmark=2, seed=0)
    assert [b for b, _ in prompts] == [b for b in BENCHMARKS for _ in range(2)]
    assert prompts == benchmark_prompts(tmp_path, per_benchmark=2, seed=0) != benchmark_prompts(tmp_path, 2, seed=3)
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"turns": [f"q{i}"], "category": "math"}) + "\n" for i in range(4)))
    assert heldout_prompts(held, 2) == [("math", "q2"), ("math", "q3")]
    with pytest.raises(FileNotFoundError, match="gsm8k.jsonl not found"):
        benchmark_prompts(tmp_path / "missing", 1, 0)


def test_the_runs_show_a_progress_bar(tiny_target, tiny_drafter, capsys):
    """``hf-dspark bench`` runs for minutes (the README's main job): a bar per prompt and temperature says how far."""
    settings = GenerateBenchSettings(max_new_tokens=2, temperatures=[0.0, 1.0])
    configs = build_configs(tiny_target, tiny_drafter, settings)
    run_generate_bench(WordTokenizer(), configs, [("gsm8k", "w5 w17 w33"), ("mt-bench", "w8 w9")], settings)
    err = capsys.readouterr().err
    assert "bench: 100%" in err and "4/4" in err
    run_generate_bench(WordTokenizer(), configs, [("gsm8k", "w5")], settings, progress=False)
    assert "bench" not in capsys.readouterr().err


def test_an_arm_that_ran_no_round_has_no_tau_instead_of_a_zero_division():
    """A speculative arm whose calls all ended before a round (a one-token answer) raised ZeroDivisionError while its
    row was written, losing the whole benchmark's results."""
    from hf_dspark.evaluation.generate_bench import _result_row
    from hf_dspark.metrics import DSparkStats

    runs = {"plain": {"seconds": [2.0], "tokens": [1], "identical": True, "stats": []},
            "dspark": {"seconds": [1.0], "tokens": [1], "identical": True, "stats": [DSparkStats(block_size=4)]}}
    row = _result_row("dspark", "plain", runs, 0.0)
    assert row["ratio_vs_baseline"] == 2.0 and row.get("tau") is None
