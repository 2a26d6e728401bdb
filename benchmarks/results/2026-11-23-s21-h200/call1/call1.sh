#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export PTXTRAIN_GIT_SHA=$(cat .sha)
nvidia-smi --query-gpu=name,uuid,clocks.sm --format=csv,noheader
date -u +%T
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/nn/test_fp8_linear.py 2>&1 | tail -5
date -u +%T
for f in 0 1 0 1; do
  PTXTRAIN_WGRAD_FIRST=$f timeout 150 python3 -m ptxtrain bench linear --json $OUT/linear_first${f}_$RANDOM.json 2>&1 | tail -12
  date -u +%T
done
PTXTRAIN_WGRAD_FIRST=0 timeout 100 python3 -m benchmarks.profile_linear --timeline --iters 3 --json $OUT/profile_linear_tl.json 2>&1 | grep -E "timeline|^---"
