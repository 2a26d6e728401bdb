#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export PTXTRAIN_GIT_SHA=$(cat .sha)
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv,noheader
date -u +%T
mkdir -p $OUT/logs
timeout 130 python3 -m ptxtrain bench linear --json $OUT/linear_1.json 2>&1 | tail -9
date -u +%T
timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider -x tests/jit tests/quant tests/gemm/test_ptx.py tests/gemm/test_grouped.py tests/gemm/test_ref.py tests/gemm/test_heuristics.py tests/nn tests/moe tests/test_backend.py tests/model tests/train tests/optim 2>&1 | tee $OUT/logs/gpu_tests_a.log | tail -4
date -u +%T
timeout 130 python3 -m ptxtrain bench linear --json $OUT/linear_2.json 2>&1 | tail -9
date -u +%T
