#!/usr/bin/env bash
# Where T3's forward time goes (scripts/t3_probe.py) on the device: full call, kernel alone on
# prebuilt lists, planning on the GPU and host clocks.
source "$(dirname "$0")/device_common.sh"
device_install
[ "${PROBE:-1}" = 1 ] && timeout "${PROBE_S:-240}" python3 scripts/t3_probe.py 2>&1 | tee "$OUT/t3-probe.log"
if [ "${NCU:-0}" = 1 ]; then
  # instruction counts beside the stall reasons (a regex metric cannot share the list)
  NCU_METRICS="smsp__inst_executed.sum,smsp__cycles_active.avg,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_gmma_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio" \
    ncu_ranges scripts/t3_probe.py t3 t3n
fi
exit 0
