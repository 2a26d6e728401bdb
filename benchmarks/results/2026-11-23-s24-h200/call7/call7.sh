#!/usr/bin/env bash
cd "$(dirname "$0")" && . benchmarks/device_env.sh
timeout 120 python3 -m ptxtrain train --precision fp8 --fp8-recipe deepseek_pow2 --steps 30 --out /tmp/r-pow2 --no-progress > $OUT/train_tiny_pow2.txt 2>&1; grep -E "model:|step  *30|val|error" $OUT/train_tiny_pow2.txt | head -6
date -u +%T
PTXTRAIN_CMP_RECIPE=deepseek_pow2 PTXTRAIN_CMP_STEPS=200 timeout 420 python3 -m benchmarks.train_compare --out $OUT > $OUT/train_compare_pow2.txt 2>&1; tail -9 $OUT/train_compare_pow2.txt
date -u +%T
