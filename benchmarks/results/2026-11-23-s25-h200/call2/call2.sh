#!/usr/bin/env bash
cd "$(dirname "$0")" && . benchmarks/device_env.sh
# 1. the attention core alone: repeats and time, without / with deterministic algorithms
timeout 120 python3 -m benchmarks.diag_determinism --attn-repeats 100 --no-model --quant-repeats 0 \
  --json $OUT/attn.json > $OUT/logs/attn.log 2>&1; echo "attn rc=$?"; grep -E "attention|Error" $OUT/logs/attn.log
date -u +%T
# 2. the model step with no host sync, in deterministic mode (call 1: 1 of 29 repeats differed without)
timeout 200 python3 -m benchmarks.diag_determinism --deterministic --async-repeats 60 --no-model --quant-repeats 0 \
  --train-runs 2 --train-steps 10 --json $OUT/determinism_det.json > $OUT/logs/determinism_det.log 2>&1
echo "det rc=$?"; grep -E "async|train x|Error|error" $OUT/logs/determinism_det.log | head -20
date -u +%T
# 3. the cost: ptxtrain train, FP8 small, 8 x 1024 tokens, alternating
for i in 1 2; do for d in --no-deterministic --deterministic; do
  timeout 120 python3 -m ptxtrain train --preset small --precision fp8 --steps 30 --batch-size 8 --seq-len 1024 \
    --eval-every 0 --sample-tokens 0 --ckpt-every 0 --out /tmp/r$d$i --overwrite --no-progress $d > $OUT/logs/train$d$i.log 2>&1
  cp /tmp/r$d$i/summary.json $OUT/summary$d$i.json
  python3 -c "import json; d=json.load(open('$OUT/summary$d$i.json')); print('$d $i steady', round(d['steady_tokens_per_s']), 'last', round(d['losses'][-1], 6))"
done; done
date -u +%T
timeout 150 python3 -m pytest -q -m gpu tests/train tests/test_cli.py -p no:cacheprovider > $OUT/logs/gpu_tests.log 2>&1
echo "tests rc=$?"; tail -2 $OUT/logs/gpu_tests.log
date -u +%T
