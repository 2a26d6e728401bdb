#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export PTXTRAIN_GIT_SHA=$(cat .sha)
nvidia-smi --query-gpu=name,uuid --format=csv,noheader
date -u +%T
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider -x tests/test_triton_direct.py tests/gemm/test_triton.py tests/gemm/test_grouped.py tests/moe tests/nn tests/quant/test_triton.py 2>&1 | tail -6
date -u +%T
timeout 200 python3 -m benchmarks.host_sections --preset small --batch 16 --seq 128 --warmup 4 --steps 8 --reps 30 --linear 2048 768 768 --env-ab PTXTRAIN_TRITON_DIRECT --ab-rounds 2 --json $OUT/host_ab_direct.json 2>&1 | grep -E "===|per step|Linear 2048"
date -u +%T
T="--preset small --no-mtp --no-progress --overwrite --eval-every 0 --sample-tokens 0 --ckpt-every 0 --steps 40"
for d in 1 0; do
  PTXTRAIN_TRITON_DIRECT=$d timeout 100 python3 -m ptxtrain train $T --precision fp8 --out /tmp/t$d 2>&1 | grep -E "throughput"
done
date -u +%T
