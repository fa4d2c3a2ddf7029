#!/usr/bin/env bash
# Where T3's forward time goes (scripts/t3_probe.py) on the device: full call, kernel alone on
# prebuilt lists, planning on the GPU and host clocks.
source "$(dirname "$0")/device_common.sh"
device_install
timeout "${PROBE_S:-240}" python3 scripts/t3_probe.py 2>&1 | tee "$OUT/t3-probe.log"
if [ "${NCU:-0}" = 1 ]; then
  NCU_BIN=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  timeout "${NCU_S:-180}" "$NCU_BIN" --clock-control none --nvtx --nvtx-include "t3/" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section SchedulerStats --section Occupancy --section LaunchStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 scripts/t3_probe.py --ncu >"$OUT/ncu-t3.txt" 2>&1
  echo "ncu rc=$?" >>"$OUT/ncu-t3.txt"
  grep -E "attn_fwd|Duration|DRAM Throughput|L2 Hit|Registers Per|Issued Warp|Achieved Occ|stalled|rc=" "$OUT/ncu-t3.txt" | awk '$NF+0 > 0.05 || !/stalled/' | head -40
fi
exit 0
