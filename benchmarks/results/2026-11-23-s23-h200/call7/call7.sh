#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export PTXTRAIN_GIT_SHA=$(cat .sha)
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv,noheader
date -u +%T
timeout 200 python3 -m benchmarks.diag_linear_host --shapes 4096,2112,7168 2048,768,768 --reps 50 --json $OUT/diag_linear_host.json > $OUT/diag_linear_host.txt 2>&1
grep -E "Linear|backward|forward|_gemm|cast|_launch|_plan|BoundLaunch|tma_2d|_run|_quant" $OUT/diag_linear_host.txt | head -80
date -u +%T
