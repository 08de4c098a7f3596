"""Continue the SmolLM2 drafter's never-ending training run for this session (hf_dspark.training.continuous).

Start it at the beginning of every session, in the background, at one thread; pause it (kill -STOP / -CONT) while
timing anything. It continues from the committed drafter (drafter_training/smollm2/drafter), scores the fixed
held-out set every --eval-every steps into drafter_training/smollm2/curve.jsonl, and rewrites the committed
drafter whenever held-out τ improves: commit both at the end of the session.

    nohup nice -n 19 .venv/bin/python scripts/train_continuous.py --threads 1 > runs/continuous.log 2>&1 &

At the end of a session, stop it and cool a copy down (the rate decaying to zero; it ships the copy when it is the
best yet and leaves the run's own checkpoint as it was):

    .venv/bin/python scripts/train_continuous.py --cool-down 150 --threads 2

Prefilled features are kept in runs/feature-memo (--feature-memo; ~7 KB a token), so only the first epoch on a
machine prefills; on a fresh machine fill it beside the run on the second thread first:

    nohup nice -n 19 .venv/bin/python scripts/train_continuous.py --fill-memo --threads 1 > runs/memo.log 2>&1 &

The held-out validation cache (the target's greedy answers to data/heldout prompts, 128 tokens, committed in
drafter_training/smollm2/heldout_answers.jsonl) is built on first use under runs/. It trains on the target's own answers (data/smollm2*/, grown by ``hf-dspark regenerate`` beside
it); --with-human-text adds human-written text and documentation (``python -m hf_dspark.training.document_text``;
what licences keep out of the repository is read from runs/human/ when present).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from hf_dspark.loading import load_target
from hf_dspark.training.continuous import ContinuousRecipe, cool_down, fill_feature_memo, train_continuously
from hf_dspark.training.target_cache import build_target_cache
from hf_dspark.training.validation import stored_greedy_answer_records

# The target's own answers (on-policy) beat them mixed with human-written text at equal steps on held-out prompts
# (BENCHMARKS.md, "Which data"): human text is opt-in.
# every regeneration folder (data/smollm2, -magpie, -diverse, -magpie2, ...): a new one joins at the next evaluation
ON_POLICY = ["data/smollm2*/train.jsonl"]
HUMAN_TEXT = ["data/smollm2-human/train.jsonl.gz", "data/human/*.jsonl.gz", "runs/human/*.jsonl.gz"]
HELDOUT = ["data/heldout/chat.jsonl", "data/heldout/code.jsonl"]
HELDOUT_ANSWERS = "drafter_training/smollm2/heldout_answers.jsonl"  # committed: every machine scores the same answers


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", nargs="+", default=ON_POLICY, help="chat-record files or glob patterns")
    p.add_argument("--with-human-text", action="store_true",
                   help="also train on human-written text and installed documentation (" + " ".join(HUMAN_TEXT) + ")")
    p.add_argument("--run-dir", default="runs/continuous")
    p.add_argument("--best-dir", default="drafter_training/smollm2/drafter")
    p.add_argument("--curve", default="drafter_training/smollm2/curve.jsonl")
    p.add_argument("--heldout-cache", default="runs/cache/heldout-greedy-128")
    p.add_argument("--init-from", default="hf_dspark/checkpoints/smollm2-135m-instruct-dspark",
                   help="first run only (no drafter in --best-dir yet)")
    p.add_argument("--num-layers", type=int, default=2, help="first run only: deepen --init-from to this many")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--max-hours", type=float, default=None)
    p.add_argument("--lr", type=float, default=ContinuousRecipe.lr)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--num-anchors", type=int, default=64,
                   help="blocks per sequence: 64 balances the prefill a sequence costs against its blocks on CPU")
    features = p.add_mutually_exclusive_group()
    features.add_argument("--bf16-features", dest="bf16_features", action="store_true", default=None,
                          help="prefill with a bf16 copy of the target (default where the CPU has bf16 units or on a "
                               "GPU: twice as fast there; elsewhere bf16 is emulated and many times slower)")
    features.add_argument("--no-bf16-features", dest="bf16_features", action="store_false",
                          help="prefill with the fp32 target (default on CPUs without bf16 units)")
    p.add_argument("--mixed-precision", default="auto", choices=["auto", "no", "bf16"],
                   help="the drafter's step: auto = bf16 autocast on a CPU with bf16 units (AVX512-BF16 / AMX / "
                        "Arm BF16) or a GPU, where it is faster at the same loss; fp32 elsewhere (bf16 is emulated there)")
    p.add_argument("--feature-memo", default="runs/feature-memo",
                   help="keep prefilled target features here so later epochs read them instead of prefilling again "
                        "(about 7 KB a token; deleting it is safe)")
    p.add_argument("--feature-memo-gb", type=float, default=40.0, help="disk cap of the feature memo")
    p.add_argument("--no-feature-memo", action="store_true", help="prefill every read (no disk beyond checkpoints)")
    p.add_argument("--fill-memo", action="store_true",
                   help="prefill every conversation into the feature memo and exit (beside the run, on a spare thread)")
    # it won on held-out code in three seeds of equal steps and tied on chat (BENCHMARKS.md, "Which data")
    p.add_argument("--skip-repeats", type=int, default=8, metavar="N",
                   help="no loss on answer tokens completing an N-gram seen earlier in the conversation (loops: the "
                        "lookup proposer's text at serving time); 0 trains on every answer token")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cool-down", type=int, metavar="STEPS", default=None,
                   help="score (and ship if best) a copy of the run trained STEPS more steps with a decaying rate, "
                        "then exit")
    p.add_argument("--plot", action="store_true",
                   help="draw the curve (curve.png beside --curve, the shipped drafter as reference) and exit")
    return p.parse_args(argv)


def plot(args, target) -> None:
    """curve.png beside the curve file: held-out τ against training tokens, the shipped drafter dashed."""
    from hf_dspark import DSparkDraftModel
    from hf_dspark.evaluation.plots import plot_training_curve
    from hf_dspark.training.continuous import read_curve
    from hf_dspark.training.target_cache import TargetCacheDataset
    from hf_dspark.training.validation import score_prompt_sets

    shipped = DSparkDraftModel.from_pretrained(args.init_from, target=target).float()
    reference = {name: s["tau_greedy"] for name, s in
                 score_prompt_sets(shipped, TargetCacheDataset(args.heldout_cache)).items()}
    out = Path(args.curve).with_suffix(".png")
    plot_training_curve(read_curve(args.curve), out, reference=reference,
                        title="SmolLM2-135M drafter: held-out τ (greedy, full block)")
    print(f"wrote {out} (shipped drafter: {reference})")


def ensure_heldout_cache(target, tokenizer, cache: Path) -> None:
    if (cache / "manifest.json").is_file():
        return
    prompts = [json.loads(line) for path in HELDOUT for line in Path(path).read_text().splitlines() if line.strip()]
    logging.info("Building the held-out validation cache from %d prompts", len(prompts))
    records = stored_greedy_answer_records(target, tokenizer, prompts, HELDOUT_ANSWERS)
    build_target_cache(target, tokenizer, records, cache, progress=False)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target()
    ensure_heldout_cache(target, tokenizer, Path(args.heldout_cache))
    if args.plot:
        plot(args, target)
        return
    recipe = ContinuousRecipe(
        data=args.data + (HUMAN_TEXT if args.with_human_text else []), heldout_cache=args.heldout_cache, run_dir=args.run_dir, best_dir=args.best_dir,
        curve_file=args.curve, init_from=args.init_from, num_layers=args.num_layers, eval_every=args.eval_every,
        max_hours=args.max_hours, lr=args.lr, batch_size=args.batch_size, num_anchors=args.num_anchors,
        bf16_features=args.bf16_features, mixed_precision=args.mixed_precision,
        feature_memo=None if args.no_feature_memo else args.feature_memo, feature_memo_gb=args.feature_memo_gb,
        skip_repeats=args.skip_repeats or None)
    if args.fill_memo:
        fill_feature_memo(target, tokenizer, recipe)
        return
    if args.cool_down:
        cool_down(target, tokenizer, recipe, args.cool_down)
        return
    train_continuously(target, tokenizer, recipe)


if __name__ == "__main__":
    main()
