#!/usr/bin/env bash
# Continue the SmolLM2 recipe with more Magpie data (stage 2 = session 3: PREV=smollm2 NEXT=smollm2-v3 NUM_MAGPIE=700 STEPS=1700;
# stage 3 = session 4: PREV=smollm2-v3 NEXT=smollm2-v4 NUM_MAGPIE=1400 STEPS=1500 MAX_MINUTES=42 EVAL_SAMPLES=6;
# stage 4 = session 5, same data, drafters deepened to 2 layers: PREV=smollm2-v4 NEXT=smollm2-v5 SKIP_REGENERATE=1
#   NEXT_CACHE=runs/cache/smollm2-v4 GROW_TO_LAYERS=2 STEPS=2200 MAX_MINUTES=80 EVAL_SAMPLES=6;
# stage 5 = session 6, more Magpie data for the 1-layer drafters, calibrated for greedy decoding: PREV=smollm2-v4
#   NEXT=smollm2-v6 SKIP_REGENERATE=1 STEPS=1500 MAX_MINUTES=35 EVAL_SAMPLES=6 CALIB_TEMPERATURE=0):
#   1. Magpie prompts (the target writes user requests itself), answered by the target  -> data/smollm2-magpie/
#   2. the PREV cache copied and extended with all but the last HOLDOUT magpie records (PREV stays intact)
#   3. DSpark and DFlash continue from their PREV drafters (--init-from): identical data, steps, seed
#   4. held-out set = the last HOLDOUT records of both data files: validation (PREV and NEXT drafters) + STS
#   5. τ per benchmark for both drafters
# Resumable: rerun to continue (regeneration and training resume; the cache skips cached ids).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
RUNS=${RUNS:-runs}
PREV=${PREV:-smollm2}
NEXT=${NEXT:-smollm2-v3}
PREV_CACHE=${PREV_CACHE:-$RUNS/cache/$PREV}
NEXT_CACHE=${NEXT_CACHE:-$RUNS/cache/$NEXT}
TAG=${NEXT#smollm2-}
HELDOUT_FILE=$RUNS/heldout-$TAG.jsonl
STEPS=${STEPS:-1900}
MAX_MINUTES=${MAX_MINUTES:-40}
LR=${LR:-5e-4}
HOLDOUT=${HOLDOUT:-32}
NUM_MAGPIE=${NUM_MAGPIE:-700}
THREADS=${THREADS:-2}
GROW=${GROW_TO_LAYERS:+--grow-to-layers $GROW_TO_LAYERS}

if [ "${SKIP_REGENERATE:-0}" != 1 ]; then
  .venv/bin/hf-dspark regenerate --out data/smollm2-magpie --num-template 0 --num-magpie "$NUM_MAGPIE" \
      --max-new-tokens 256 --batch-size 48 --threads "$THREADS" --seed 1
fi
N=$(wc -l < data/smollm2-magpie/train.jsonl)
[ -d "$NEXT_CACHE" ] || cp -r "$PREV_CACHE" "$NEXT_CACHE"
.venv/bin/hf-dspark cache --data data/smollm2-magpie/train.jsonl --out "$NEXT_CACHE" \
    --limit $((N - HOLDOUT)) --max-length 1024 --batch-size 8 --threads "$THREADS" --logsumexp
{ tail -n "$HOLDOUT" data/smollm2/train.jsonl; tail -n "$HOLDOUT" data/smollm2-magpie/train.jsonl; } > "$HELDOUT_FILE"
for head in markov none; do
  .venv/bin/hf-dspark train --cache "$NEXT_CACHE" --out "$RUNS/$NEXT-$head" \
      --init-from "$RUNS/$PREV-$head/drafter" $GROW --num-anchors 32 --batch-size 4 --grad-accum 1 --steps "$STEPS" \
      --lr "$LR" --max-minutes "$MAX_MINUTES" --threads $((THREADS > 1 ? THREADS / 2 : 1)) --save-steps 200 \
      --resume --no-progress &
done
wait
$PY scripts/validate_checkpoints.py --runs "$RUNS/$PREV-markov" "$RUNS/$PREV-none" "$RUNS/$NEXT-markov" "$RUNS/$NEXT-none" \
    --data "$HELDOUT_FILE" --holdout $((2 * HOLDOUT)) --cache "$RUNS/cache/$NEXT-holdout" \
    --train-cache "$NEXT_CACHE" --out "$RUNS/validation-$TAG" --threads "$THREADS"
.venv/bin/hf-dspark calibrate --drafter "$RUNS/$NEXT-markov/drafter" --out "$RUNS/$NEXT-markov/calibrated" \
    --prompts "$HELDOUT_FILE" --num-prompts $((2 * HOLDOUT)) --max-new-tokens 128 --batch-size 8 \
    --temperature "${CALIB_TEMPERATURE:-1}" \
    --threads "$THREADS"
.venv/bin/hf-dspark eval --drafter "$RUNS/$NEXT-markov/calibrated" --baseline-drafter "$RUNS/$NEXT-none/drafter" \
    --out "$RUNS/eval-$NEXT" --benchmarks gsm8k math500 humaneval mbpp mt-bench --temperatures 0 \
    --max-samples "${EVAL_SAMPLES:-8}" --max-new-tokens 128 --batch-size 8 --no-speedup --threads "$THREADS"
