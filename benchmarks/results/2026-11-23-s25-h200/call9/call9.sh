#!/usr/bin/env bash
cd "$(dirname "$0")" && . benchmarks/device_env.sh
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/quant tests/nn > $OUT/gpu_tests.log 2>&1
echo "tests rc=$?"; tail -2 $OUT/gpu_tests.log
date -u +%T
for i in 1 2; do for w in 1 0; do
  PTXTRAIN_JIT_PREWARM=$w timeout 200 python3 -m benchmarks.diag_first_step --preset small --batch 8 --seq 1024 --steps 3 \
    --json $OUT/first_step_prewarm${w}_$i.json > /tmp/fs_$w_$i.log 2>&1
  echo "prewarm=$w run $i rc=$?"; grep -A4 "^first step" /tmp/fs_$w_$i.log
done; done
date -u +%T
