#!/usr/bin/env bash
cd "$(dirname "$0")" && . benchmarks/device_env.sh
for d in "" --deterministic "" --deterministic; do
  n=$((n+1))
  timeout 150 python3 -m benchmarks.profile_step --preset small --batch 8 --seq 1024 --warmup 3 --steps 10 \
    --cases fp8: --rows 40 $d --json $OUT/step_${n}${d}.json > $OUT/step_${n}${d}.log 2>&1
  echo "run $n $d rc=$?"; grep "ms/step" $OUT/step_${n}${d}.log
done
date -u +%T
