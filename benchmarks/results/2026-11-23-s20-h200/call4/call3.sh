#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
nvidia-smi --query-gpu=name,uuid --format=csv
for i in 1 2 3; do
for tree in new prev; do
  if [ $tree = prev ]; then d=$PWD/prev; export PTXTRAIN_GIT_SHA=9d4bacf; else d=$PWD; export PTXTRAIN_GIT_SHA=$(cat .sha); fi
  (cd $d && PYTHONPATH=$d:/tmp/site timeout 120 torchrun --nproc-per-node 2 -m benchmarks.diag_dispatch_host --calls 200 --json $OUT/host-$tree-$i.json 2>&1 | grep "launches" | sed "s/^/$tree$i /")
done
done
