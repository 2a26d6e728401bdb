#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
nvidia-smi --query-gpu=name,uuid --format=csv
mkdir -p $OUT/logs
common="--preset small --no-mtp --steps 30 --no-progress --overwrite --precision fp8"
for epb in nvlink all_to_all; do
for tree in new prev; do
  if [ $tree = prev ]; then d=$PWD/prev; export PTXTRAIN_GIT_SHA=9d4bacf; else d=$PWD; export PTXTRAIN_GIT_SHA=$(cat .sha); fi
  date -u +%T
  (cd $d && PYTHONPATH=$d:/tmp/site timeout 130 torchrun --nproc-per-node 2 -m ptxtrain train $common --ep 2 --ep-backend $epb --out /tmp/ep-$tree-$epb > $OUT/logs/train-ep2-$epb-$tree.log 2>&1; echo "rc=$?")
  grep -E "throughput|train loss|val" $OUT/logs/train-ep2-$epb-$tree.log | tail -3 | sed "s/^/$tree $epb /"
done
done
date -u +%T
