#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export PTXTRAIN_GIT_SHA=$(cat .sha)
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv,noheader
date -u +%T
mkdir -p $OUT/logs
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gemm/test_ptx.py tests/nn tests/test_backend.py 2>&1 | tee $OUT/logs/gpu_tests.log | tail -4
date -u +%T
timeout 120 python3 -m benchmarks.diag_linear_host --shapes 4096,2112,7168 --reps 50 --json $OUT/diag_linear_host.json > $OUT/diag_linear_host.txt 2>&1
grep -E "Linear|_split_counters|ptx:_launch" $OUT/diag_linear_host.txt | head -8
date -u +%T
timeout 150 python3 -m ptxtrain bench linear --json $OUT/linear.json 2>&1 | tail -9
date -u +%T
