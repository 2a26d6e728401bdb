#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export PTXTRAIN_GIT_SHA=$(cat .sha)
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv,noheader
date -u +%T
timeout 200 python3 -m benchmarks.bench_grouped --configs 8x512 --json $OUT/grouped_lookup.json \
  --ab "#PTXTRAIN_GEMM_GROUP_PRODUCER_WARP=0" "#PTXTRAIN_GEMM_GROUP_AHEAD=0" "#PTXTRAIN_GEMM_GROUP_PRODUCER_WARP=0:#PTXTRAIN_GEMM_GROUP_AHEAD=0" "#PTXTRAIN_GEMM_GROUP_AHEAD=1" 2>&1 | grep -E "over|^\(4096, (4096|7168), " | grep -v -E "triton|masked|cublas"
date -u +%T
