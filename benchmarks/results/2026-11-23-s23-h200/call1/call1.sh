#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export PTXTRAIN_GIT_SHA=$(cat .sha)
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv,noheader
date -u +%T
# Fp8Linear's wgrad (1D1D, bf16 D, K = 4096 tokens; m = N, n = K of the Linear): ring depth
timeout 200 python3 -m benchmarks.ab_ptx --kind 1d1d --out bf16 --shapes 2112,7168,4096 24576,1536,4096 32768,512,4096 7168,16384,4096 4096,7168,4096 7168,2048,4096 \
  --variants base s5 s6e1 base2 s5b:s5 --json $OUT/ab_wgrad_bf16_stages.json 2>&1 | tail -12
date -u +%T
# the K = 512 fprop of the 32768 x 512 layer
timeout 150 python3 -m benchmarks.ab_ptx --shapes 4096,32768,512 4096,24576,1536 \
  --variants base s6e1 "m256c2:256x128s4c2e1" "m256c1:256x128s4c1e1" "s4:128x128s4c1d" base2 \
  --json $OUT/ab_fprop_k512.json 2>&1 | tail -6
date -u +%T
timeout 150 python3 -m ptxtrain bench linear --json $OUT/linear_base.json 2>&1 | tail -12
date -u +%T
