#!/usr/bin/env bash
cd "$(dirname "$0")" && . benchmarks/device_env.sh
timeout 400 python3 -m benchmarks.diag_determinism --repeats 4 --json $OUT/determinism.json 2>&1 | tail -60
date -u +%T
