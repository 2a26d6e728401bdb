#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONUNBUFFERED=1
NEW=$PWD OLD=$PWD/old
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv,noheader
date -u +%T
mkdir -p $OUT/logs
(cd $NEW && PYTHONPATH=$NEW:/tmp/site PTXTRAIN_GIT_SHA=$(cat $NEW/.sha) timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/quant 2>&1 | tee $OUT/logs/gpu_tests_quant.log | tail -3)
date -u +%T
for t in new old; do
  D=$NEW; [ $t = old ] && D=$OLD
  (cd $D && PYTHONPATH=$D:/tmp/site PTXTRAIN_GIT_SHA=$(cat $D/.sha) timeout 100 python3 -m benchmarks.sweep_quant --cuda --sf-layout mn_major --variants pair_occ4,t512_pair,lean_pair --shapes 4096x7168,4096x2112,4096x2048,4096x16384,4096x32768 --json $OUT/sweep_quant_$t.json 2>&1 | grep -E "both|per_token " | grep -E "pair_occ4|t512_pair" | head -12)
  date -u +%T
done
for i in 1 2; do
  for t in old new; do
    D=$NEW; [ $t = old ] && D=$OLD
    (cd $D && PYTHONPATH=$D:/tmp/site PTXTRAIN_GIT_SHA=$(cat $D/.sha) timeout 100 python3 -m ptxtrain bench linear --json $OUT/linear_${t}_$i.json 2>&1 | grep -E "geomean")
    date -u +%T
  done
done
