#!/usr/bin/env bash
cd "$(dirname "$0")" && . benchmarks/device_env.sh
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/nn tests/quant/test_cuda.py > $OUT/gpu_tests.log 2>&1
echo "tests rc=$?"; tail -2 $OUT/gpu_tests.log
date -u +%T
