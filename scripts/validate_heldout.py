"""τ-vs-training-tokens curve on the held-out set: every checkpoint of the given runs (and plain drafter
directories) scored on a target cache of the target's greedy answers to data/heldout prompts.

Two numbers per checkpoint: greedy block acceptance (τ at T = 0 from every anchor, see
``hf_dspark.evaluation.heldout.greedy_block_acceptance``) and the training metric τ_probabilistic (sampling
acceptance, ``evaluate_on_cache``), split by prompt set (the cache's ids start with heldout-chat / heldout-code).
Training tokens: answer (loss) tokens read, step × sequences per step × the mean answer tokens per sample of the
run's training cache (named in <run>/cache_path, written by the recipe; the stream walks shuffled epochs).

    python scripts/validate_heldout.py --runs runs/a runs/b --drafters hf_dspark/checkpoints/smollm2-135m-instruct-dspark \\
        --cache runs/cache/smollm2-heldout --out runs/curve.json
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from torch.utils.data import Subset

from hf_dspark import DSparkDraftModel
from hf_dspark.loading import load_target
from hf_dspark.training.validation import greedy_block_acceptance
from hf_dspark.training.target_cache import TargetCacheDataset
from hf_dspark.training.trainer import evaluate_on_cache


def run_checkpoints(run: Path) -> list[tuple[int, Path]]:
    found = [(int(d.name.split("-")[-1]), d) for d in run.glob("checkpoint-*") if (d / "config.json").is_file()]
    if (run / "drafter" / "config.json").is_file():
        lines = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").is_file() else []
        final = json.loads(lines[-1])["step"] if lines else -1
        if final not in {s for s, _ in found}:
            found.append((final, run / "drafter"))
    return sorted(found)


def loss_tokens_per_step(run: Path) -> float | None:
    """Sequences per optimizer step × mean answer tokens per sample of the run's cache (None if unknown)."""
    states = sorted(run.glob("checkpoint-*/trainer_state.pt"))
    cache_file = run / "cache_path"
    if not states or not cache_file.is_file():
        return None
    config = torch.load(states[-1], weights_only=False)["config"]
    manifest = json.loads((Path(cache_file.read_text().strip()) / "manifest.json").read_text())
    per_step = config["per_device_batch_size"] * config["gradient_accumulation_steps"]
    return per_step * manifest["num_loss_tokens"] / manifest["num_samples"]


def _subsets(dataset) -> dict[str, Subset]:
    groups: dict[str, list[int]] = {}
    for i, sid in enumerate(dataset.ids):
        name = "code" if "code" in sid else "chat"
        groups.setdefault(name, []).append(i)
    return {name: Subset(dataset, idx) for name, idx in sorted(groups.items())}


def score(drafter, dataset) -> dict:
    row = {}
    for name, subset in _subsets(dataset).items():
        subset.ids = [dataset.ids[i] for i in subset.indices]
        greedy = greedy_block_acceptance(drafter, subset)
        prob = evaluate_on_cache(drafter, subset, num_anchors=64)
        row[name] = {"tau_greedy": greedy["tau_greedy"], "conditional_greedy": greedy["conditional_acceptance"],
                     "tau_probabilistic": prob["tau_probabilistic"], "loss": prob["loss"]}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="*", default=[])
    p.add_argument("--drafters", nargs="*", default=[])
    p.add_argument("--cache", required=True)
    p.add_argument("--out", required=True, help="JSON file (rows already in it are kept and not rescored)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    target, _ = load_target()
    dataset = TargetCacheDataset(args.cache)
    out = Path(args.out)
    rows = json.loads(out.read_text())["rows"] if out.is_file() else []
    done = {(r["run"], r["step"]) for r in rows}
    todo = [(Path(d).name, 0, Path(d), 0) for d in args.drafters]
    for run in map(Path, args.runs):
        per_step = loss_tokens_per_step(run)
        todo += [(run.name, step, d, None if per_step is None else int(step * per_step))
                 for step, d in run_checkpoints(run)]
    for name, step, directory, tokens in todo:
        if (name, step) in done:
            continue
        drafter = DSparkDraftModel.from_pretrained(directory, target=target).eval()
        row = {"run": name, "step": step, "train_tokens": tokens, "path": str(directory), **score(drafter, dataset)}
        rows.append(row)
        logging.info("%s step %s (%s tokens): %s", name, step, tokens,
                     {k: round(v["tau_greedy"], 3) for k, v in row.items() if isinstance(v, dict)})
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"cache": args.cache, "rows": rows}, indent=2))
    print("| run | step | train tokens | chat τ greedy | code τ greedy | chat pos-1 | code pos-1 | chat τ_prob | code τ_prob |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c, k = r.get("chat", {}), r.get("code", {})
        print(f"| {r['run']} | {r['step']} | {r['train_tokens']} | {c.get('tau_greedy', 0):.3f} | "
              f"{k.get('tau_greedy', 0):.3f} | {c.get('conditional_greedy', [0])[0]:.3f} | "
              f"{k.get('conditional_greedy', [0])[0]:.3f} | {c.get('tau_probabilistic', 0):.3f} | "
              f"{k.get('tau_probabilistic', 0):.3f} |")


if __name__ == "__main__":
    main()
