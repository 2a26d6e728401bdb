#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export PTXTRAIN_GIT_SHA=$(cat .sha)
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv,noheader
date -u +%T
timeout 200 python3 -m benchmarks.bench_grouped --configs 8x512 --same-expert --json $OUT/grouped_pf.json \
  --ab "#PTXTRAIN_GEMM_L2_PREFETCH=0" "#PTXTRAIN_GEMM_L2_PREFETCH=2" "#PTXTRAIN_GEMM_L2_PREFETCH=4" \
       "#PTXTRAIN_GEMM_L2_PREFETCH=8" "#PTXTRAIN_GEMM_L2_PREFETCH=4:#PTXTRAIN_GEMM_L2_PREFETCH_A=1" \
       "#PTXTRAIN_GEMM_L2_PREFETCH=12" 2>&1 | grep -v "^ *$" | head -60
date -u +%T
timeout 200 python3 -m benchmarks.ab_ptx --shapes 4096,2112,7168 4096,24576,1536 4096,32768,512 4096,7168,16384 4096,4096,7168 4096,7168,2048 \
  --variants base "pf4:#PTXTRAIN_GEMM_L2_PREFETCH=4" "pf4a:#PTXTRAIN_GEMM_L2_PREFETCH=4:#PTXTRAIN_GEMM_L2_PREFETCH_A=1" "pf8:#PTXTRAIN_GEMM_L2_PREFETCH=8" base2 \
  --json $OUT/ab_dense_pf.json 2>&1 | tail -40
date -u +%T
timeout 150 python3 -m benchmarks.ab_ptx --kind 1d1d --shapes 7168,2112,4096 1536,24576,4096 16384,7168,4096 7168,4096,4096 \
  --variants base "pf4:#PTXTRAIN_GEMM_L2_PREFETCH=4" "pf4a:#PTXTRAIN_GEMM_L2_PREFETCH=4:#PTXTRAIN_GEMM_L2_PREFETCH_A=1" base2 \
  --json $OUT/ab_1d1d_pf.json 2>&1 | tail -30
date -u +%T
