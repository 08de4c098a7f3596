#!/usr/bin/env bash
# Issue #19: a drafter that generalises to text it never saw. Continues the shipped drafter on diverse on-policy
# answers plus off-policy human text, with a draft vocabulary chosen on all of it, and scores it on the fixed
# held-out set (data/heldout). Resumable end to end: every stage skips what is done, training resumes (--resume);
# rerun it to continue (a grown regeneration file extends the on-policy cache).
#   1. held-out answers of the target (greedy, 128 tokens) -> held-out validation cache
#   2. off-policy: human-written text (data/smollm2-human, committed) -> prefill-only target cache
#   3. on-policy: the target's answers to real-source prompts (data/smollm2-diverse) + the Magpie answers the shipped
#      drafter never trained on (the last MAGPIE of data/smollm2-magpie) -> target cache
#   4. the shipped drafter moved onto a draft vocabulary chosen on every training source (revocab_drafter.py)
#   5. the caches mixed (symlinks, no copy) and training continued from 4 (one thread, nice, resumable)
#   6. held-out curve (every checkpoint), held-out τ by generation (T=0, full block), benchmark τ
# Calibration (both modes) and shipping are separate steps, only for a drafter that beats the shipped one.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RUNS=${RUNS:-runs}
NAME=${NAME:-smollm2-diverse}
THREADS=${THREADS:-1}
STEPS=${STEPS:-1500}
LR=${LR:-5e-4}
ANCHORS=${ANCHORS:-32}
DRAFT_VOCAB=${DRAFT_VOCAB:-8192}
MAGPIE=${MAGPIE:-300}
INIT=${INIT:-hf_dspark/checkpoints/smollm2-135m-instruct-dspark}
GROW_TO_LAYERS=${GROW_TO_LAYERS:-}
MAX_MINUTES=${MAX_MINUTES:-600}
DIVERSE=${DIVERSE:-data/smollm2-diverse/train.jsonl}
NICE="nice -n 19"
mkdir -p "$RUNS/data" "$RUNS/cache"
cache() {  # cache <jsonl> <dir> [extra args]: resumable target cache with the log-normaliser side-car
  local data=$1 out=$2; shift 2
  $NICE .venv/bin/hf-dspark cache --data "$data" --out "$out" --max-length 1024 --batch-size 8 \
      --threads "$THREADS" --logsumexp "$@"
}

# 1. held-out validation cache (the answers are the same for every drafter at T = 0)
if [ ! -f "$RUNS/cache/smollm2-heldout/manifest.json" ]; then
  $NICE $PY scripts/eval_heldout.py --drafters "$INIT" --names init --out "$RUNS/$NAME-heldout-init" --save-answers \
      --threads "$THREADS"
  cat "$RUNS/$NAME-heldout-init"/answers-{chat,code}.jsonl > "$RUNS/data/heldout-answers.jsonl"
  cache "$RUNS/data/heldout-answers.jsonl" "$RUNS/cache/smollm2-heldout" --min-loss-tokens 1
fi

# 2. off-policy human text (prefill only)
[ -f "$RUNS/data/human.jsonl" ] || zcat data/smollm2-human/train.jsonl.gz > "$RUNS/data/human.jsonl"
cache "$RUNS/data/human.jsonl" "$RUNS/cache/smollm2-human"

# 3. on-policy answers: the regenerated real-source prompts + unseen Magpie chat answers, interleaved
$PY - "$DIVERSE" data/smollm2-magpie/train.jsonl "$MAGPIE" "$RUNS/data/onpolicy.jsonl" <<'EOF'
import json, sys
diverse = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
magpie = [json.loads(l) for l in open(sys.argv[2]) if l.strip()][-int(sys.argv[3]):]
mixed = [r for pair in zip(diverse, magpie) for r in pair] + diverse[len(magpie):] + magpie[len(diverse):]
with open(sys.argv[4], "w") as f:
    f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in mixed)
EOF
cache "$RUNS/data/onpolicy.jsonl" "$RUNS/cache/smollm2-onpolicy" --shard-size-mb 256

# 4. the initial drafter on a broader draft vocabulary (chosen on training sources only, never the held-out set)
if [ ! -f "$RUNS/$NAME-init/config.json" ]; then
  $PY scripts/revocab_drafter.py --drafter "$INIT" --size "$DRAFT_VOCAB" --out "$RUNS/$NAME-init" \
      --data data/smollm2/train.jsonl data/smollm2-magpie/train.jsonl "$DIVERSE" data/smollm2-human/train.jsonl.gz \
      --report-on "$RUNS/cache/smollm2-heldout"
fi

# 5. mix and train (the mix is rebuilt from whatever the caches hold now; the run resumes)
$PY scripts/mix_target_caches.py --caches "$RUNS/cache/smollm2-onpolicy" "$RUNS/cache/smollm2-human" \
    --out "$RUNS/cache/$NAME-mix"
mkdir -p "$RUNS/$NAME"
echo "$RUNS/cache/$NAME-mix" > "$RUNS/$NAME/cache_path"
$NICE .venv/bin/hf-dspark train --cache "$RUNS/cache/$NAME-mix" --out "$RUNS/$NAME" --init-from "$RUNS/$NAME-init" \
    ${GROW_TO_LAYERS:+--grow-to-layers "$GROW_TO_LAYERS"} --steps "$STEPS" --lr "$LR" --batch-size 4 \
    --grad-accum 1 --num-anchors "$ANCHORS" --save-steps 100 --save-total-limit 0 --max-minutes "$MAX_MINUTES" \
    --threads "$THREADS" --resume --no-progress
[ -f "$RUNS/$NAME/drafter/config.json" ] || { echo "training stopped early; rerun to resume"; exit 0; }

# 6. evaluation: held-out curve, held-out τ by generation, benchmark τ (T = 0, full block)
$NICE $PY scripts/validate_heldout.py --runs "$RUNS/$NAME" --drafters "$INIT" --cache "$RUNS/cache/smollm2-heldout" \
    --out "$RUNS/$NAME-curve.json" --threads "$THREADS"
$NICE $PY scripts/eval_heldout.py --drafters "$INIT" "$RUNS/$NAME/drafter" --names shipped "$NAME" \
    --out "$RUNS/$NAME-heldout" --threads "$THREADS"
$NICE .venv/bin/hf-dspark eval --drafter "$RUNS/$NAME/drafter" --baseline-drafter "$INIT" --names "$NAME" shipped \
    --out "$RUNS/$NAME-benchmarks" --benchmarks gsm8k math500 humaneval mbpp mt-bench --temperatures 0 \
    --max-samples "${EVAL_SAMPLES:-6}" --max-new-tokens 128 --batch-size 8 --no-speedup --no-plots --threads "$THREADS"
