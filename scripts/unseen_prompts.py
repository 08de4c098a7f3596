"""Prompts no drafter under ``data/`` has trained on, for calibrating a drafter before it ships.

A calibration fit is only honest on rounds the drafter never saw, and it is only useful on rounds like the text it
will serve. The continuous run trains on every answered record under ``data/*/train.jsonl``; this takes prompts it
has not reached yet, from sources varied enough to stand for new text:

* ``magpie`` — user requests the target writes itself (Magpie), synthesised here with a seed the training set never
  used (``--magpie-seed``): chat of every kind;
* ``gsm8k`` — the *tail* of the GSM8K-train pool (the regeneration answers it from the front, about 200 an hour
  here, so a tail stays unseen for days);
* ``code`` — code requests written from ``CALIBRATION_CODE_MODULES``, standard-library modules that neither the
  training pool nor the held-out set uses (not a tail of the training pool: regenerations with other seeds ask the
  same functions and reach any tail).
* ``templated`` (not by default) — the unanswered tail of ``data/smollm2/prompts_template.jsonl``. Those come from the
  very templates the drafter trained on: the shipped drafter accepted ~60 % of its first drafts on them against ~31 %
  on the held-out chat, and a fit on them was overconfident on new text.

Every prompt that overlaps an answered record, an evaluation set or the held-out set is dropped. Training data
grows after the file is written, so ``--check FILE`` fails (exit status 1, naming the overlaps) when any prompt of
FILE has since been answered for training; the ship recipe runs it before it calibrates.

    python scripts/unseen_prompts.py --per-source 130 --out benchmarks/current/calibration_greedy/prompts.jsonl
    python scripts/unseen_prompts.py --check benchmarks/current/calibration_greedy/prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from hf_dspark.evaluation.benchmarks import default_eval_dir
from hf_dspark.training.prompt_sources import CALIBRATION_CODE_MODULES, code_prompts, gsm8k_prompts
from hf_dspark.training.prompts import EvalOverlapGuard, read_prompts

logger = logging.getLogger("unseen_prompts")


def answered_turns(data_dir: Path) -> set[str]:
    """First user turns of every answered training record."""
    seen = set()
    for path in sorted(data_dir.glob("*/train.jsonl")):
        seen.update(p.first_turn.strip() for p in read_prompts(path))
    return seen


def check(path: Path, seen: set[str]) -> int:
    """0 when no prompt of ``path`` is a first turn of the training data, else 1 (each overlap logged)."""
    prompts = read_prompts(path)
    trained = [q for q in prompts if q.first_turn.strip() in seen]
    for q in trained[:10]:
        logger.error("trained on (%s): %s", q.category, q.first_turn.strip()[:100].replace("\n", " "))
    if trained:
        logger.error("%d of %d prompts in %s have been trained on: write a new file (--out) before calibrating",
                     len(trained), len(prompts), path)
        return 1
    logger.info("none of the %d prompts in %s has been trained on", len(prompts), path)
    return 0


def magpie_prompts(args, guard, seen: set[str]):
    """``--per-source`` new Magpie prompts (more are asked for: some repeat what training already answered)."""
    import torch

    from hf_dspark.loading import load_target
    from hf_dspark.training.regenerate import synthesise_magpie_prompts
    from hf_dspark.training.training_set import MAGPIE_SYSTEMS

    torch.set_num_threads(args.threads)
    model, tokenizer = load_target()
    Path(args.magpie_file).parent.mkdir(parents=True, exist_ok=True)
    made = synthesise_magpie_prompts(model, tokenizer, args.per_source + args.per_source // 4, seed=args.magpie_seed,
                                     system_prompts=MAGPIE_SYSTEMS, guard=guard, out_path=args.magpie_file)
    return [q for q in made if q.first_turn.strip() not in seen]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--out", help="write the prompts here")
    target.add_argument("--check", metavar="FILE", help="only check that no prompt of FILE has been trained on")
    p.add_argument("--per-source", type=int, default=130, help="prompts from the tail of each pool")
    p.add_argument("--data", default="data", help="folder whose */train.jsonl records count as seen")
    p.add_argument("--gsm8k", default="../shared/train_data/gsm8k_train.jsonl")
    p.add_argument("--pools", nargs="+", default=["magpie", "gsm8k", "code"],
                   choices=["magpie", "gsm8k", "code", "templated"])
    p.add_argument("--magpie-seed", type=int, default=1000,
                   help="first batch seed of the Magpie synthesis (the training set's used 0 onwards)")
    p.add_argument("--magpie-file", default="runs/calib/magpie_prompts.jsonl",
                   help="where synthesised Magpie prompts are kept (a rerun continues from it)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    if args.check:
        raise SystemExit(check(Path(args.check), answered_turns(Path(args.data))))
    guard = EvalOverlapGuard.from_dir(default_eval_dir())
    heldout = EvalOverlapGuard.from_dir(Path(args.data) / "heldout")  # the held-out τ set stays untouched too
    seen = answered_turns(Path(args.data))
    pools = {}
    if "magpie" in args.pools:
        pools["magpie"] = magpie_prompts(args, guard, seen)
    if "gsm8k" in args.pools:
        pools["gsm8k"] = gsm8k_prompts(args.gsm8k, guard=guard)
    if "code" in args.pools:
        pools["code"] = code_prompts(CALIBRATION_CODE_MODULES, seed=0, guard=guard)
    if "templated" in args.pools:
        pools["templated"] = read_prompts(Path(args.data) / "smollm2" / "prompts_template.jsonl")
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
