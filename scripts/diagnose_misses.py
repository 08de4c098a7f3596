"""Why drafters miss on held-out text: each reached block slot's miss by cause, position 1 by the target's confidence
(hf_dspark.evaluation.miss_breakdown), per drafter and held-out prompt set, on the continuous run's held-out cache.

    .venv/bin/python scripts/diagnose_misses.py --drafters hf_dspark/checkpoints/smollm2-135m-instruct-dspark \\
        drafter_training/smollm2/drafter --names shipped run --out benchmarks/current/miss_breakdown

Writes DIR/miss_breakdown.json (raw counts) and DIR/miss_breakdown.md (the tables). The cache must exist (the
continuous run builds it on first use: ``scripts/train_continuous.py``).

``--ngram-from "data/smollm2*/train.jsonl"`` adds a yardstick: how often a trigram model counted over those files'
answers (backing off to bigrams) names the next token at the same held-out positions. A drafter that barely beats it
gets little from the target's features. ``--feature-ablations`` says how much τ rests on those features: scored again
with them zeroed, taken from another conversation, or noised (DIR/feature_ablations.json, a table in the .md).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
from pathlib import Path

import torch
from torch.utils.data import Subset

from hf_dspark import DSparkDraftModel
from hf_dspark.evaluation.miss_breakdown import (ablation_table, breakdown_table, confidence_table, feature_ablations,
                                                 greedy_miss_breakdown)
from hf_dspark.loading import load_target
from hf_dspark.training.prefill_features import chat_record_files, read_chat_records
from hf_dspark.training.target_cache import TargetCacheDataset
from hf_dspark.training.validation import prompt_set_of


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafters", nargs="+", required=True)
    p.add_argument("--names", nargs="+", default=None, help="one per drafter (default: the paths)")
    p.add_argument("--heldout-cache", default="runs/cache/heldout-greedy-128")
    p.add_argument("--num-anchors", type=int, default=128, help="as the continuous run's validation")
    p.add_argument("--ngram-from", nargs="+", default=None, metavar="FILE",
                   help="chat-record files or globs whose answers a trigram yardstick counts")
    p.add_argument("--feature-ablations", action="store_true",
                   help="also score each drafter with the target's features zeroed, from another conversation, noised")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def trigram_yardstick(tokenizer, files: list[str], dataset, groups: dict[str, list[int]]) -> dict[str, dict]:
    """Per prompt set: answer positions whose next token the training answers' most frequent trigram continuation
    (seen at least twice, else the bigram's) names, out of all answer positions with a next answer token."""
    bigram: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    trigram: dict[tuple[int, int], collections.Counter] = collections.defaultdict(collections.Counter)
    for record in read_chat_records(chat_record_files(files)):
        for message in record["messages"]:
            if message["role"] == "assistant":
                ids = tokenizer(message["content"], add_special_tokens=False)["input_ids"]
                for a, b in zip(ids, ids[1:]):
                    bigram[a][b] += 1
                for a, b, c in zip(ids, ids[1:], ids[2:]):
                    trigram[(a, b)][c] += 1
    out = {}
    for prompt_set, rows in sorted(groups.items()):
        hits = total = 0
        for i in rows:
            ids, answer = dataset[i]["input_ids"].tolist(), dataset[i]["loss_mask"].tolist()
            for p in range(1, len(ids) - 1):
                if answer[p] and answer[p + 1]:
                    seen = trigram[(ids[p - 1], ids[p])].most_common(1)
                    guess = seen[0][0] if seen and seen[0][1] >= 2 else next(
                        (t for t, _ in bigram[ids[p]].most_common(1)), -1)
                    hits += guess == ids[p + 1]
                    total += 1
        out[prompt_set] = {"positions": total, "accepted": hits}
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    names = args.names or args.drafters
    if len(names) != len(args.drafters):
        raise SystemExit(f"--names gives {len(names)} names for {len(args.drafters)} drafters")
    target, tokenizer = load_target()
    dataset = TargetCacheDataset(args.heldout_cache)
    groups: dict[str, list[int]] = {}
    for i, sid in enumerate(dataset.ids):
        groups.setdefault(prompt_set_of(sid), []).append(i)
    results, ablations = {}, {}
    for name, path in zip(names, args.drafters):
        drafter = DSparkDraftModel.from_pretrained(path, target=target).float()
        for prompt_set, rows in sorted(groups.items()):
            results[f"{name}, {prompt_set}"] = greedy_miss_breakdown(
                drafter, Subset(dataset, rows), target.lm_head, num_anchors=args.num_anchors)
            logging.info("%s, %s: τ %.3f", name, prompt_set, results[f"{name}, {prompt_set}"]["tau_greedy"])
            if args.feature_ablations:
                ablations[f"{name}, {prompt_set}"] = feature_ablations(drafter, Subset(dataset, rows),
                                                                       num_anchors=args.num_anchors)
    yardstick = trigram_yardstick(tokenizer, args.ngram_from, dataset, groups) if args.ngram_from else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "miss_breakdown.json").write_text(json.dumps({"drafters": dict(zip(names, args.drafters)),
                                                         "ngram_from": args.ngram_from, "trigram": yardstick,
                                                         "results": results}, indent=1) + "\n")
    text = ("Share of reached slots by outcome (slot 1 and all slots)\n\n" + breakdown_table(results)
            + "\n\nPosition-1 acceptance by the target's top-1 probability (share of positions)\n\n"
            + confidence_table(results) + "\n")
    if yardstick:
        text += "\nTrigram yardstick (position 1, all answer positions): " + ", ".join(
            f"{name} {100 * y['accepted'] / max(y['positions'], 1):.1f} %" for name, y in yardstick.items()) + "\n"
    if ablations:
        (out / "feature_ablations.json").write_text(json.dumps(ablations, indent=1) + "\n")
        text += "\nτ (position-1 acceptance) with the target's features altered\n\n" + ablation_table(ablations) + "\n"
    (out / "miss_breakdown.md").write_text(text)
    print((out / "miss_breakdown.md").read_text())


if __name__ == "__main__":
    main()
