#!/usr/bin/env bash
cd "$(dirname "$0")" && . benchmarks/device_env.sh
timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gemm tests/jit > $OUT/gpu_tests_gemm_jit.log 2>&1
echo "tests rc=$?"; tail -3 $OUT/gpu_tests_gemm_jit.log
date -u +%T
