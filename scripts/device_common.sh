# Sourced by the scripts/gpu_*.sh device runs: the shared preamble and helpers.
#   OUT  where logs go ($OUT on the device machine, gpu_out locally)
#   W    a scratch directory for build caches, bench JSON and install logs
# device_install [cutlass]   editable install of this checkout (no network on the device:
#                            --no-deps --no-build-isolation); with "cutlass", also the
#                            nvidia-cutlass wheel carried in .wheels/ (run with carry [".wheels"])
# bench NAME LIMIT ARGS...   python -m benchmarks.run ARGS under a time limit, log to
#                            $OUT/bench-NAME.log, print its result rows
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
W=$(mktemp -d)
export PYTHONUNBUFFERED=1

device_install() {
  { python3 -m pip install --no-deps --no-build-isolation -e . &&
    if [ "${1:-}" = cutlass ]; then
      python3 -m pip install --no-deps .wheels/nvidia_cutlass-*.whl
    fi; } >"$W/install.log" 2>&1 || { tail -20 "$W/install.log"; exit 1; }
}

bench() {
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 -m benchmarks.run --out "$W/bench-$name" "$@" >"$OUT/bench-$name.log" 2>&1
  grep -E "^== |^   " "$OUT/bench-$name.log" | head -40
}
