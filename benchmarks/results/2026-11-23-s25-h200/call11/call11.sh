#!/usr/bin/env bash
cd "$(dirname "$0")" && . benchmarks/device_env.sh
timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider tests/moe tests/train tests/test_cli.py tests/parallel tests/model tests/optim tests/test_backend.py tests/bench tests/data tests/testing > $OUT/gpu_tests_rest.log 2>&1
echo "tests rc=$?"; tail -3 $OUT/gpu_tests_rest.log
timeout 60 python3 -m ptxtrain train --preset small --precision fp8 --steps 5 --batch-size 8 --seq-len 1024 --eval-every 0 --sample-tokens 0 --ckpt-every 0 --out /tmp/r --no-progress 2>&1 | grep -E "throughput|train loss|model:"
date -u +%T
