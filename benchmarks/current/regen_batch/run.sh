set -x
cd /work/main
for arm in "generate 16" "generate 48" "engine 16" "engine 48"; do
  set -- $arm
  out=runs/regen-bench/$1-$2; rm -rf $out
  /usr/bin/time -f "$1 $2 wall %e s" .venv/bin/hf-dspark regenerate --out $out --prompts runs/regen-bench/prompts.jsonl --num-template 0 --num-magpie 0 --backend $1 --engine-policy scheduled --batch-size $2 --threads 1 --seed 7 2>&1 | tr '\r' '\n' | grep -E "tok_s|wall" | tail -2
done
