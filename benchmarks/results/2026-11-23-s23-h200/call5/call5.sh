#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export PTXTRAIN_GIT_SHA=$(cat .sha)
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv,noheader
date -u +%T
SH="2112,7168,4096 24576,1536,4096 32768,512,4096 7168,16384,4096 4096,7168,4096 7168,2048,4096"
timeout 200 python3 -m benchmarks.ab_ptx --kind 1d1d --out bf16 --shapes $SH \
  --variants base "tc:#PTXTRAIN_GEMM_1D1D_TC=1" base2 "tc2:#PTXTRAIN_GEMM_1D1D_TC=1" --json $OUT/ab_wgrad_tc_bf16.json 2>&1 | tail -8
date -u +%T
timeout 150 python3 -m benchmarks.ab_ptx --kind 1d1d --out fp32 --shapes 7168,2112,4096 1536,24576,4096 512,32768,4096 16384,7168,4096 7168,4096,4096 2048,7168,4096 \
  --variants base "tc:#PTXTRAIN_GEMM_1D1D_TC=1" --json $OUT/ab_wgrad_tc_fp32.json 2>&1 | tail -8
date -u +%T
PTXTRAIN_GEMM_1D1D_TC=1 timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gemm/test_ptx.py -k "1d1d" -x 2>&1 | tail -6
date -u +%T
