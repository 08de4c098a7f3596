"""Write the off-policy training records: human-written text from this machine as chat records (jsonl.gz).

Sources (hf_dspark/training/human_text.py): standard-library source / docstrings / unit tests of the training
modules (never HELD_OUT_CODE_MODULES), the Python language-reference topics, README sections of installed
packages, and GSM8K human solutions (the *last* --gsm8k questions of the train file: the regenerated on-policy
answers walk the file from the front). Records overlapping the evaluation sets are dropped. Deterministic; the
target cache is then built with ``hf-dspark cache`` (prefill only, no generation).

    python scripts/write_human_text.py --out data/smollm2-human/train.jsonl.gz --gsm8k 1500
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import random
from pathlib import Path

from hf_dspark.training.human_text import (code_source_records, package_readme_records, pydoc_topic_records,
                                           stdlib_test_records)
from hf_dspark.training.prompt_sources import TRAIN_CODE_MODULES, gsm8k_solution_records
from hf_dspark.training.prompts import EvalOverlapGuard


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data/smollm2-human/train.jsonl.gz")
    p.add_argument("--eval-dir", default="../shared/eval_datasets")
    p.add_argument("--gsm8k-file", default="../shared/train_data/gsm8k_train.jsonl")
    p.add_argument("--gsm8k", type=int, default=1500, help="GSM8K human solutions to include (from the end)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    guard = EvalOverlapGuard.from_dir(args.eval_dir)
    sources = [code_source_records(TRAIN_CODE_MODULES, seed=args.seed, guard=guard),
               stdlib_test_records(TRAIN_CODE_MODULES, guard=guard), pydoc_topic_records(guard=guard),
               package_readme_records(guard=guard),
               gsm8k_solution_records(args.gsm8k_file, guard=guard)[-args.gsm8k:] if args.gsm8k else []]
    records = [r for source in sources for r in source]
    random.Random(args.seed).shuffle(records)  # a mix in every shard / early stop
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(out, "wt", encoding="utf-8") as f:
        for i, r in enumerate(records):
            f.write(json.dumps({"id": f"human-{i:05d}", **r}, ensure_ascii=False) + "\n")
    counts = collections.Counter(r["category"] for r in records)
    print(f"{len(records)} records -> {out}: {dict(sorted(counts.items()))}")


if __name__ == "__main__":
    main()
