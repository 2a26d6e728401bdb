#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export PTXTRAIN_GIT_SHA=$(cat .sha)
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv,noheader
date -u +%T
for i in 1 2; do
  for r in deepseek_pow2 deepseek; do
    timeout 130 python3 -m ptxtrain bench linear --recipe $r --json $OUT/linear_${r}_$i.json 2>&1 | grep -E "^ +4096|geomean"
    date -u +%T
  done
done
timeout 120 python3 -m benchmarks.profile_linear --timeline --iters 3 --recipe deepseek_pow2 --json $OUT/profile_linear_tl_pow2.json > $OUT/profile_pow2.txt 2>&1; tail -3 $OUT/profile_pow2.txt
date -u +%T
timeout 150 python3 -m benchmarks.sweep_quant --cuda --pow2 --sf-layout mn_major --variants pair_occ4,lean_pair,t512_pair --shapes 4096x7168,4096x32768,4096x24576,4096x2112 --json $OUT/sweep_quant_pow2.json 2>&1 | tail -12
date -u +%T
