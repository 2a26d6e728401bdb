#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export PTXTRAIN_GIT_SHA=$(cat .sha)
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv,noheader
date -u +%T
SH="2112,7168,4096 24576,1536,4096 32768,512,4096 7168,16384,4096 4096,7168,4096 7168,2048,4096"
timeout 200 python3 -m benchmarks.ab_ptx --kind 1d1d --out bf16 --shapes $SH \
  --variants base "sacc:128x128s4c1" "tcs:128x128s4c1:#PTXTRAIN_GEMM_1D1D_TC=1" "tcs5:128x128s5c1:#PTXTRAIN_GEMM_1D1D_TC=1" base2 --json $OUT/ab_wgrad_tcs_bf16.json 2>&1 | tail -8
date -u +%T
timeout 60 python3 prep.py $OUT/prep.json 2>&1 | tail -7
date -u +%T
