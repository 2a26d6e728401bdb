#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export PTXTRAIN_GIT_SHA=$(cat .sha)
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv,noheader
date -u +%T
timeout 150 python3 -m pytest -q -m gpu tests/gemm/test_ptx.py -k "m_grouped" 2>&1 | tail -3 | tee $OUT/gpu_tests_m_grouped.log
date -u +%T
timeout 360 python3 -m pytest -q -m gpu tests/gemm/test_triton.py tests/gemm/test_gluon.py tests/gemm/test_cublas.py 2>&1 | tail -4 | tee $OUT/gpu_tests_triton_gluon_cublas.log
date -u +%T
timeout 60 python3 -m benchmarks.bench_grouped --configs 8x512 --json $OUT/bench_grouped_final.json 2>&1 | grep -E "over_dense_ptx"
date -u +%T
