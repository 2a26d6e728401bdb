#!/usr/bin/env bash
cd "$(dirname "$0")" && . benchmarks/device_env.sh
timeout 300 python3 -m benchmarks.diag_first_step --preset small --batch 8 --seq 1024 --steps 3 --json $OUT/first_step.json > $OUT/first_step.log 2>&1
echo "rc=$?"; grep -A16 "^first step" $OUT/first_step.log
date -u +%T
