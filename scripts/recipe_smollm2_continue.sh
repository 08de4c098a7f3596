#!/usr/bin/env bash
# Stage 2 of the SmolLM2 recipe (session 3): more varied data, then both drafters continue side by side.
#   1. Magpie prompts (the target writes user requests itself), answered by the target  -> data/smollm2-magpie/
#   2. the stage-1 cache extended with all but the last HOLDOUT magpie records (a copy, stage 1 stays intact)
#   3. DSpark and DFlash continue from their stage-1 drafters (--init-from): identical data, steps, seed
#   4. held-out set = the last HOLDOUT records of both data files (runs/heldout-v3.jsonl): validation + STS
# Resumable: rerun to continue (regeneration and training resume; the cache skips cached ids).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
RUNS=${RUNS:-runs}
STEPS=${STEPS:-1900}
MAX_MINUTES=${MAX_MINUTES:-40}
LR=${LR:-5e-4}
HOLDOUT=${HOLDOUT:-32}
NUM_MAGPIE=${NUM_MAGPIE:-700}
THREADS=${THREADS:-2}

if [ "${SKIP_REGENERATE:-0}" != 1 ]; then
  $PY scripts/regenerate_smollm2.py --out data/smollm2-magpie --num-template 0 --num-magpie "$NUM_MAGPIE" \
      --max-new-tokens 256 --batch-size 24 --threads "$THREADS" --seed 1
fi
N=$(wc -l < data/smollm2-magpie/train.jsonl)
[ -d "$RUNS/cache/smollm2-v3" ] || cp -r "$RUNS/cache/smollm2" "$RUNS/cache/smollm2-v3"
$PY scripts/build_target_cache.py --data data/smollm2-magpie/train.jsonl --out "$RUNS/cache/smollm2-v3" \
    --limit $((N - HOLDOUT)) --max-length 1024 --batch-size 8 --threads "$THREADS" --logsumexp
{ tail -n "$HOLDOUT" data/smollm2/train.jsonl; tail -n "$HOLDOUT" data/smollm2-magpie/train.jsonl; } > "$RUNS/heldout-v3.jsonl"
for head in markov none; do
  $PY scripts/train_drafter.py --cache "$RUNS/cache/smollm2-v3" --out "$RUNS/smollm2-v3-$head" \
      --init-from "$RUNS/smollm2-$head/drafter" --num-anchors 32 --batch-size 4 --grad-accum 1 --steps "$STEPS" \
      --lr "$LR" --max-minutes "$MAX_MINUTES" --threads $((THREADS > 1 ? THREADS / 2 : 1)) --save-steps 200 \
      --resume --no-progress &
done
wait
$PY scripts/validate_checkpoints.py --runs "$RUNS/smollm2-v3-markov" "$RUNS/smollm2-v3-none" \
    --data "$RUNS/heldout-v3.jsonl" --holdout $((2 * HOLDOUT)) --cache "$RUNS/cache/smollm2-v3-holdout" \
    --train-cache "$RUNS/cache/smollm2-v3" --out "$RUNS/validation-v3" --threads "$THREADS"
$PY scripts/calibrate_drafter.py --drafter "$RUNS/smollm2-v3-markov/drafter" --out "$RUNS/smollm2-v3-markov/calibrated" \
    --prompts "$RUNS/heldout-v3.jsonl" --num-prompts $((2 * HOLDOUT)) --max-new-tokens 128 --batch-size 8 \
    --threads "$THREADS"
$PY scripts/eval_drafter.py --drafter "$RUNS/smollm2-v3-markov/calibrated" --baseline-drafter "$RUNS/smollm2-v3-none/drafter" \
    --out "$RUNS/eval-smollm2-v3" --benchmarks gsm8k math500 humaneval mbpp mt-bench --temperatures 0 \
    --max-samples "${EVAL_SAMPLES:-8}" --max-new-tokens 128 --batch-size 8 --no-speedup --threads "$THREADS"
