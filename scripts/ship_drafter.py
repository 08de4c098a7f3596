"""Package a trained, calibrated drafter: cast it (bf16 by default), write it with its generated model card, and
keep a copy of the card in model_cards/. This is how hf_dspark/checkpoints/smollm2-135m-instruct-dspark is made:

    python scripts/ship_drafter.py --drafter runs/calib/calibrated --curve drafter_training/smollm2/curve.jsonl \\
        --greedy-calibration runs/calib/greedy/calibration.json --confidence-threshold 0.25 \\
        --out hf_dspark/checkpoints/smollm2-135m-instruct-dspark --card model_cards/smollm2-135m-instruct-dspark.md

(a drafter of the continuous run: ``--curve`` puts its training tokens and its held-out τ and per-position
acceptance into the card; a drafter of ``hf-dspark train`` takes ``--run``/``--cache``/``--eval`` instead).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

import torch

from hf_dspark.hub.model_card import DraftCardInfo, read_calibration, summarize_training
from hf_dspark.hub.upload import CARD_NAME, save_for_hub
from hf_dspark.loading import load_drafter, load_target

logger = logging.getLogger("ship_drafter")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def evaluation_table(results_path: Path, drafter_name: str, baseline_name: str | None) -> dict[str, dict]:
    """benchmark -> {"tau": τ at T=0, "τ (T=1)": .., "<baseline> τ (T=0)": ..} from ``hf-dspark eval``'s
    results.json."""
    results = json.loads(results_path.read_text())["results"]
    table: dict[str, dict] = {}
    for row in results:
        name, temp, tau = row["drafter"], row["temperature"], row["stats"]["tau"]
        entry = table.setdefault(row["benchmark"], {})
        if name == drafter_name:
            entry["tau" if temp == 0 else f"τ (T={temp:g})"] = round(tau, 3)
        elif name == baseline_name:
            entry[f"{baseline_name} τ (T={temp:g})"] = round(tau, 3)
    return table


def curve_summary(curve_path: Path, data: str | None) -> tuple[dict, dict[str, dict]]:
    """Training summary and held-out rows of the best row of a continuous run's ``curve.jsonl`` (the row whose
    weights ``drafter/`` holds): tokens seen, steps, loss, and per held-out prompt set τ and acceptance."""
    from hf_dspark.training.continuous import best_row, read_curve

    row = best_row(read_curve(curve_path))
    if row is None:
        raise SystemExit(f"{curve_path} has no rows: train first (scripts/train_continuous.py)")
    training = {"data": data or "the target's own answers (and, before 2.15 M tokens, human-written text)",
                "training tokens": f"{row['train_tokens']:,} (all sessions of the continuous run)",
                "final loss": row["train_loss"]}
    if row.get("cool_down_steps"):
        training["cool-down"] = f"{row['cool_down_steps']} steps with the rate decaying to zero"
    evaluation = {}
    for name, scores in row["heldout"].items():
        evaluation[f"held-out {name} ({curve_path.parent.name} curve)"] = {
            "tau": round(scores["tau_greedy"], 3),
            "acceptance at positions 1..γ (given the drafts before it were accepted)":
                " / ".join(f"{a:.2f}" for a in scores["acceptance"])}
    return training, evaluation


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True, help="trained (and calibrated) drafter directory")
    p.add_argument("--out", required=True, help="where the shipped drafter goes")
    p.add_argument("--card", default=None, help="also copy the model card here (e.g. model_cards/<name>.md)")
    p.add_argument("--run", default=None, help="training run directory (metrics.jsonl) for the card")
    p.add_argument("--cache", default=None, help="target cache directory (data size) for the card")
    p.add_argument("--data", default=None, help="one-line description of the training data for the card")
    p.add_argument("--eval", default=None, help="hf-dspark eval results.json for the τ table")
    p.add_argument("--curve", default=None,
                   help="curve.jsonl of a continuous run: training tokens and held-out τ of its best row for the card")
    p.add_argument("--eval-name", default="DSpark", help="this drafter's name in results.json")
    p.add_argument("--baseline-name", default="DFlash", help="baseline drafter shown next to it in the card")
    p.add_argument("--calibration", default=None, help="calibration.json (default: <drafter>/calibration.json)")
    p.add_argument("--greedy-calibration", default=None,
                   help="calibration.json of the greedy fit (hf-dspark calibrate --temperature 0), shown beside it")
    p.add_argument("--repo-id", default=None, help="Hub id the card names")
    p.add_argument("--target", default=None, help="target model path / id (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--confidence-threshold", type=float, default=None,
                   help="default dspark_confidence_threshold stored in the config (choose it on held-out prompts, "
                        "e.g. with hf-dspark bench --prompts ... --thresholds ...)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    target, _ = load_target(args.target)
    draft = load_drafter(args.drafter, target).model.to(DTYPES[args.dtype]).eval()
    if args.confidence_threshold is not None:
        if not 0.0 <= args.confidence_threshold <= 1.0:
            p.error(f"--confidence-threshold must be in [0, 1], got {args.confidence_threshold}")
        draft.config.confidence_threshold = args.confidence_threshold
    info = DraftCardInfo(license="apache-2.0")
    if args.run or args.cache:
        info.training = summarize_training(args.cache, args.run, data=args.data)
    if args.curve:
        info.training, info.evaluation = curve_summary(Path(args.curve), args.data)
    if args.eval:
        info.evaluation.update(evaluation_table(Path(args.eval), args.eval_name, args.baseline_name))
    calibration = Path(args.calibration or Path(args.drafter) / "calibration.json")
    if calibration.is_file():
        info.calibration = read_calibration(calibration)
    if args.greedy_calibration:
        info.greedy_calibration = read_calibration(args.greedy_calibration)
    out = save_for_hub(draft, args.out, info=info, repo_id=args.repo_id)
    if args.card:
        shutil.copyfile(out / CARD_NAME, args.card)
    size = sum(f.stat().st_size for f in Path(out).iterdir() if f.is_file())
    logger.info("Shipped %s (%s) to %s: %.1f MB", args.drafter, args.dtype, out, size / 2**20)


if __name__ == "__main__":
    main()
