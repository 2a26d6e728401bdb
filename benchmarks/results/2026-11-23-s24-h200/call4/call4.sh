#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export PTXTRAIN_GIT_SHA=$(cat .sha)
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv,noheader
date -u +%T
mkdir -p $OUT/logs
for i in 1 2; do
  for r in deepseek deepseek_pow2; do
    timeout 100 python3 -m ptxtrain bench linear --recipe $r --json $OUT/linear_${r}_$i.json 2>&1 | grep -E "^ +4096|geomean"
    date -u +%T
  done
done
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider tests/nn tests/moe tests/gemm/test_ptx.py tests/gemm/test_grouped.py tests/test_backend.py 2>&1 | tee $OUT/logs/gpu_tests.log | tail -3
date -u +%T
