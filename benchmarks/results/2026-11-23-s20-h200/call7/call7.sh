#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
export PTXTRAIN_GIT_SHA=$(cat .sha)
PYTHONPATH=$PWD:/tmp/site timeout 200 torchrun --nproc-per-node 1 -m benchmarks.diag_ep_step --steps 10 --warmup 5 --backends all_to_all --profile --json $OUT/ep-step-profile.json 2>&1 | grep -v "^W1"
PYTHONPATH=$PWD:/tmp/site timeout 200 python3 -m ptxtrain train --preset small --no-mtp --steps 30 --no-progress --overwrite --precision fp8 --out /tmp/one 2>&1 | grep -E "throughput|model:"
