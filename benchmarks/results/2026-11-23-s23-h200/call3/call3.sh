#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export PTXTRAIN_GIT_SHA=$(cat .sha)
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv,noheader
date -u +%T
timeout 300 python3 -m benchmarks.ab_ptx --kind 1d1d --out bf16 --shapes 2112,7168,4096 24576,1536,4096 32768,512,4096 7168,16384,4096 4096,7168,4096 7168,2048,4096 \
  --variants base "m256:256x128s4c1e1" "m256c2:256x128s4c2e1" "m256s3e2:256x128s3c1e2" base2 \
  --json $OUT/ab_wgrad_m256.json 2>&1 | tail -12
date -u +%T
