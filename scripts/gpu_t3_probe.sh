#!/usr/bin/env bash
# Where T3's forward time goes (scripts/t3_probe.py) on the device: full call, kernel alone on
# prebuilt lists, planning on the GPU and host clocks.
source "$(dirname "$0")/device_common.sh"
device_install
[ "${PROBE:-1}" = 1 ] && timeout "${PROBE_S:-240}" python3 scripts/t3_probe.py 2>&1 | tee "$OUT/t3-probe.log"
if [ "${NCU:-0}" = 1 ]; then
  NCU_BIN=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  for r in t3 t3n; do
  timeout "${NCU_S:-180}" "$NCU_BIN" --clock-control none --nvtx --nvtx-include "$r/" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section SchedulerStats --section Occupancy --section LaunchStats \
    --metrics "smsp__inst_executed.sum,smsp__cycles_active.avg,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_gmma_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio" \
    python3 scripts/t3_probe.py --ncu >"$OUT/ncu-$r.txt" 2>&1
  echo "ncu rc=$?" >>"$OUT/ncu-$r.txt"
  echo "== ncu $r"
  grep -E "attn_fwd|Duration|DRAM Throughput|L2 Hit|Registers Per|Issued Warp|Achieved Occ|stalled|inst_executed|cycles_active|warps_active|rc=" "$OUT/ncu-$r.txt" | awk '$NF+0 > 0.05 || !/stalled/' | head -40
  done
fi
exit 0
