#!/usr/bin/env bash
cd "$(dirname "$0")" && . benchmarks/device_env.sh
for i in 1 2 3; do
  for r in deepseek_pow2 deepseek; do
    timeout 100 python3 -m ptxtrain train --preset small --precision fp8 --fp8-recipe $r --steps 8 --batch-size 8 --seq-len 1024 --eval-every 0 --sample-tokens 0 --ckpt-every 0 --out /tmp/q-$r-$i --no-progress > /dev/null 2>&1
    cp /tmp/q-$r-$i/summary.json $OUT/summary_${r}_$i.json
    python3 -c "import json; d=json.load(open('$OUT/summary_${r}_$i.json')); print('$r $i', [round(v, 6) for v in d['losses']])"
  done
done
date -u +%T
