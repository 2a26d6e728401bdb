#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export PTXTRAIN_GIT_SHA=$(cat .sha)
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv,noheader
date -u +%T
for i in 1 2; do
timeout 200 python3 -m benchmarks.bench_grouped --configs 8x512 --same-expert --json $OUT/grouped_raster_$i.json \
  --cfg 128x128s5c1dk:r512 128x128s5c1dk:r1024 128x128s5c1dk:r2048 \
  --dense-cfg 128x128s5c1dk:r512 128x128s5c1dk:r2048 128x128s5c1d:r2048 2>&1 | grep -E "^\(4096, (4096|7168), |over" | grep -v -E "triton|masked|cublas"
date -u +%T
done
