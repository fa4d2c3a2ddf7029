#!/usr/bin/env bash
# The cuda backend's whole GPU test suite with its kernel builds, in one device call (issue 4:
# "the GPU test suite including compiles fits one 10-minute device call"), from an empty
# kernel cache. Logs go to $OUT; the call's phases are timed in $OUT/suite-times.log.
#   bash tools/gpu_cuda_suite.sh      (run with carry: [".wheels"]; BUILD_P builds at once)
# 1. first-use build of the forward of d128-bf16-mask-bias alone, MAX_JOBS=16 (issue 34's
#    target: <= 25 s on 16 cores), then its backward and decode (FIRST_BUILD=0 skips);
# 2. the tests run once with --record-cuda-specs: every kernel module they ask for (one per
#    operation of a spec, SPEC:OP) is listed and nothing is built or run (fast);
# 3. the listed modules build side by side (BUILD_P processes, MAX_JOBS compiles each);
# 4. every cuda GPU test runs against the built cache;
# 5. the planner's Triton kernel tests on the GPU (PLANNER_TESTS=0 skips them);
# 6. (DENSE_BENCH_S set) the dense benchmark suite.
source "$(dirname "$0")/device_common.sh"
export FLASH_DMATTN_CACHE_DIR=${FLASH_DMATTN_CACHE_DIR:-$W/cache}  # start it empty
export MAX_JOBS=${MAX_JOBS:-4}
device_install cutlass
T0=$(date +%s)
stamp() { echo "$1 at $(( $(date +%s) - T0 )) s" | tee -a "$OUT/suite-times.log"; }
TESTS=${TESTS:-"tests/test_cuda_backend.py tests/test_gpu.py tests/test_cuda_jit.py tests/test_cuda_intervals.py"}
K=${K:-cuda}

if [ "${FIRST_BUILD:-1}" = 1 ]; then
  MAX_JOBS=16 /usr/bin/time -f "build wall %e s" timeout 200 \
    python3 -m flash_dmattn build d128-bf16-mask-bias:fwd >"$OUT/build-first.log" 2>&1
  tail -2 "$OUT/build-first.log"
  stamp "first forward build done"
  MAX_JOBS=16 /usr/bin/time -f "build wall %e s" timeout 200 \
    python3 -m flash_dmattn build d128-bf16-mask-bias:bwd,decode >"$OUT/build-rest.log" 2>&1
  tail -4 "$OUT/build-rest.log"
  stamp "its backward and decode built"
fi

timeout 150 python3 -m pytest -q -p no:cacheprovider $TESTS -k "$K" ${MARK:+-m "$MARK"} \
  --record-cuda-specs "$W/specs.txt" >"$OUT/record.log" 2>&1
sort -u "$W/specs.txt" >"$OUT/specs.txt"
stamp "recorded $(wc -l <"$OUT/specs.txt") modules"

xargs -P "${BUILD_P:-8}" -I{} sh -c \
  'timeout 400 python3 -m flash_dmattn build {} >"$0/build-{}.log" 2>&1 || echo "{} FAILED"' "$W" \
  <"$OUT/specs.txt"
for f in "$W"/build-*.log; do tail -2 "$f"; done >"$OUT/build.log"
stamp "built $(grep -c 'built in\|already built' "$OUT/build.log") modules"

timeout "${TEST_S:-300}" python3 -m pytest -q -p no:cacheprovider -rs $TESTS -k "$K" ${MARK:+-m "$MARK"} \
  >"$OUT/tests.log" 2>&1
echo "tests rc=$?" >>"$OUT/tests.log"
tail -4 "$OUT/tests.log"
stamp "tests done"
# The planner's Triton kernels that feed the cuda kernels (mask summary, key bits, gathered
# lists), compiled for the GPU (CPU CI runs them in the interpreter).
if [ "${PLANNER_TESTS:-1}" = 1 ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_mask_summary.py \
    >"$OUT/planner-tests.log" 2>&1
  echo "planner tests rc=$?: $(tail -n 1 "$OUT/planner-tests.log")"
  stamp "planner tests done"
fi
# DENSE_BENCH_S=N: then the dense suite's forward + backward rows (every backend) for N seconds,
# on the modules just built (auto-dispatch takes cuda for mask-free training on Hopper).
if [ -n "${DENSE_BENCH_S:-}" ]; then
  timeout "$DENSE_BENCH_S" python3 -m benchmarks.run --out "$W/dense" --suite dense \
    >"$OUT/dense-bench.log" 2>&1
  grep -E "^== |^   " "$OUT/dense-bench.log" | head -40
  stamp "dense bench done"
fi
exit 0
