"""scripts/bench_overhead.py --quick (``hf_dspark.evaluation.round_overhead``): every implementation runs under the
oracle, reproduces the greedy continuation, and reports rounds, τ, ms and host syncs per round (the JSON and the
markdown table are written); the sync counter of ``round_probes`` counts what a GPU would sync on."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from hf_dspark.evaluation import round_overhead, round_probes

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_overhead.py"


def test_the_script_runs_the_library_benchmark():
    spec = importlib.util.spec_from_file_location("bench_overhead_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main is round_overhead.main


def test_quick_run_writes_json_and_table(tmp_path):
    doc = round_overhead.main(["--quick", "--impls", "plain", "dspark", "engine", "dflash", "assisted",
                               "--out", str(tmp_path)])
    assert json.loads((tmp_path / "bench_overhead.json").read_text()) == doc
    assert "| ms/round |" in (tmp_path / "bench_overhead.md").read_text()
    results = {(r["batch"], r["variant"], r["impl"]): r for r in doc["results"]}
    measured = [r for r in results.values() if r["status"] == "ok"]
    assert not [r for r in results.values() if not r["status"].startswith(("ok", "n/a"))]  # greedy identity
    for r in measured:
        assert r["rounds"] > 0 and r["ms_per_round"] > 0 and r["syncs_per_round"] is not None
    # the oracle fixes acceptance: 4 of 7 drafts + the bonus token each round (the last round is clipped)
    assert 4.0 <= results[(1, "plain", "dspark")]["tokens_per_round"] <= 5.0
    assert results[(1, "plain", "plain")]["tokens_per_round"] == 1.0
    assert results[(1, "plain", "dflash")]["status"] == "ok"
    assert results[(2, "plain", "dflash")]["status"].startswith("n/a")  # transformers refuses batch > 1
    assert results[(2, "repetition_penalty", "engine")]["status"].startswith("n/a")
    assert results[(1, "plain", "plain")]["syncs_per_round"] >= 1  # the counter sees transformers' own sync


def test_sync_counter_counts_device_to_host_reads_once():
    import torch

    x = torch.arange(4)
    with round_probes.SyncCounter(torch.device("cpu")) as counter:
        x.tolist(), int(x[0]), bool(x.any()), x.sum().item(), x.nonzero(), torch.tensor([1, 2], device=x.device)
        x[1:3] + 1  # indexing with python ints reads nothing back
        # host memory on every machine: no device named, or numpy's own buffer (and reading them back is free)
        torch.tensor([3, 4]).tolist(), torch.from_numpy(x.numpy()).tolist()
    assert (counter.d2h, counter.h2d) == (6, 1)  # the 6th: x.numpy() reads x
    assert torch.Tensor.item is not counter._counting  # patches undone
    assert "item" not in vars(torch.Tensor) and "__bool__" not in vars(torch.Tensor)


def test_the_dflash_assistant_runs_in_both_loops():
    """One DFlash drafter (transformers' format, loaded by hf-dspark too) under both loops: same rounds, same
    output, so the two loops' ms per round compare the loops alone."""
    args = round_overhead.parse_args(["--quick", "--impls", "dflash", "dspark-dflash"])
    args.models, args.batch, args.variants = ["qwen3"], [1, 2], ["plain"]
    results = {(r["batch"], r["impl"]): r for r in round_overhead.run(args)["results"]}
    assert results[(1, "dflash")]["status"] == results[(1, "dspark-dflash")]["status"] == "ok"
    assert results[(1, "dflash")]["rounds"] == results[(1, "dspark-dflash")]["rounds"]
    assert results[(2, "dspark-dflash")]["status"] == "ok"  # our loop runs it at batch > 1 too
    args.models, args.batch = ["llama"], [1]
    on_llama = {r["impl"]: r for r in round_overhead.run(args)["results"]}
    assert on_llama["dspark-dflash"]["status"].startswith("n/a")  # no Qwen3 target: the dialect refuses
