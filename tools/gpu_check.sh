#!/usr/bin/env bash
# One device call: install, report the environment, run the whole test suite (GPU tests
# included), the demo and (optionally) benchmarks. Logs go to $OUT (or ./gpu_out).
#   bash tools/gpu_check.sh [tests|demo|bench|testbench|profile|all] [extra pytest args...]
# env: BENCH_SUITE (default all), BENCH_BACKENDS (default: every available backend),
#      PROFILE_SUITE (default dynamic,dense), PROFILE_BACKENDS (default triton,flex)
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
what=${1:-all}
shift || true
export PYTHONUNBUFFERED=1
PY=python3
$PY -m pip install --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv; \
  $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } | tee "$OUT/env.txt"
$PY -m flash_dmattn info | tee "$OUT/info.txt"
status=0
if [[ $what == tests || $what == testbench || $what == all ]]; then
  # extra arguments replace the default target (the whole suite)
  $PY -m pytest -q -p no:cacheprovider --durations=15 "${@:-tests}" 2>&1 | tee "$OUT/tests.log"
  status=${PIPESTATUS[0]}
fi
if [[ $what == demo || $what == all ]]; then
  $PY -m flash_dmattn demo 2>&1 | tee "$OUT/demo.txt"
fi
if [[ $what == bench || $what == testbench || $what == all ]] && [[ -f benchmarks/run.py ]]; then
  $PY -m benchmarks.run --suite "${BENCH_SUITE:-all}" ${BENCH_BACKENDS:+--backends "$BENCH_BACKENDS"} \
    --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log"
fi
if [[ $what == profile ]]; then
  $PY -m benchmarks.profile --suite "${PROFILE_SUITE:-dynamic,dense}" \
    --backends "${PROFILE_BACKENDS:-triton,flex}" --out "$OUT" > "$OUT/profile.log" 2>&1
  tail -5 "$OUT/profile.log"
fi
exit $status
