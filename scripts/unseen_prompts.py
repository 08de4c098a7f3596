"""Prompts no drafter under ``data/`` has trained on, for calibrating a drafter before it ships.

A calibration fit is only honest on rounds the drafter never saw. The continuous run trains on every answered
record under ``data/*/train.jsonl``, so this takes the *tails* of the prompt pools it has not reached yet: templated
chat requests (``data/smollm2/prompts_template.jsonl``), GSM8K train questions and code requests written from the
standard library (the regeneration answers those pools from the front, about 200 an hour here, so a tail stays
unseen for days). Every prompt that overlaps an answered record, an evaluation set or the held-out set is dropped.

    python scripts/unseen_prompts.py --per-source 130 --out benchmarks/current/calibration_greedy/prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from hf_dspark.evaluation.benchmarks import default_eval_dir
from hf_dspark.training.prompt_sources import TRAIN_CODE_MODULES, code_prompts, gsm8k_prompts
from hf_dspark.training.prompts import EvalOverlapGuard, read_prompts

logger = logging.getLogger("unseen_prompts")


def answered_turns(data_dir: Path) -> set[str]:
    """First user turns of every answered training record."""
    seen = set()
    for path in sorted(data_dir.glob("*/train.jsonl")):
        seen.update(p.first_turn.strip() for p in read_prompts(path))
    return seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--per-source", type=int, default=130, help="prompts from the tail of each pool")
    p.add_argument("--data", default="data", help="folder whose */train.jsonl records count as seen")
    p.add_argument("--gsm8k", default="../shared/train_data/gsm8k_train.jsonl")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    guard = EvalOverlapGuard.from_dir(default_eval_dir())
    heldout = EvalOverlapGuard.from_dir(Path(args.data) / "heldout")  # the held-out τ set stays untouched too
    seen = answered_turns(Path(args.data))
    pools = {
        "chat (templated)": read_prompts(Path(args.data) / "smollm2" / "prompts_template.jsonl"),
        "gsm8k": gsm8k_prompts(args.gsm8k, guard=guard),
        "code": code_prompts(TRAIN_CODE_MODULES, seed=0, guard=guard),  # the regeneration's seed: the same list
    }
    chosen = []
    for name, pool in pools.items():
        unseen = [q for q in pool if q.first_turn.strip() not in seen and not guard.overlaps(q.first_turn)
                  and not heldout.overlaps(q.first_turn)]
        chosen.extend(unseen[-args.per_source:])
        logger.info("%s: %d of %d prompts unseen, took the last %d", name, len(unseen), len(pool),
                    min(args.per_source, len(unseen)))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for q in chosen:
            f.write(json.dumps({"turns": list(q.turns), "category": q.category}, ensure_ascii=False) + "\n")
    logger.info("%d prompts written to %s", len(chosen), out)


if __name__ == "__main__":
    main()
