#!/usr/bin/env bash
# One device call for the cost of attention dropout on the cuda kernels, optionally against
# kernel switches (AB_FLAGS: nvcc flag sets separated by ";", each a variant built beside the
# default): builds the d128 bf16 modules tools/dropout_probe.py uses for the default build and
# every variant side by side, runs the cuda dropout GPU tests against every variant (AB_TESTS,
# default tests/test_cuda_dropout.py; AB_K a -k expression; AB_TESTS_S seconds each; modules of
# other specs build in the call), then tools/dropout_probe.py --backends cuda for ROUNDS rounds
# (default 2), each over the default build and every variant, so their rows compare within the
# call (PROBE_ARGS adds arguments, PROBE_S limits each run). Logs go to $OUT.
#   AB_FLAGS="-DMY_SWITCH=1;-DMY_SWITCH=1 -DMY_OTHER_SWITCH=1" \
#     bash tools/gpu_dropout.sh                                  (carry [".wheels"])
source "$(dirname "$0")/device_common.sh"
export MAX_JOBS=${MAX_JOBS:-4}
ab_setup
build_variants d128-bf16 d128-bf16-mask-bias
test_variants "${AB_TESTS:-tests/test_cuda_dropout.py}"
PROBE=(python3 tools/dropout_probe.py --backends cuda ${PROBE_ARGS:-})
for r in $(seq "${ROUNDS:-2}"); do
  for flags in "${builds[@]}"; do
    echo "== round $r: FLASH_DMATTN_CUDA_FLAGS=$flags" | tee -a "$OUT/probe.log"
    FLASH_DMATTN_CUDA_FLAGS="$flags" timeout "${PROBE_S:-120}" "${PROBE[@]}" 2>&1 |
      tee -a "$OUT/probe.log"
  done
done
exit 0
