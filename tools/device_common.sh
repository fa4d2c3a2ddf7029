# Sourced by the tools/gpu_*.sh device runs: the shared preamble and helpers.
#   OUT  where logs go ($OUT on the device machine, gpu_out locally)
#   W    a scratch directory for build caches, bench JSON and install logs
# device_install [cutlass]   editable install of this checkout (no network on the device:
#                            --no-deps --no-build-isolation); with "cutlass", also the
#                            nvidia-cutlass wheel carried in .wheels/ (run with carry [".wheels"])
# bench NAME LIMIT ARGS...   python -m benchmarks.run ARGS under a time limit, log to
#                            $OUT/bench-NAME.log, print its result rows
# ab_setup                   the preamble of a switch A/B call: a kernel cache under $W (unless
#                            FLASH_DMATTN_CACHE_DIR is set), the install with the CUTLASS
#                            wheel, the GPU's name in $OUT/env.txt, ab_variants
# ab_variants                sets the array `builds`: "" (the default build), then each nvcc
#                            flag set of AB_FLAGS (separated by ";"): kernel switches to build,
#                            test and time beside the default in one call
# build_variants SPEC...     every SPEC under every flag set of `builds`, side by side; the last
#                            line of each build's log to $OUT/build.log
# test_variants TESTS        pytest -m gpu TESTS (AB_K: a -k expression) under each switch
#                            variant (AB_TESTS_S seconds each), log to $OUT/ab-tests.log
# ncu_ranges SCRIPT RANGE... Nsight Compute on `python3 SCRIPT --ncu`, once per NVTX range
#                            (kernels inside RANGE/), log to $OUT/ncu-RANGE.txt, print the
#                            headline rows; NCU_METRICS (comma list) replaces the stall metrics
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
W=$(mktemp -d)
export PYTHONUNBUFFERED=1

device_install() {
  # Already installed from this checkout (an earlier job of the call): nothing to do, and no
  # reinstall under other jobs that are importing the package.
  if python3 -c "import os, sys, flash_dmattn; sys.exit(os.path.dirname(os.path.dirname(
      os.path.abspath(flash_dmattn.__file__))) != os.getcwd())" 2>/dev/null &&
     { [ "${1:-}" != cutlass ] || python3 -c "import cutlass_library" 2>/dev/null; }; then
    return 0
  fi
  { python3 -m pip install --no-deps --no-build-isolation -e . &&
    if [ "${1:-}" = cutlass ]; then
      python3 -m pip install --no-deps .wheels/nvidia_cutlass-*.whl
    fi; } >"$W/install.log" 2>&1 || { tail -20 "$W/install.log"; exit 1; }
}

ab_setup() {
  export FLASH_DMATTN_CACHE_DIR=${FLASH_DMATTN_CACHE_DIR:-$W/cache}
  device_install cutlass
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
  ab_variants
}

ab_variants() {
  IFS=';' read -r -a builds <<<"${AB_FLAGS:-}"
  builds=("" "${builds[@]}")
}

build_variants() {
  local n=0 flags spec
  for flags in "${builds[@]}"; do
    for spec in "$@"; do
      FLASH_DMATTN_CUDA_FLAGS="$flags" timeout 400 python3 -m flash_dmattn build "$spec" \
        >"$W/build-$n-$spec.log" 2>&1 &
    done
    n=$((n + 1))
  done
  wait
  for f in "$W"/build-*.log; do echo "== $f"; tail -1 "$f"; done | tee -a "$OUT/build.log"
}

test_variants() {
  local flags
  for flags in "${builds[@]:1}"; do
    FLASH_DMATTN_CUDA_FLAGS="$flags" timeout "${AB_TESTS_S:-240}" python3 -m pytest -q \
      -p no:cacheprovider -m gpu $1 ${AB_K:+-k "$AB_K"} >>"$OUT/ab-tests.log" 2>&1
    echo "tests with FLASH_DMATTN_CUDA_FLAGS=$flags rc=$?: $(tail -n 1 "$OUT/ab-tests.log")" |
      tee -a "$OUT/build.log"
  done
}

bench() {
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 -m benchmarks.run --out "$W/bench-$name" "$@" >"$OUT/bench-$name.log" 2>&1
  grep -E "^== |^   " "$OUT/bench-$name.log" | head -40
}

ncu_ranges() {
  local script=$1 bin r
  shift
  bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  for r in "$@"; do
    timeout "${NCU_S:-180}" "$bin" --clock-control none --nvtx --nvtx-include "$r/" \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
      --section SchedulerStats --section Occupancy --section LaunchStats \
      --metrics "${NCU_METRICS:-regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio}" \
      python3 "$script" --ncu >"$OUT/ncu-$r.txt" 2>&1
    echo "ncu rc=$?" >>"$OUT/ncu-$r.txt"
    echo "== ncu $r"
    grep -E "attn_fwd|Duration|DRAM Throughput|L2 Hit|Registers Per|Issued Warp|Achieved Occ|stalled|inst_executed|cycles_active|rc=" "$OUT/ncu-$r.txt" | awk '$NF+0 > 0.05 || !/stalled/' | head -40
  done
}
