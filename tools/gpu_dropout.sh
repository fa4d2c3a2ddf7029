#!/usr/bin/env bash
# One device call for the cost of attention dropout on the cuda kernels, optionally against a
# kernel switch: builds the d128 bf16 modules tools/dropout_probe.py uses (and, with AB_FLAGS,
# the same again with those nvcc flags), runs the cuda dropout GPU tests against the AB_FLAGS
# build (AB_TESTS, default tests/test_cuda_dropout.py; AB_TESTS_S seconds at most; modules of
# other specs build in the call), then tools/dropout_probe.py --backends cuda for ROUNDS rounds
# (default 2), alternating the default and the AB_FLAGS builds so their rows compare within
# the call (PROBE_ARGS adds arguments, PROBE_S limits each run). Logs go to $OUT.
#   AB_FLAGS="-DFLASH_DMATTN_DROP_EARLY=1" bash tools/gpu_dropout.sh   (carry [".wheels"])
source "$(dirname "$0")/device_common.sh"
export FLASH_DMATTN_CACHE_DIR=${FLASH_DMATTN_CACHE_DIR:-$W/cache}
export MAX_JOBS=${MAX_JOBS:-4}
device_install cutlass
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
for spec in d128-bf16 d128-bf16-mask-bias; do
  timeout 400 python3 -m flash_dmattn build "$spec" >"$W/build-$spec.log" 2>&1 &
  if [ -n "${AB_FLAGS:-}" ]; then
    FLASH_DMATTN_CUDA_FLAGS="$AB_FLAGS" timeout 400 python3 -m flash_dmattn build "$spec" \
      >"$W/build-ab-$spec.log" 2>&1 &
  fi
done
wait
for f in "$W"/build-*.log; do echo "== $f"; tail -1 "$f"; done | tee "$OUT/build.log"
if [ -n "${AB_FLAGS:-}" ]; then
  FLASH_DMATTN_CUDA_FLAGS="$AB_FLAGS" timeout "${AB_TESTS_S:-240}" python3 -m pytest -q \
    -p no:cacheprovider -m gpu ${AB_TESTS:-tests/test_cuda_dropout.py} >"$OUT/ab-tests.log" 2>&1
  echo "AB tests rc=$?: $(tail -n 1 "$OUT/ab-tests.log")" | tee -a "$OUT/build.log"
fi
PROBE=(python3 tools/dropout_probe.py --backends cuda ${PROBE_ARGS:-})
for r in $(seq "${ROUNDS:-2}"); do
  echo "== round $r: default build" | tee -a "$OUT/probe.log"
  timeout "${PROBE_S:-120}" "${PROBE[@]}" 2>&1 | tee -a "$OUT/probe.log"
  if [ -n "${AB_FLAGS:-}" ]; then
    echo "== round $r: FLASH_DMATTN_CUDA_FLAGS=$AB_FLAGS" | tee -a "$OUT/probe.log"
    FLASH_DMATTN_CUDA_FLAGS="$AB_FLAGS" timeout "${PROBE_S:-120}" "${PROBE[@]}" 2>&1 |
      tee -a "$OUT/probe.log"
  fi
done
exit 0
