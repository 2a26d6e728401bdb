#!/usr/bin/env bash
cd "$(dirname "$0")" && . benchmarks/device_env.sh
timeout 200 python3 -m benchmarks.diag_determinism --attn-repeats 50 --no-model --quant-repeats 0 \
  --json $OUT/attn_backends.json > $OUT/logs/attn.log 2>&1; echo "attn rc=$?"; grep -E "attention|Error" $OUT/logs/attn.log
date -u +%T
