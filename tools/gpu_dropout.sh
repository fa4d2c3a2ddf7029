#!/usr/bin/env bash
# One device call for the cost of attention dropout on the cuda kernels, optionally against
# kernel switches: builds the d128 bf16 modules tools/dropout_probe.py uses, and the same again
# for each variant of AB_FLAGS (nvcc flag sets separated by ";"), runs the cuda dropout GPU
# tests against each variant's build (AB_TESTS, default tests/test_cuda_dropout.py; AB_K a -k
# expression; AB_TESTS_S seconds at most per variant; modules of other specs build in the
# call), then tools/dropout_probe.py --backends cuda for ROUNDS rounds (default 2), each round
# running the default build and then every variant, so their rows compare within the call
# (PROBE_ARGS adds arguments, PROBE_S limits each run). Logs go to $OUT.
#   AB_FLAGS="-DFLASH_DMATTN_DROP_EARLY=1;-DFLASH_DMATTN_DROP_PRODUCER=1" \
#     bash tools/gpu_dropout.sh                                  (carry [".wheels"])
source "$(dirname "$0")/device_common.sh"
export FLASH_DMATTN_CACHE_DIR=${FLASH_DMATTN_CACHE_DIR:-$W/cache}
export MAX_JOBS=${MAX_JOBS:-4}
device_install cutlass
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
IFS=';' read -r -a variants <<<"${AB_FLAGS:-}"
builds=("" "${variants[@]}")
n=0
for flags in "${builds[@]}"; do
  for spec in d128-bf16 d128-bf16-mask-bias; do
    FLASH_DMATTN_CUDA_FLAGS="$flags" timeout 400 python3 -m flash_dmattn build "$spec" \
      >"$W/build-$n-$spec.log" 2>&1 &
  done
  n=$((n + 1))
done
wait
for f in "$W"/build-*.log; do echo "== $f"; tail -1 "$f"; done | tee "$OUT/build.log"
for flags in "${variants[@]}"; do
  FLASH_DMATTN_CUDA_FLAGS="$flags" timeout "${AB_TESTS_S:-240}" python3 -m pytest -q \
    -p no:cacheprovider -m gpu ${AB_TESTS:-tests/test_cuda_dropout.py} ${AB_K:+-k "$AB_K"} \
    >>"$OUT/ab-tests.log" 2>&1
  echo "tests with FLASH_DMATTN_CUDA_FLAGS=$flags rc=$?: $(tail -n 1 "$OUT/ab-tests.log")" |
    tee -a "$OUT/build.log"
done
PROBE=(python3 tools/dropout_probe.py --backends cuda ${PROBE_ARGS:-})
for r in $(seq "${ROUNDS:-2}"); do
  for flags in "${builds[@]}"; do
    echo "== round $r: FLASH_DMATTN_CUDA_FLAGS=$flags" | tee -a "$OUT/probe.log"
    FLASH_DMATTN_CUDA_FLAGS="$flags" timeout "${PROBE_S:-120}" "${PROBE[@]}" 2>&1 |
      tee -a "$OUT/probe.log"
  done
done
exit 0
