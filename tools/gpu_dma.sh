#!/usr/bin/env bash
# One device call for Dynamic Mask Attention on long sequences (key-interval masks): the GPU
# tests of the selection, the interval kernels and the KeyIntervals API, a quick probe of the
# key rows, then the dma_long benchmark suite. Logs go to $OUT.
#   bash tools/gpu_dma.sh   (TEST_S / PROBE_S / BENCH_S: per-step time limits, 0 skips;
#                              PROBE_ARGS: arguments of tools/dma_probe.py;
#                              CUDA=1: also the cuda backend's interval kernels -- installs
#                              the CUTLASS wheel, run with carry [".wheels"], builds the
#                              specialisations the tests use side by side first;
#                              BENCH_BACKENDS: the dma_long rows' explicit backends)
source "$(dirname "$0")/device_common.sh"
export FLASH_DMATTN_CACHE_DIR=${FLASH_DMATTN_CACHE_DIR:-$W/cache}
TESTS="tests/test_triton_intervals.py tests/test_topk_intervals.py tests/test_key_intervals.py"
if [ "${CUDA:-0}" = 1 ]; then
  device_install cutlass
  for spec in d128-bf16-mask-bias d128-fp16-mask-bias d128-bf16-mask d128-fp16-mask \
      d64-bf16-mask-bias d64-fp16-mask-bias d64-bf16-mask d64-bf16 d96-bf16-mask-bias \
      d96-fp16-mask-bias; do
    timeout "${BUILD_S:-300}" python3 -m flash_dmattn build "$spec" >"$W/build-$spec.log" 2>&1 &
  done
  wait
  for f in "$W"/build-*.log; do echo "== $f"; tail -2 "$f"; done >"$OUT/build.log"
  grep -B1 -iE "error|fail" "$OUT/build.log" | head -20
  TESTS="tests/test_cuda_intervals.py $TESTS"
else
  device_install
fi
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } >"$OUT/env.txt"
cat "$OUT/env.txt"
if [ "${TEST_S:-240}" -gt 0 ]; then
  timeout "${TEST_S:-240}" python3 -m pytest -q -p no:cacheprovider --maxfail=4 ${TEST_K:+-k "$TEST_K"} \
    $TESTS >"$OUT/tests.log" 2>&1
  echo "tests rc=$?" >>"$OUT/tests.log"
  tail -4 "$OUT/tests.log"
fi
if [ "${PROBE_S:-300}" -gt 0 ]; then
  timeout "${PROBE_S:-300}" python3 tools/dma_probe.py ${PROBE_ARGS:-16384 32768} >"$OUT/probe.log" 2>&1
  echo "probe rc=$?" >>"$OUT/probe.log"
  cat "$OUT/probe.log" | head -80
fi
[ "${BENCH_S:-0}" -gt 0 ] && bench dma "${BENCH_S}" --suite dma_long --backends "${BENCH_BACKENDS:-triton}"
[ -d "$W/bench-dma" ] && cp "$W"/bench-dma/*/*.md "$W"/bench-dma/*/*.json "$OUT/" 2>/dev/null
exit 0
