#!/usr/bin/env bash
# Ship the continuous run's best drafter as the embedded default, measured against the one it replaces:
#   1. copies: the candidate (drafter_training/smollm2/drafter), the shipped drafter, and the candidate's curve row
#   2. both STS fits on prompts it never trained on (checked first; greedy, then T = 1 on top of it)
#   3. ship_drafter.py: bf16 weights, both fits, the model card regenerated from the curve row
#   4. speculators loads the export with equal tensors and logits
#   5. held-out τ by generation, previous vs shipped, T = 0 and T = 1
#   6. AB_RUNS interleaved A/B runs of default generate (bench_fusion --compare-drafter), background training and
#      regeneration paused meanwhile (PAUSE, a pkill pattern; resumed on exit, even on failure)
# Resumable: a step whose output exists is skipped (rerun after an interruption). Takes ~1.5 h on a 2-core CPU
# beside the run; then update BENCHMARKS.md, CHANGELOG.md and the README's τ line from $OUT (docs/training.md).
#   OUT=runs/ship6 DATA="ONE LINE ON THE TRAINING DATA" bash scripts/recipe_smollm2_ship.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
CLI=.venv/bin/hf-dspark
OUT=${OUT:?set OUT, e.g. OUT=runs/ship6}
CANDIDATE=${CANDIDATE:-drafter_training/smollm2/drafter}
CURVE=${CURVE:-drafter_training/smollm2/curve.jsonl}
SHIPPED=hf_dspark/checkpoints/smollm2-135m-instruct-dspark
CARD=model_cards/smollm2-135m-instruct-dspark.md
PROMPTS=${PROMPTS:-benchmarks/current/calibration_greedy/prompts.jsonl}
THREADS=${THREADS:-1}
AB_RUNS=${AB_RUNS:-3}
PAUSE=${PAUSE:-scripts/train_continuous.py --threads|hf-dspark regenerate}
# the card's training-data line carries over unless told otherwise
DATA=${DATA:-$(sed -n 's/^- \*\*data\*\*: //p' "$CARD")}

mkdir -p "$OUT/smollm2"
[ -d "$OUT/previous" ] || cp -r "$SHIPPED" "$OUT/previous"
if [ ! -d "$OUT/candidate" ]; then
  cp -r "$CANDIDATE" "$OUT/candidate"
  # the card reads the curve's best row: keep the candidate's own, whatever rows the run adds meanwhile
  $PY -c "import json, sys; from hf_dspark.training.continuous import best_row, read_curve
print(json.dumps(best_row(read_curve(sys.argv[1]))))" "$CURVE" > "$OUT/smollm2/curve.jsonl"
fi

# a fit is only honest on rounds the drafter never trained on: stop if the training data has reached a prompt
$PY scripts/unseen_prompts.py --check "$PROMPTS"
calibrate() {  # $1 drafter, $2 temperature, $3 out
  [ -f "$3/calibration.json" ] || $CLI calibrate --drafter "$1" --temperature "$2" --prompts "$PROMPTS" \
      --num-prompts 0 --max-new-tokens 96 --batch-size 8 --threads "$THREADS" --out "$3"
}
calibrate "$OUT/candidate" 0 "$OUT/greedy"
calibrate "$OUT/greedy" 1 "$OUT/calibrated"

if ! cmp -s "$OUT/shipped.stamp" "$OUT/calibrated/calibration.json" 2>/dev/null; then
  $PY scripts/ship_drafter.py --drafter "$OUT/calibrated" --curve "$OUT/smollm2/curve.jsonl" --data "$DATA" \
      --calibration "$OUT/calibrated/calibration.json" --greedy-calibration "$OUT/greedy/calibration.json" \
      --confidence-threshold 0.25 --out "$SHIPPED" --card "$CARD"
  cp "$OUT/calibrated/calibration.json" "$OUT/shipped.stamp"
fi
$PY scripts/check_speculators_interop.py --shipped

for T in 0 1; do
  [ -f "$OUT/heldout_t$T/heldout.json" ] || $PY scripts/eval_heldout.py --drafters "$OUT/previous" "$SHIPPED" \
      --names previous shipped --temperature "$T" --out "$OUT/heldout_t$T" --threads "$THREADS"
done

if [ "$AB_RUNS" -gt 0 ]; then
  trap 'pkill -CONT -f "$PAUSE" || true' EXIT
  pkill -STOP -f "$PAUSE" || true
  for R in $(seq 1 "$AB_RUNS"); do
    [ -f "$OUT/ab/r$R/bench_fusion.json" ] || $PY scripts/bench_fusion.py --per-category 2 --heldout 2 --turns 0 \
        --temperatures 0 --compare-drafter "$OUT/previous" --arms plain "prompt lookup" "lookup only" fused \
        --seed "$R" --threads 2 --out "$OUT/ab/r$R"
  done
  pkill -CONT -f "$PAUSE" || true
  grep -h "^- T = " "$OUT"/ab/r*/bench_fusion.md
fi
$PY -c "import json, sys
for path in sys.argv[1:]:
    for name, sets in json.load(open(path))['drafters'].items():
        print(path, name, ' / '.join(f\"{s} {sets[s]['tau']:.3f}\" for s in ('chat', 'code')))" "$OUT"/heldout_t*/heldout.json
echo "shipped $OUT/candidate to $SHIPPED; raw results in $OUT"
