#!/usr/bin/env bash
# Where T2's time goes (scripts/t2_probe.py) on the device, plus an Nsight Compute read of the
# Triton T2 forward kernel (NCU=0 skips it). With cuda in BACKENDS, builds its T2
# specialisation first (run with carry: [".wheels"]).
source "$(dirname "$0")/device_common.sh"
export FLASH_DMATTN_CACHE_DIR=${FLASH_DMATTN_CACHE_DIR:-$W/cache}
export MAX_JOBS=16
BACKENDS=${BACKENDS:-triton,cuda}
device_install cutlass
case "$BACKENDS" in *cuda*)
  timeout 240 python3 -m flash_dmattn build d128-bf16-mask-bias >"$OUT/build.log" 2>&1
  echo "build rc=$?" >>"$OUT/build.log";;
esac
timeout "${PROBE_S:-200}" python3 scripts/t2_probe.py --backends "$BACKENDS" 2>&1 | tee "$OUT/t2-probe.log"
if [ "${NCU:-1}" = 1 ]; then
  NCU_BIN=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  for r in t2 t2g; do
    timeout "${NCU_S:-180}" "$NCU_BIN" --clock-control none --nvtx --nvtx-include "$r/" \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
      --section SchedulerStats --section Occupancy --section LaunchStats \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
      python3 scripts/t2_probe.py --ncu >"$OUT/ncu-$r.txt" 2>&1
    echo "ncu rc=$?" >>"$OUT/ncu-$r.txt"
    echo "== ncu $r"
    grep -E "attn_fwd|Duration|DRAM Throughput|L2 Hit|Registers Per|Issued Warp|Achieved Occ|stalled|rc=" "$OUT/ncu-$r.txt" | awk '$NF+0 > 0.05 || !/stalled/' | head -40
  done
fi
exit 0
