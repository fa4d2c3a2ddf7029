#!/usr/bin/env bash
# Per-kernel times of T1-T3 forward + backward (scripts/bwd_probe.py), cuda next to triton, on
# the device; with VARIANTS ('|'-separated FLASH_DMATTN_CUDA_FLAGS, "default" = none), every
# build variant's cuda kernels one after the other (triton once). Run with carry [".wheels"].
#   ONLY=T2 BACKENDS=cuda,triton VARIANTS="default|-D..." bash scripts/gpu_bwd_probe.sh
# SPECS: the modules built for each variant. ENV_PASSES ('|'-separated environments, e.g.
# "FLASH_DMATTN_CUDA_FUSED_DQ=0|FLASH_DMATTN_CUDA_GATHER_DQ=0") adds a cuda pass of the
# default build with each (UNFUSED=1: the first of those); NCU="T1 T2" reads the cuda dK/dV
# kernel (NCU_KERNEL regex) of those workloads with Nsight Compute; PROBE=0 skips the timing
# pass; TESTS (a pytest -k expression) first runs those cuda GPU tests on the default build.
source "$(dirname "$0")/device_common.sh"
export MAX_JOBS=${MAX_JOBS:-16}
device_install cutlass
VARIANTS=${VARIANTS:-default}
IFS='|' read -ra VS <<<"$VARIANTS"
flags_of() { [ "$1" = default ] && echo "" || echo "$1"; }
cache_of() { echo "${FLASH_DMATTN_CACHE_DIR:-$W/cache}$1"; }
i=0
for v in "${VS[@]}"; do
  for spec in ${SPECS:-d128-bf16 d128-bf16-mask-bias d128-bf16-mask}; do
    FLASH_DMATTN_CACHE_DIR=$(cache_of $i) FLASH_DMATTN_CUDA_FLAGS="$(flags_of "$v")" \
      timeout 300 python3 -m flash_dmattn build "$spec" >"$W/build-$i-$spec.log" 2>&1 &
  done
  i=$((i + 1))
done
wait
tail -qn 1 "$W"/build-*.log | tee "$OUT/bwd-probe-build.log"
if [ -n "${TESTS:-}" ]; then
  FLASH_DMATTN_CACHE_DIR=$(cache_of 0) timeout "${TESTS_S:-240}" python3 -m pytest -q -x \
    tests/test_cuda_backend.py -k "$TESTS" >"$OUT/bwd-probe-tests.log" 2>&1
  echo "== tests rc=$?: $(tail -n 1 "$OUT/bwd-probe-tests.log")"
fi
if [ "${PROBE:-1}" = 1 ]; then
  i=0
  backends=${BACKENDS:-cuda,triton}
  for v in "${VS[@]}"; do
    echo "== variant: $v" | tee -a "$OUT/bwd-probe.log"
    FLASH_DMATTN_CACHE_DIR=$(cache_of $i) FLASH_DMATTN_CUDA_FLAGS="$(flags_of "$v")" \
      timeout "${PROBE_S:-300}" python3 scripts/bwd_probe.py --only "${ONLY:-T1,T2,T3}" \
      --backends "$backends" ${PROBE_ARGS:-} 2>&1 | tee -a "$OUT/bwd-probe.log" | grep -E "^== |^-- |dkdv|_dq_|dq_gathered|fwd\+bwd|summary|gather|fwd_kernel|fwd "
    backends=cuda
    i=$((i + 1))
  done
fi
[ "${UNFUSED:-0}" = 1 ] && ENV_PASSES=${ENV_PASSES:-FLASH_DMATTN_CUDA_FUSED_DQ=0}
IFS='|' read -ra PASSES <<<"${ENV_PASSES:-}"
j=0
for e in "${PASSES[@]}"; do
  echo "== env pass: $e" | tee "$OUT/bwd-probe-env$j.log"
  env $e FLASH_DMATTN_CACHE_DIR=$(cache_of 0) timeout "${PROBE_S:-300}" \
    python3 scripts/bwd_probe.py --only "${ONLY:-T1,T2,T3}" --backends cuda ${PROBE_ARGS:-} 2>&1 |
    tee -a "$OUT/bwd-probe-env$j.log" | grep -E "^== |^-- |dkdv|_dq_|dq_gathered|fwd\+bwd|summary|gather|fwd_kernel|fwd "
  j=$((j + 1))
done
for r in ${NCU:-}; do
  bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  # The backward runs on autograd's device thread, outside the main thread's NVTX range: pick
  # the kernel after the probe's three warm-up steps instead.
  FLASH_DMATTN_CACHE_DIR=$(cache_of 0) timeout "${NCU_S:-150}" "$bin" --clock-control none \
    -k "regex:${NCU_KERNEL:-dkdv}" -s 3 -c 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section SchedulerStats --section Occupancy --section LaunchStats --section InstructionStats \
    --section SourceCounters --import-source no \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 scripts/bwd_probe.py --ncu --only "$r" --backends cuda >"$OUT/ncu-bwd-$r.txt" 2>&1
  echo "== ncu $r rc=$?"
  grep -E "Duration|DRAM Throughput|L2 Hit|Registers Per|Issued Warp|Executed Ipc|Achieved Occ|stalled|SM Busy|Compute \(SM\)|Memory Throughput|Spilling Requests  " \
    "$OUT/ncu-bwd-$r.txt" | awk '$NF+0 > 0.1 || !/stalled/' | head -40
done
exit 0
