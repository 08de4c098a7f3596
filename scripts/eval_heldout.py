"""τ per position of one or more drafters on the fixed held-out prompt sets (data/heldout/, see its README).

T = 0, confidence threshold 0 (full block), batched; one table per prompt set. Writes <out>/heldout.json, the raw
rounds (<out>/rounds-<drafter>-<set>.npz) and, with --save-answers, the target's greedy answers as chat records
(identical for every drafter at T = 0: they feed the held-out validation cache).

    python scripts/eval_heldout.py --drafters hf_dspark/checkpoints/smollm2-135m-instruct-dspark runs/x/drafter \\
        --names shipped x --out runs/heldout/x --threads 1
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from hf_dspark import DSparkDraftModel
from hf_dspark.loading import load_target
from hf_dspark.evaluation.heldout import read_heldout, run_heldout


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafters", nargs="+", required=True)
    p.add_argument("--names", nargs="+", default=None)
    p.add_argument("--sets", nargs="+", default=["data/heldout/chat.jsonl", "data/heldout/code.jsonl"])
    p.add_argument("--out", required=True)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--save-answers", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


def fmt(values, n=7) -> str:
    return " / ".join(f"{v:.3f}" for v in values[:n])


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("hf_dspark").addFilter(lambda record: record.levelno > logging.INFO)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.names or [Path(d).name for d in args.drafters]
    if len(names) != len(args.drafters):
        raise SystemExit("--names needs one label per drafter")
    target, tokenizer = load_target()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "drafters": {}}
    for name, path in zip(names, args.drafters):
        drafter = DSparkDraftModel.from_pretrained(path, target=target).eval()
        per_set = {}
        for set_path in args.sets:
            set_name = Path(set_path).stem
            run = run_heldout(target, tokenizer, drafter, read_heldout(set_path), max_new_tokens=args.max_new_tokens,
                              batch_size=args.batch_size, temperature=args.temperature, tag=set_name)
            run.trace.save(out / f"rounds-{name}-{set_name}.npz")
            per_set[set_name] = run.summary()
            logging.info("%s on %s: tau %.3f, conditional %s (%d rounds, %.0f s)", name, set_name, run.trace.tau,
                         fmt(per_set[set_name]["conditional_acceptance"]), len(run.trace), run.seconds)
            if args.save_answers:
                with (out / f"answers-{set_name}.jsonl").open("w", encoding="utf-8") as f:
                    for record in run.answers:
                        f.write(json.dumps(record, ensure_ascii=False) + "\n")
        results["drafters"][name] = {"path": str(path), **per_set}
        del drafter
    (out / "heldout.json").write_text(json.dumps(results, indent=2))
    print("| drafter | set | τ | conditional acceptance, positions 1..7 | unconditional 1..7 | draft ms/round |")
    print("|---|---|---|---|---|---|")
    for name, per_set in results["drafters"].items():
        for set_name, s in per_set.items():
            if set_name == "path":
                continue
            print(f"| {name} | {set_name} | {s['tau']:.3f} | {fmt(s['conditional_acceptance'])} | "
                  f"{fmt(s['unconditional_acceptance'])} | {s['draft_ms_per_round']:.1f} |")


if __name__ == "__main__":
    main()
