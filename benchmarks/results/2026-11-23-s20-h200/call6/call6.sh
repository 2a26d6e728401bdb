#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
nvidia-smi --query-gpu=name,uuid --format=csv
run() {  # tree tag args...
  tree=$1; tag=$2; shift 2
  if [ $tree = prev ]; then d=$PWD/prev; export PTXTRAIN_GIT_SHA=9d4bacf; else d=$PWD; export PTXTRAIN_GIT_SHA=$(cat .sha); fi
  (cd $d && PYTHONPATH=$d:/tmp/site timeout 150 torchrun --nproc-per-node 1 "$@" 2>&1 | grep -E "ms / step|error|launches|Error" | sed "s/^/$tree $tag /")
}
date -u +%T
run new warm -m benchmarks.diag_ep_step --steps 5 --warmup 3
run prev warm -m benchmarks.diag_ep_step --steps 5 --warmup 3
date -u +%T
i=0
for tree in new prev prev new; do
  i=$((i+1)); run $tree s$i -m benchmarks.diag_ep_step --steps 40 --warmup 10 --json $OUT/ep-step-$tree-$i.json
done
date -u +%T
i=0
for tree in new prev prev new; do
  i=$((i+1)); run $tree h$i -m benchmarks.diag_dispatch_host --calls 200 --json $OUT/host-ep1-$tree-$i.json
done
date -u +%T
