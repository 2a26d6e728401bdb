#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export PTXTRAIN_GIT_SHA=$(cat .sha)
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv,noheader
date -u +%T
timeout 60 python3 -m benchmarks.bench_grouped --configs 8x512 --same-expert --json $OUT/bench_grouped_quick.json 2>&1 | grep -E "over_dense_ptx|Error|error" | head
date -u +%T
timeout 240 python3 -m pytest -q -m gpu -x tests/gemm/test_ptx.py -k "grouped or masked or split" 2>&1 | tail -4 | tee $OUT/gpu_tests_ptx_grouped.log
date -u +%T
timeout 150 python3 -m pytest -q -m gpu -x tests/gemm/test_grouped.py tests/nn/test_fp8_grouped.py tests/moe/test_experts.py tests/moe/test_layer.py tests/moe/test_layer_fused.py 2>&1 | tail -4 | tee $OUT/gpu_tests_moe.log
date -u +%T
for i in 1 2; do
timeout 100 python3 -m benchmarks.bench_grouped --same-expert --json $OUT/bench_grouped_$i.json 2>&1 | grep -E "over_dense_ptx"
date -u +%T
done
