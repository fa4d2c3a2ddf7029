#!/usr/bin/env bash
# One device call for the cuda key-interval forward: builds the d128 bf16 modules the
# breakdown uses side by side (and, with AB_FLAGS, all of them again with those nvcc flags), then tools/fwd_breakdown.py at each of LENGTHS (default and AB_FLAGS builds in the
# same call, so their rows compare), Nsight Compute on NCU_ROWS (0 skips), and
# tools/dma_probe.py with PROBE_ARGS (PROBE_S=0 skips; with AB_FLAGS, PROBE_ROUNDS rounds
# alternating the two builds). With AB_FLAGS and AB_TESTS (pytest
# paths; AB_K a -k expression), those GPU tests first run against the AB_FLAGS build
# (AB_TESTS_S seconds at most), so one call checks a kernel switch and times it: choose tests
# of the specs built here (d128 bf16), others would build in the call. BENCH_ARGS adds
# benchmarks.run rows, alternating the builds. Logs go to $OUT.
#   bash tools/gpu_fwd.sh   (run with carry [".wheels"])
source "$(dirname "$0")/device_common.sh"
export FLASH_DMATTN_CACHE_DIR=${FLASH_DMATTN_CACHE_DIR:-$W/cache}
export MAX_JOBS=${MAX_JOBS:-2}
device_install cutlass
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
for spec in d128-bf16 d128-bf16-bias d128-bf16-mask d128-bf16-mask-bias; do
  timeout 300 python3 -m flash_dmattn build "$spec" >"$W/build-$spec.log" 2>&1 &
  if [ -n "${AB_FLAGS:-}" ]; then
    FLASH_DMATTN_CUDA_FLAGS="$AB_FLAGS" timeout 300 python3 -m flash_dmattn build "$spec" \
      >"$W/build-ab-$spec.log" 2>&1 &
  fi
done
wait
for f in "$W"/build-*.log; do echo "== $f"; tail -1 "$f"; done >"$OUT/build.log"
if [ -n "${AB_FLAGS:-}" ] && [ -n "${AB_TESTS:-}" ]; then
  FLASH_DMATTN_CUDA_FLAGS="$AB_FLAGS" timeout "${AB_TESTS_S:-240}" python3 -m pytest -q \
    -p no:cacheprovider -m gpu $AB_TESTS ${AB_K:+-k "$AB_K"} >"$OUT/ab-tests.log" 2>&1
  echo "AB tests rc=$?: $(tail -n 1 "$OUT/ab-tests.log")" | tee -a "$OUT/build.log"
fi
for L in ${LENGTHS:-32768 65536}; do
  timeout 60 python3 tools/fwd_breakdown.py "$L" 2>&1 | tee -a "$OUT/breakdown.log"
  if [ -n "${AB_FLAGS:-}" ]; then
    echo "-- with FLASH_DMATTN_CUDA_FLAGS=$AB_FLAGS" | tee -a "$OUT/breakdown.log"
    FLASH_DMATTN_CUDA_FLAGS="$AB_FLAGS" timeout 60 python3 tools/fwd_breakdown.py "$L" 2>&1 |
      tee -a "$OUT/breakdown.log"
  fi
done
if [ "${NCU_ROWS:-0}" != 0 ]; then
  NCU_S=${NCU_S:-90} ncu_ranges tools/fwd_breakdown.py $NCU_ROWS
fi
# The probe: with AB_FLAGS, PROBE_ROUNDS rounds (default 2) alternating the default and the
# AB_FLAGS builds, so their rows compare within the call.
if [ "${PROBE_S:-120}" -gt 0 ]; then
  PROBE=(python3 tools/dma_probe.py ${PROBE_ARGS:-32768 65536 --kinds causal --backends cuda})
  if [ -z "${AB_FLAGS:-}" ]; then
    timeout "${PROBE_S:-120}" "${PROBE[@]}" 2>&1 | tee "$OUT/probe.log"
  else
    for r in $(seq "${PROBE_ROUNDS:-2}"); do
      echo "== round $r: default build" | tee -a "$OUT/probe.log"
      timeout "${PROBE_S:-120}" "${PROBE[@]}" 2>&1 | tee -a "$OUT/probe.log"
      echo "== round $r: FLASH_DMATTN_CUDA_FLAGS=$AB_FLAGS" | tee -a "$OUT/probe.log"
      FLASH_DMATTN_CUDA_FLAGS="$AB_FLAGS" timeout "${PROBE_S:-120}" "${PROBE[@]}" 2>&1 |
        tee -a "$OUT/probe.log"
    done
  fi
fi
# BENCH_ARGS (benchmarks.run arguments, e.g. --suite dense --match "dense B1 H16 L16384 D128
# causal" --backends cuda): those rows too, alternating the builds for PROBE_ROUNDS rounds.
if [ -n "${BENCH_ARGS:-}" ]; then
  eval "bench_args=($BENCH_ARGS)"
  builds=("")
  [ -n "${AB_FLAGS:-}" ] && builds+=("$AB_FLAGS")
  for r in $(seq "${PROBE_ROUNDS:-2}"); do
    for flags in "${builds[@]}"; do
      echo "== bench round $r: FLASH_DMATTN_CUDA_FLAGS=$flags" | tee -a "$OUT/bench.log"
      FLASH_DMATTN_CUDA_FLAGS="$flags" timeout "${BENCH_S:-120}" python3 -m benchmarks.run \
        --out "$W/bench-$r-${#flags}" "${bench_args[@]}" 2>&1 | grep -E "^== |^   " |
        tee -a "$OUT/bench.log"
    done
  done
fi
exit 0
