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

``--sets NAME=FILE[:START[:END]][@CATEGORY] ...`` scores more prompt sets beside the held-out ones, each a fixed
sample (``--per-set``) of a file's rows START..END (of one category prefix). Answered chat records are scored as
written, each answer cut to its first ``--answer-tokens`` tokens as the held-out answers are; prompt files (and with
``--greedy-answers`` chat records too) are answered by the target (greedy, that many tokens), as the held-out prompts
were. This says which data would help: rows the drafter trained on far above rows written after it, it memorises
(more of the same data helps); both alike and the held-out sets below, the held-out gap is one of kind (other prompts
help, more of the same little). The confidence table says how sure the target itself was in each set; the outcome
table how often its token was outside the draft vocabulary.

    .venv/bin/python scripts/diagnose_misses.py --drafters drafter_training/smollm2/drafter --names run \
        --sets "seen-chat=data/smollm2-magpie4/train.jsonl" "new-chat=runs/new/train.jsonl" --out DIR
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import logging
import random
from pathlib import Path

import torch
from torch.utils.data import Subset

from hf_dspark import DSparkDraftModel
from hf_dspark.evaluation.miss_breakdown import (ablation_table, breakdown_table, confidence_table, feature_ablations,
                                                 greedy_miss_breakdown)
from hf_dspark.loading import load_target
from hf_dspark.training.prefill_features import chat_record_files, read_chat_records
from hf_dspark.training.prompts import read_prompts
from hf_dspark.training.target_cache import TargetCacheDataset, build_target_cache, read_jsonl
from hf_dspark.training.validation import greedy_answer_records, prompt_set_of


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
    p.add_argument("--sets", nargs="+", default=[], metavar="NAME=FILE[:START[:END]][@CATEGORY]",
                   help="more prompt sets: samples of chat records (scored as written) or prompt files (answered)")
    p.add_argument("--per-set", type=int, default=24, help="rows sampled per --sets set")
    p.add_argument("--answer-tokens", type=int, default=128, help="answers cut to (or written to) this many tokens")
    p.add_argument("--greedy-answers", action="store_true",
                   help="answer every set's prompts greedily with the target, chat records too (held-out's protocol)")
    p.add_argument("--sets-cache", default="runs/cache/diagnose-sets",
                   help="where the sets' target cache is built (resumable: a set's sample is fixed by its spec)")
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


def sampled_set(spec: str, tokenizer, per_set: int, answer_tokens: int,
                greedy_answers: bool = False) -> tuple[str, list[dict], list[dict]]:
    """``NAME=FILE[:START[:END]][@CATEGORY]`` -> (NAME, chat records with answers cut to ``answer_tokens``, prompts
    ``{"id", "turns"}`` still to answer): a sample fixed by the spec, ids ``NAME/<spec hash>/<row>`` (a cache never
    hands one spec's conversations to another of the same name)."""
    name, _, source = spec.partition("=")
    source, _, category = source.partition("@")
    path, *bounds = source.split(":")
    if not name or not path or len(bounds) > 2:
        raise SystemExit(f"--sets {spec!r}: expected NAME=FILE[:START[:END]][@CATEGORY]")
    start, end = (int(b) if b else None for b in (bounds + ["", ""])[:2])
    records = list(read_jsonl(path))
    answered = not greedy_answers and bool(records) and all(
        any(m.get("role") == "assistant" for m in r.get("messages", ())) for r in records)
    if answered:
        rows = [(r.get("category", ""), r) for r in records]
    else:  # any prompt format: the target answers the first turn
        rows = [(p.category, {"turns": [p.first_turn]}) for p in read_prompts(path)]
    window = [(i, r) for i, (kind, r) in enumerate(rows)
              if (start or 0) <= i and (end is None or i < end) and kind.startswith(category)]
    picked = sorted(random.Random(spec).sample(window, min(per_set, len(window))), key=lambda x: x[0])
    key = f"{spec} {answer_tokens} {'greedy' if not answered else 'as written'}"
    prefix = f"{name}/{hashlib.sha1(key.encode()).hexdigest()[:8]}"
    conversations, prompts = [], []
    for i, record in picked:
        if not answered:
            prompts.append({"id": f"{prefix}/{i}", "turns": record["turns"]})
            continue
        user = next(m for m in record["messages"] if m.get("role") == "user")
        answer = next(m for m in record["messages"] if m.get("role") == "assistant")
        ids = tokenizer(answer["content"], add_special_tokens=False)["input_ids"][:answer_tokens]
        conversations.append({"id": f"{prefix}/{i}", "messages": [
            {"role": "user", "content": user["content"]}, {"role": "assistant", "content": tokenizer.decode(ids)}]})
    return name, conversations, prompts


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
    sets = [(name, dataset, rows) for name, rows in sorted(groups.items())]
    if args.sets:
        picked = [sampled_set(spec, tokenizer, args.per_set, args.answer_tokens, args.greedy_answers)
                  for spec in args.sets]
        cache = Path(args.sets_cache)
        done = set(TargetCacheDataset(cache).ids) if (cache / "manifest.json").is_file() else set()
        records = [r for _, conversations, prompts in picked for r in conversations + greedy_answer_records(
            target, tokenizer, [p for p in prompts if p["id"] not in done], max_new_tokens=args.answer_tokens)]
        build_target_cache(target, tokenizer, records, args.sets_cache, progress=False)
        cached = TargetCacheDataset(args.sets_cache)
        for set_name, conversations, prompts in picked:  # this spec's rows only, whatever else the cache holds
            wanted = {r["id"] for r in conversations + prompts}
            sets.append((set_name, cached, [i for i, sid in enumerate(cached.ids) if sid in wanted]))
    results, ablations = {}, {}
    for name, path in zip(names, args.drafters):
        drafter = DSparkDraftModel.from_pretrained(path, target=target).float()
        for prompt_set, set_data, rows in sets:
            results[f"{name}, {prompt_set}"] = greedy_miss_breakdown(
                drafter, Subset(set_data, rows), target.lm_head, num_anchors=args.num_anchors)
            logging.info("%s, %s: τ %.3f", name, prompt_set, results[f"{name}, {prompt_set}"]["tau_greedy"])
            if args.feature_ablations:
                ablations[f"{name}, {prompt_set}"] = feature_ablations(drafter, Subset(set_data, rows),
                                                                       num_anchors=args.num_anchors)
    yardstick = trigram_yardstick(tokenizer, args.ngram_from, dataset, groups) if args.ngram_from else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "miss_breakdown.json").write_text(json.dumps({"drafters": dict(zip(names, args.drafters)),
                                                         "ngram_from": args.ngram_from, "trigram": yardstick,
                                                         "sets": args.sets,
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
