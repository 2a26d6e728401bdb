#!/usr/bin/env bash
cd "$(dirname "$0")" && . benchmarks/device_env.sh
timeout 380 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gemm/test_triton.py tests/gemm/test_gluon.py tests/gemm/test_cublas.py tests/test_cli.py tests/train 2>&1 | tee $OUT/logs/gpu_tests_b.log | tail -4
date -u +%T
