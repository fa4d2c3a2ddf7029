#!/usr/bin/env bash
# Per-kernel times of T1-T3 forward + backward, cuda next to triton (scripts/bwd_probe.py), on
# the device. Builds the cuda specialisations first (run with carry: [".wheels"]).
#   ONLY=T2 BACKENDS=cuda,triton FLAGS="-D..." bash scripts/gpu_bwd_probe.sh
# UNFUSED=1 adds a cuda-only pass with FLASH_DMATTN_CUDA_FUSED_DQ=0 (separate dQ kernel);
# NCU="T1 T2" reads the cuda dK/dV kernel (NCU_KERNEL regex) of those workloads with Nsight
# Compute; PROBE=0 skips the timing pass.
source "$(dirname "$0")/device_common.sh"
export FLASH_DMATTN_CACHE_DIR=${FLASH_DMATTN_CACHE_DIR:-$W/cache}
export FLASH_DMATTN_CUDA_FLAGS=${FLAGS:-}
export MAX_JOBS=16
device_install cutlass
timeout 240 python3 -m flash_dmattn build ${SPECS:-d128-bf16 d128-bf16-mask-bias d128-bf16-mask} \
  >"$OUT/bwd-probe-build.log" 2>&1
echo "build rc=$?" | tee -a "$OUT/bwd-probe-build.log"
[ "${PROBE:-1}" = 1 ] && timeout "${PROBE_S:-300}" python3 scripts/bwd_probe.py --only "${ONLY:-T1,T2,T3}" \
  --backends "${BACKENDS:-cuda,triton}" 2>&1 | tee "$OUT/bwd-probe.log"
if [ "${UNFUSED:-0}" = 1 ]; then
  FLASH_DMATTN_CUDA_FUSED_DQ=0 timeout "${PROBE_S:-300}" python3 scripts/bwd_probe.py \
    --only "${ONLY:-T1,T2,T3}" --backends cuda 2>&1 | tee "$OUT/bwd-probe-unfused.log" | grep -v "at::native"
fi
for r in ${NCU:-}; do
  bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  # The backward runs on autograd's device thread, outside the main thread's NVTX range: pick
  # the kernel after the probe's three warm-up steps instead.
  timeout "${NCU_S:-150}" "$bin" --clock-control none -k "regex:${NCU_KERNEL:-dkdv}" -s 3 -c 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section SchedulerStats --section Occupancy --section LaunchStats --section InstructionStats \
    --section SourceCounters --import-source no \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 scripts/bwd_probe.py --ncu --only "$r" --backends cuda >"$OUT/ncu-bwd-$r.txt" 2>&1
  echo "== ncu $r rc=$?"
  grep -E "Duration|DRAM Throughput|L2 Hit|Registers Per|Issued Warp|Executed Ipc|Achieved Occ|stalled|SM Busy|Compute \(SM\)|Memory Throughput" \
    "$OUT/ncu-bwd-$r.txt" | awk '$NF+0 > 0.1 || !/stalled/' | head -40
done
exit 0
