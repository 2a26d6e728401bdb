#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
nvidia-smi --query-gpu=name,uuid --format=csv
mkdir -p $OUT/logs
date -u +%T
export PTXTRAIN_GIT_SHA=$(cat .sha)
PYTHONPATH=$PWD:/tmp/site timeout 240 python3 -m pytest -q -p no:cacheprovider tests/moe/test_layout.py tests/moe/test_dispatch.py 2>&1 | tee $OUT/logs/gpu_moe.log | tail -3
date -u +%T
PYTHONPATH=$PWD:/tmp/site timeout 300 python3 -m pytest -q -m multigpu -p no:cacheprovider tests/moe 2>&1 | tee $OUT/logs/multigpu_moe.log | tail -3
date -u +%T
for i in 1 2; do
  for tree in prev new; do
    if [ $tree = prev ]; then d=$PWD/prev; export PTXTRAIN_GIT_SHA=9d4bacf; else d=$PWD; export PTXTRAIN_GIT_SHA=$(cat .sha); fi
    (cd $d && PYTHONPATH=$d:/tmp/site timeout 120 torchrun --nproc-per-node 2 -m benchmarks.diag_dispatch_host --calls 200 --json $OUT/host-$tree-$i.json 2>&1 | grep -v "^W1" | sed "s/^/$tree$i /" | tail -4)
  done
done
date -u +%T
for i in 1 2 3; do
  for tree in prev new; do
    if [ $tree = prev ]; then d=$PWD/prev; export PTXTRAIN_GIT_SHA=9d4bacf; else d=$PWD; export PTXTRAIN_GIT_SHA=$(cat .sha); fi
    (cd $d && PYTHONPATH=$d:/tmp/site timeout 120 torchrun --nproc-per-node 2 -m ptxtrain bench dispatch --repeats 60 --json $OUT/dispatch-ep2-$tree-$i.json 2>&1 | grep -E "^ +(all_to_all|nvlink) +dispatch " | sed "s/^/$tree$i /")
  done
done
date -u +%T
