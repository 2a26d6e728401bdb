#!/usr/bin/env bash
cd "$(dirname "$0")"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export PTXTRAIN_GIT_SHA=$(cat .sha)
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv,noheader
date -u +%T
ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
mkdir -p $OUT/logs
for item in "1d1d 7168 4096 4096" "1d2d 4096 4096 7168"; do
  read -r kind gm gn gk <<< "$item"
  timeout 150 "$ncu_bin" --clock-control none --nvtx --nvtx-include measure/ -k regex:fp8_gemm_nt_kernel \
    --launch-skip 1 --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section InstructionStats --print-details all \
    python3 -m benchmarks.profile_gemm --kind $kind --shape $gm $gn $gk --backend ptx \
    > $OUT/logs/ncu-pipes-$kind-${gm}x${gn}x${gk}.txt 2>&1
  echo "--- $kind $gm $gn $gk"
  grep -E "Duration|SM Frequency|Pipe|pipe|Tensor|FMA|LSU|ALU|Shared|shared|Issue Slots|Executed Ipc|L1/TEX|Bank" \
    $OUT/logs/ncu-pipes-$kind-${gm}x${gn}x${gk}.txt | head -45
done
date -u +%T
