#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export PTXTRAIN_GIT_SHA=$(cat .sha)
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv,noheader
date -u +%T
for i in 1 2 3; do
  timeout 150 python3 -m ptxtrain bench linear --json $OUT/linear_$i.json 2>&1 | tail -3
  date -u +%T
done
timeout 100 python3 -m ptxtrain bench quant --json $OUT/quant.json 2>&1 | tail -30
date -u +%T
