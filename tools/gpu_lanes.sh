#!/usr/bin/env bash
# Run a list of device jobs on a multi-GPU host, one job per GPU at a time: the jobs of one
# device call share the host's GPUs instead of queueing behind each other.
#   bash tools/gpu_lanes.sh JOBS_FILE
# Each non-empty line of JOBS_FILE that does not start with "#" is one shell command, run from
# the current directory with CUDA_VISIBLE_DEVICES set to the GPU it got; jobs start in file
# order as GPUs come free. A line starting with "alone:" (the prefix is removed) waits until
# every earlier job is done and runs while nothing else does: for host-bound measurements
# (decode host path, generate()), which other jobs' host work would slow down.
# Output: $OUT/job-<n>.log per job (its command on the first line), $OUT/lanes.log (start, end,
# GPU and exit status of every job). Knobs: GPUS (default: nvidia-smi's count), DEADLINE_S
# (default 560: jobs not started by then are reported "no time"; running ones are not cut,
# give each its own timeout).
set -uo pipefail
export OUT=${OUT:-gpu_out}  # jobs see it: give each its own folder, e.g. OUT=$OUT/bench ...
mkdir -p "$OUT"
[ -f "${1:-}" ] || { echo "usage: bash tools/gpu_lanes.sh JOBS_FILE"; exit 2; }
GPUS=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
[ "$GPUS" -ge 1 ] || GPUS=1
T0=$(date +%s)
DEADLINE=$(( T0 + ${DEADLINE_S:-560} ))
log() { echo "$(( $(date +%s) - T0 )) s: $*" | tee -a "$OUT/lanes.log"; }

declare -a busy  # busy[g] = pid of the job on GPU g (empty: free)
free_gpu() {     # prints a free GPU, or nothing
  local g
  for g in $(seq 0 $(( GPUS - 1 ))); do
    if [ -z "${busy[$g]:-}" ] || ! kill -0 "${busy[$g]}" 2>/dev/null; then
      echo "$g"
      return
    fi
  done
}
wait_all() {
  local g
  for g in $(seq 0 $(( GPUS - 1 ))); do
    [ -n "${busy[$g]:-}" ] && wait "${busy[$g]}" 2>/dev/null
    busy[$g]=""
  done
}

n=0
while IFS= read -r line || [ -n "$line" ]; do
  case "$line" in ''|'#'*) continue ;; esac
  n=$(( n + 1 ))
  alone=0
  if [ "${line#alone:}" != "$line" ]; then alone=1; line=${line#alone:}; wait_all; fi
  g=$(free_gpu)
  while [ -z "$g" ]; do sleep 1; g=$(free_gpu); done
  if [ "$(date +%s)" -ge "$DEADLINE" ]; then log "job $n no time: $line"; continue; fi
  log "job $n on GPU $g: $line"
  (
    echo "\$ $line" >"$OUT/job-$n.log"
    CUDA_VISIBLE_DEVICES=$g bash -c "$line" >>"$OUT/job-$n.log" 2>&1
    log "job $n done, rc=$?"
  ) &
  busy[$g]=$!
  [ "$alone" = 1 ] && wait_all
done <"$1"
wait_all
log "all jobs done"
