#!/usr/bin/env bash
cd "$(dirname "$0")" && . benchmarks/device_env.sh
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gemm/test_ptx.py -k "grouped" \
  tests/gemm/test_grouped.py tests/nn/test_fp8_grouped.py > $OUT/gpu_tests.log 2>&1
echo "tests rc=$?"; tail -2 $OUT/gpu_tests.log
date -u +%T
for i in 1 2 3; do for t in new old; do
  if [ $t = old ]; then d=old; else d=.; fi
  (cd $d && PTXTRAIN_JIT_CACHE_DIR=/tmp/jit-$t timeout 100 python3 -m benchmarks.bench_grouped --configs 8x512 \
     --json $OUT/grouped_${t}_$i.json 2>&1 | grep -E "^grouped_over_dense_(ptx|cublas)_[0-9x]*:" | tr '\n' ' ')
  echo " <- $t $i"
done; done
date -u +%T
