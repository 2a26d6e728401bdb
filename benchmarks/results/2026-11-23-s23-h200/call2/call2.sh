#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export PTXTRAIN_GIT_SHA=$(cat .sha)
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv,noheader
date -u +%T
timeout 300 python3 -m benchmarks.ab_ptx --kind 1d1d --out bf16 --shapes 2112,7168,4096 24576,1536,4096 32768,512,4096 7168,16384,4096 4096,7168,4096 7168,2048,4096 \
  --variants base "nofmul:#PTXTRAIN_GEMM_DIAG_1D1D=1" "uniaddr:#PTXTRAIN_GEMM_DIAG_1D1D=2" "lds128:#PTXTRAIN_GEMM_DIAG_1D1D=4" "both:#PTXTRAIN_GEMM_DIAG_1D1D=3" "kk2:#PTXTRAIN_GEMM_DIAG_KK=2" base2 \
  --json $OUT/ab_wgrad_diag.json 2>&1 | tail -12
date -u +%T
