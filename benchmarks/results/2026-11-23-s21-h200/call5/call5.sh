#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export PTXTRAIN_GIT_SHA=$(cat .sha)
nvidia-smi --query-gpu=name,uuid --format=csv,noheader
date -u +%T
timeout 540 python3 -m pytest -q -m gpu -p no:cacheprovider tests/jit tests/quant tests/gemm/test_ptx.py tests/gemm/test_grouped.py tests/gemm/test_ref.py tests/gemm/test_heuristics.py tests/nn tests/moe tests/test_backend.py 2>&1 > $OUT/gpu_tests_a.log; tail -8 $OUT/gpu_tests_a.log
date -u +%T
