"""Give a trained drafter a draft vocabulary chosen on broader text (training.draft_vocabulary.with_draft_vocabulary).

The vocabulary is the --size most frequent answer tokens of the given training sources, each source normalised
to a frequency distribution first (so one large source does not decide alone): target caches (--caches, their
supervised tokens) and/or chat-record jsonl files (--data, [.gz], the assistant turns tokenised, end-of-turn
counted). Never pass evaluation or held-out data here. --report-on scores the coverage of the old and new
vocabularies on other caches (e.g. the held-out answers), for the record only.

    python scripts/revocab_drafter.py --drafter hf_dspark/checkpoints/smollm2-135m-instruct-dspark --size 8192 \\
        --data data/smollm2/train.jsonl data/smollm2-magpie/train.jsonl data/smollm2-human/train.jsonl.gz \\
        --out runs/revocab-8k --report-on runs/cache/smollm2-heldout
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
from pathlib import Path

import torch

from hf_dspark import DSparkDraftModel
from hf_dspark.loading import load_target
from hf_dspark.training.draft_vocabulary import (count_answer_tokens, count_text_tokens, coverage,
                                                 most_frequent_tokens, with_draft_vocabulary)


def _records(path: str):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--size", type=int, default=8192)
    p.add_argument("--caches", nargs="*", default=[])
    p.add_argument("--data", nargs="*", default=[])
    p.add_argument("--report-on", nargs="*", default=[])
    p.add_argument("--keep-current", action="store_true",
                   help="keep every token of the drafter's vocabulary (and its sequential-head rows) and add the most "
                        "frequent others up to --size; without it the vocabulary is chosen afresh")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    target, tokenizer = load_target()
    vocab = target.config.get_text_config().vocab_size
    eos = target.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    frequency = torch.zeros(vocab, dtype=torch.float64)
    for cache in args.caches:
        counts = count_answer_tokens(cache, vocab).double()
        frequency += counts / counts.sum()
    for path in args.data:
        texts = [m["content"] + tokenizer.eos_token for r in _records(path) for m in r["messages"]
                 if m["role"] == "assistant"]
        counts = count_text_tokens(tokenizer, texts, vocab).double()
        frequency += counts / counts.sum()
        logging.info("%s: %d answers, %d tokens", path, len(texts), int(counts.sum()))
    drafter = DSparkDraftModel.from_pretrained(args.drafter, target=target)
    old_ids = drafter.draft_to_target.clone()
    keep = eos + (old_ids.tolist() if args.keep_current else [])
    new_ids = most_frequent_tokens((frequency * 1e9).round().long(), args.size, always_include=keep)
    resized = with_draft_vocabulary(drafter, new_ids)
    resized.save_pretrained(args.out)
    report = {"size": args.size, "sources": args.caches + args.data, "kept": int(torch.isin(new_ids, old_ids).sum()),
              "coverage": {}}
    for cache in args.report_on:
        counts = count_answer_tokens(cache, vocab)
        report["coverage"][cache] = {"old": coverage(counts, old_ids), "new": coverage(counts, new_ids)}
    (Path(args.out) / "revocab.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
