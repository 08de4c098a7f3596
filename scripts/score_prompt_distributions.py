"""Is the drafter's held-out τ limited by what it learned, or by how far the held-out prompts are from its training
prompts? Score it (greedy block acceptance, T = 0, full block, every anchor) on the target's greedy answers to a
sample of prompts it *trained* on, to new prompts from the *same* source, and to the held-out set.

Train ≫ same-source new prompts: it memorises (more of the same data helps). New ≈ train ≫ held-out: it generalises
within its prompt distribution, and the held-out gap is the distribution's (other kinds of prompt help, more tokens of
the same kind little).

    python scripts/score_prompt_distributions.py --drafter drafter_training/smollm2/drafter \\
        --set trained=data/smollm2-magpie/train.jsonl --set new=runs/calib2/magpie_prompts.jsonl \\
        --num 24 --out runs/distribution-gap
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from pathlib import Path

import torch
from torch.utils.data import Subset

from hf_dspark import DSparkDraftModel
from hf_dspark.loading import load_target
from hf_dspark.training.prompts import read_prompts
from hf_dspark.training.target_cache import TargetCacheDataset, build_target_cache
from hf_dspark.training.validation import greedy_answer_records, greedy_block_acceptance, prompt_set_of


def first_turns(path: str, num: int, seed: int) -> list[str]:
    """``num`` first user turns, sampled with ``seed``, from a prompt file (``turns``) or chat records (``messages``)."""
    turns = [prompt.first_turn for prompt in read_prompts(path)]
    return random.Random(seed).sample(turns, min(num, len(turns)))


@torch.no_grad()
def target_top1_probability(target, dataset) -> float:
    """The target's mean top-1 probability over the answer tokens it wrote: how sure the target itself is on a set
    (a drafter matches a less certain target less often, however well it is trained)."""
    total, count = 0.0, 0
    for i in range(len(dataset)):
        sample = dataset[i]
        probs = target(input_ids=sample["input_ids"][None]).logits[0, :-1].float().softmax(-1)
        predicts_answer = sample["loss_mask"][1:].bool()  # positions whose next token is an answer token
        total += float(probs.max(-1).values[predicts_answer].sum())
        count += int(predicts_answer.sum())
    return total / max(count, 1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default="drafter_training/smollm2/drafter")
    p.add_argument("--set", action="append", default=[], metavar="NAME=FILE",
                   help="a prompt set: prompt jsonl (turns) or chat records (messages); repeatable")
    p.add_argument("--heldout-cache", default="runs/cache/heldout-greedy-128",
                   help="the continuous run's held-out cache (scored per prompt set as well)")
    p.add_argument("--num", type=int, default=24, help="prompts sampled per set")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="folder for the caches and scores.json")
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target()
    drafter = DSparkDraftModel.from_pretrained(args.drafter, target=target).float()
    out = Path(args.out)
    datasets = {}
    for spec in args.set:
        name, _, path = spec.partition("=")
        cache = out / f"cache-{name}"
        if not (cache / "manifest.json").is_file():
            prompts = [{"id": f"{name}-{i:03d}", "turns": [t]} for i, t in enumerate(first_turns(path, args.num,
                                                                                                args.seed))]
            records = greedy_answer_records(target, tokenizer, prompts, max_new_tokens=args.max_new_tokens)
            build_target_cache(target, tokenizer, records, cache, progress=False)
        datasets[name] = TargetCacheDataset(str(cache))
    if args.heldout_cache and (Path(args.heldout_cache) / "manifest.json").is_file():
        heldout = TargetCacheDataset(args.heldout_cache)
        for part in ("chat", "code"):
            rows = [i for i, sid in enumerate(heldout.ids) if prompt_set_of(sid) == part]
            datasets[f"held-out {part}"] = Subset(heldout, rows)
    scores = {}
    for name, dataset in datasets.items():
        s = greedy_block_acceptance(drafter, dataset)
        sure = target_top1_probability(target, dataset)
        scores[name] = {"prompts": len(dataset), "tau_greedy": round(s["tau_greedy"], 4),
                        "acceptance": [round(a, 4) for a in s["conditional_acceptance"]],
                        "target_top1_probability": round(sure, 4)}
        print(f"{name:>16}: τ {s['tau_greedy']:.3f}, position-1 acceptance {s['conditional_acceptance'][0]:.1%}, "
              f"target's top-1 probability {sure:.3f} ({len(dataset)} prompts)", flush=True)
    (out / "scores.json").write_text(json.dumps({"drafter": args.drafter, "scores": scores}, indent=1) + "\n")


if __name__ == "__main__":
    main()
