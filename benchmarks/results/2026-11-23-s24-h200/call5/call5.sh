#!/usr/bin/env bash
cd "$(dirname "$0")" && . benchmarks/device_env.sh
timeout 280 python3 -m ptxtrain bench gemm --json $OUT/gemm.json > $OUT/gemm.txt 2>&1; tail -30 $OUT/gemm.txt
date -u +%T
timeout 250 python3 -m ptxtrain bench quant --json $OUT/quant.json > $OUT/quant.txt 2>&1; tail -40 $OUT/quant.txt
date -u +%T
