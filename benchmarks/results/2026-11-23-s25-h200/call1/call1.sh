#!/usr/bin/env bash
cd "$(dirname "$0")" && . benchmarks/device_env.sh
# 1. determinism hunt: strict warnings, no-sync repeats, in-process training repeats
timeout 300 python3 -m benchmarks.diag_determinism --strict --async-repeats 30 --train-runs 3 --train-steps 10 \
  --repeats 3 --quant-repeats 3 --json $OUT/determinism.json > $OUT/logs/determinism.log 2>&1
echo "determinism rc=$?"; grep -v "^ *$" $OUT/logs/determinism.log | grep -i -E "warn|async|train x|losses|differ|quant:" | sort | uniq -c | sort -rn | head -40
date -u +%T
# 2. grouped GEMMs against dense at issue 5's settings, current tree
timeout 150 python3 -m benchmarks.bench_grouped --json $OUT/grouped.json > $OUT/logs/grouped.log 2>&1
echo "grouped rc=$?"; grep -E "over|TFLOPS" $OUT/logs/grouped.log | tail -30
date -u +%T
# 3. GPU tests: grouped GEMMs and MoE (one GPU)
timeout 200 python3 -m pytest -q -m gpu tests/gemm/test_grouped.py tests/moe -x -p no:cacheprovider > $OUT/logs/gpu_tests.log 2>&1
echo "tests rc=$?"; tail -3 $OUT/logs/gpu_tests.log
date -u +%T
