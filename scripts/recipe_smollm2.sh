#!/usr/bin/env bash
# The recipe behind the shipped SmolLM2-135M-Instruct drafter, end to end and resumable (rerun to continue).
#   1. the target answers synthesised prompts            (hf-dspark regenerate -> data/smollm2/train.jsonl)
#   2. target cache of all but the last HOLDOUT records  (those stay unseen for STS calibration)
#   3. DSpark and DFlash drafters: identical data, steps, backbone and seed
#   4. STS calibration of the DSpark drafter on the held-out records
# Sizes are set for a 2-core CPU session; raise STEPS / data on bigger machines.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
STEPS=${STEPS:-2400}
MAX_MINUTES=${MAX_MINUTES:-75}
DRAFT_VOCAB=${DRAFT_VOCAB:-8192}
LR=${LR:-1e-3}
HOLDOUT=${HOLDOUT:-32}
ANCHORS=${ANCHORS:-32}
THREADS=${THREADS:-2}
RUNS=${RUNS:-runs}

if [ "${SKIP_REGENERATE:-0}" != 1 ]; then
  .venv/bin/hf-dspark regenerate --out data/smollm2 --num-magpie 0
fi
N=$(wc -l < data/smollm2/train.jsonl)
.venv/bin/hf-dspark cache --data data/smollm2/train.jsonl --out "$RUNS/cache/smollm2" \
    --limit $((N - HOLDOUT)) --max-length 1024 --batch-size 8 --threads "$THREADS" --logsumexp
# the two drafters train side by side, one thread each (identical data, steps, backbone, seed)
for head in markov none; do
  .venv/bin/hf-dspark train --cache "$RUNS/cache/smollm2" --out "$RUNS/smollm2-$head" --head "$head" \
      --num-layers 1 --block-size 7 --num-anchors "$ANCHORS" --batch-size 4 --grad-accum 1 --steps "$STEPS" \
      --lr "$LR" --draft-vocab-size "$DRAFT_VOCAB" --max-minutes "$MAX_MINUTES" --threads $((THREADS > 1 ? THREADS / 2 : 1)) \
      --save-steps 200 --resume --no-progress &
done
wait
.venv/bin/hf-dspark calibrate --drafter "$RUNS/smollm2-markov/drafter" --out "$RUNS/smollm2-markov/calibrated" \
    --prompts data/smollm2/train.jsonl --num-prompts "$HOLDOUT" --max-new-tokens 128 --batch-size 8 \
    --threads "$THREADS"
# 5. evaluation: tau per benchmark for both drafters (batched; wall-clock speed is hf-dspark bench, batch 1)
.venv/bin/hf-dspark eval --drafter "$RUNS/smollm2-markov/calibrated" --baseline-drafter "$RUNS/smollm2-none/drafter" \
    --out "$RUNS/eval-smollm2" --benchmarks gsm8k math500 humaneval mbpp mt-bench --temperatures 0 1 \
    --max-samples "${EVAL_SAMPLES:-16}" --max-new-tokens 128 --batch-size 8 --no-speedup --threads "$THREADS"
