#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export PTXTRAIN_GIT_SHA=$(cat .sha)
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv,noheader
date -u +%T
SH="2112,7168,4096 24576,1536,4096 32768,512,4096 7168,16384,4096 4096,7168,4096 7168,2048,4096"
timeout 200 python3 -m benchmarks.ab_ptx --kind 1d1d --out bf16 --shapes $SH \
  --variants base "bf16pair:#PTXTRAIN_GEMM_DIAG_1D1D=8" "bf16pair_nofmul:#PTXTRAIN_GEMM_DIAG_1D1D=9" "both:#PTXTRAIN_GEMM_DIAG_1D1D=3" base2 \
  --json $OUT/ab_wgrad_diag_bf16pair.json 2>&1 | tail -8
date -u +%T
