#!/usr/bin/env bash
# One device call for the cuda key-interval forward, optionally against kernel switches
# (AB_FLAGS: nvcc flag sets separated by ";", each a variant built beside the default):
# builds the d128 bf16 modules the breakdown uses for the default build and every variant side
# by side; runs the GPU tests AB_TESTS (pytest paths; AB_K a -k expression; AB_TESTS_S seconds
# each) against every variant (choose tests of the specs built here, d128 bf16: others build in
# the call); then, for the default build and every variant in turn, tools/fwd_breakdown.py at
# each of LENGTHS, Nsight Compute on NCU_ROWS (default build; 0 skips), tools/dma_probe.py with
# PROBE_ARGS (PROBE_S=0 skips) and the benchmarks.run rows of BENCH_ARGS, the last two in
# PROBE_ROUNDS rounds, so the builds' rows compare within the call. Logs go to $OUT.
#   AB_FLAGS="-DMY_SWITCH=1" bash tools/gpu_fwd.sh   (carry [".wheels"])
source "$(dirname "$0")/device_common.sh"
export MAX_JOBS=${MAX_JOBS:-2}
ab_setup
build_variants d128-bf16 d128-bf16-bias d128-bf16-mask d128-bf16-mask-bias >/dev/null
[ -n "${AB_TESTS:-}" ] && test_variants "$AB_TESTS"
for L in ${LENGTHS:-32768 65536}; do
  for flags in "${builds[@]}"; do
    echo "-- FLASH_DMATTN_CUDA_FLAGS=$flags" | tee -a "$OUT/breakdown.log"
    FLASH_DMATTN_CUDA_FLAGS="$flags" timeout 60 python3 tools/fwd_breakdown.py "$L" 2>&1 |
      tee -a "$OUT/breakdown.log"
  done
done
if [ "${NCU_ROWS:-0}" != 0 ]; then
  NCU_S=${NCU_S:-90} ncu_ranges tools/fwd_breakdown.py $NCU_ROWS
fi
PROBE=(python3 tools/dma_probe.py ${PROBE_ARGS:-32768 65536 --kinds causal --backends cuda})
eval "bench_args=(${BENCH_ARGS:-})"  # e.g. --suite dense --match "dense B1 H16 L16384 D128 causal"
for r in $(seq "${PROBE_ROUNDS:-2}"); do
  for flags in "${builds[@]}"; do
    if [ "${PROBE_S:-120}" -gt 0 ]; then
      echo "== probe round $r: FLASH_DMATTN_CUDA_FLAGS=$flags" | tee -a "$OUT/probe.log"
      FLASH_DMATTN_CUDA_FLAGS="$flags" timeout "${PROBE_S:-120}" "${PROBE[@]}" 2>&1 |
        tee -a "$OUT/probe.log"
    fi
    if [ ${#bench_args[@]} -gt 0 ]; then
      echo "== bench round $r: FLASH_DMATTN_CUDA_FLAGS=$flags" | tee -a "$OUT/bench.log"
      FLASH_DMATTN_CUDA_FLAGS="$flags" timeout "${BENCH_S:-120}" python3 -m benchmarks.run \
        --out "$W/bench-$r-${#flags}" "${bench_args[@]}" 2>&1 | grep -E "^== |^   " |
        tee -a "$OUT/bench.log"
    fi
  done
done
exit 0
