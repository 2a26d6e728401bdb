#!/usr/bin/env bash
cd "$(dirname "$0")" && . benchmarks/device_env.sh
for i in 1 2; do
  for r in deepseek deepseek_pow2; do
    timeout 120 python3 -m ptxtrain train --preset small --precision fp8 --fp8-recipe $r --steps 50 --batch-size 8 --seq-len 1024 --eval-every 0 --sample-tokens 0 --ckpt-every 0 --out /tmp/r-$r-$i --no-progress > $OUT/train_small_${r}_$i.txt 2>&1
    echo "$r $i: $(grep -E 'throughput' $OUT/train_small_${r}_$i.txt)"
    cp /tmp/r-$r-$i/summary.json $OUT/summary_${r}_$i.json 2>/dev/null
  done
done
date -u +%T
