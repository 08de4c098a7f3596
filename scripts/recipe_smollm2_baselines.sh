#!/usr/bin/env bash
# Equal-budget baselines on SmolLM2-135M-Instruct: DSpark (Markov head), DFlash (no head) and the Eagle3-style
# autoregressive drafter, each trained FROM SCRATCH on the same target cache with the same steps, batch,
# anchors, learning rate, draft vocabulary and seed (one after another, so their timings compare), then scored
# on the same held-out conversations (τ_probabilistic per checkpoint) and, at T=0, on the benchmark prompts.
#   CACHE=runs/cache/smollm2-v4 HOLDOUT_DATA=runs/heldout-v4.jsonl STEPS=600 scripts/recipe_smollm2_baselines.sh
# Continue all three on one more budget (each from its own earlier run, fresh schedule, same settings):
#   INIT_FROM=runs/baselines-600 CACHE=runs/cache/smollm2-v6 HOLDOUT_DATA=runs/heldout-v6.jsonl \
#   HOLDOUT_CACHE=runs/cache/smollm2-v6-holdout STEPS=1200 LR=5e-4 OUT=runs/baselines-1800 scripts/recipe_smollm2_baselines.sh
# Resumable: rerun to continue (training resumes from its last checkpoint; finished stages are skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
RUNS=${RUNS:-runs}
CACHE=${CACHE:-$RUNS/cache/smollm2-v4}
HOLDOUT_DATA=${HOLDOUT_DATA:-$RUNS/heldout-v4.jsonl}
HOLDOUT_CACHE=${HOLDOUT_CACHE:-$RUNS/cache/smollm2-v4-holdout}
STEPS=${STEPS:-600}
LR=${LR:-1e-3}
THREADS=${THREADS:-1}
OUT=${OUT:-$RUNS/baselines-$STEPS}
HEADS=${HEADS:-markov none eagle3}
for head in $HEADS; do
  [ -f "$OUT-$head/drafter/config.json" ] && continue
  INIT=${INIT_FROM:+--init-from $INIT_FROM-$head/drafter}
  .venv/bin/hf-dspark train --cache "$CACHE" --out "$OUT-$head" --head "$head" --num-layers 1 --block-size 7 $INIT \
      --num-anchors 32 --batch-size 4 --grad-accum 1 --steps "$STEPS" --lr "$LR" --draft-vocab-size 8192 \
      --threads "$THREADS" --save-steps 200 --resume --no-progress
done
runs=(); for head in $HEADS; do runs+=("$OUT-$head"); done
$PY scripts/validate_checkpoints.py --runs "${runs[@]}" --data "$HOLDOUT_DATA" --holdout "$(wc -l < "$HOLDOUT_DATA")" \
    --cache "$HOLDOUT_CACHE" --train-cache "$CACHE" --out "$OUT-validation" --threads "$THREADS"
