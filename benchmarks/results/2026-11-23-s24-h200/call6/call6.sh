#!/usr/bin/env bash
cd "$(dirname "$0")" && . benchmarks/device_env.sh
PTXTRAIN_CMP_STEPS=200 timeout 500 python3 -m benchmarks.train_compare --out $OUT > $OUT/train_compare.txt 2>&1; tail -15 $OUT/train_compare.txt
date -u +%T
