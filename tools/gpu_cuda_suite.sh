#!/usr/bin/env bash
# The GPU test suite with its cuda kernel builds, in one device call, from an empty kernel
# cache (or a warm one: FLASH_DMATTN_CACHE_DIR). Logs go to $OUT (packed into $OUT/logs.tgz at
# the end, since a device call returns few files); the phases are timed in suite-times.log.
#   bash tools/gpu_cuda_suite.sh      (run with carry: [".wheels"])
# 1. (FIRST_BUILD=1) the first-use build of the forward of d128-bf16-mask-bias alone,
#    MAX_JOBS=16 (issue 34's target: <= 25 s on 16 cores), then its backward and decode;
# 2. every test file runs once with --record-cuda-specs, RECORD_P files at a time, triton and
#    flex disabled: every kernel module the tests ask for (one per operation of a spec,
#    SPEC:OP; a forward's backward with it) is listed, nothing is built;
# 3. the listed modules build side by side (BUILD_P processes, MAX_JOBS compiles each; the
#    defaults fill the machine's cores);
# 4. the test files run against the built cache, each on the next free GPU (tools/gpu_lanes.sh,
#    in TESTS order: slowest first), until DEADLINE_S seconds after the start (a file cut by
#    the deadline is reported as such, the rest as "no time");
# 5. (DENSE_BENCH_S set) the dense benchmark suite.
# Knobs: TESTS (files; FILE@EXPR runs the tests of FILE that pytest -k EXPR selects, as a job
# of its own: a slow file's parametrisations then run side by side; a "~" in EXPR stands for a
# space), MARK (pytest -m, default gpu), K (pytest -k for every file, default: all).
source "$(dirname "$0")/device_common.sh"
export FLASH_DMATTN_CACHE_DIR=${FLASH_DMATTN_CACHE_DIR:-$W/cache}
CORES=$(nproc)
export MAX_JOBS=${MAX_JOBS:-4}
BUILD_P=${BUILD_P:-$(( CORES / MAX_JOBS > 0 ? CORES / MAX_JOBS : 1 ))}
RECORD_P=${RECORD_P:-8}
device_install cutlass
T0=$(date +%s)
DEADLINE=$(( T0 + ${DEADLINE_S:-560} ))
stamp() { echo "$1 at $(( $(date +%s) - T0 )) s" | tee -a "$OUT/suite-times.log"; }
finish() {
  (cd "$OUT" && tar czf logs.tgz --remove-files $(ls | grep -v '^logs.tgz$'))
  exit 0
}
TESTS=${TESTS:-"tests/test_cuda_backend.py
  tests/test_gpu.py@matches_reference~and~triton] tests/test_gpu.py@matches_reference~and~cuda]
  tests/test_gpu.py@matches_reference~and~flex] tests/test_gpu.py@not~matches_reference
  tests/test_fuzz_backends.py@triton-bf16 tests/test_fuzz_backends.py@triton-fp16
  tests/test_fuzz_backends.py@flex tests/test_fuzz_backends.py@auto
  tests/test_fuzz_backends.py@cuda
  tests/test_cuda_intervals.py tests/test_cuda_dropout.py tests/test_cuda_host_inputs.py
  tests/test_cuda_shared_dbias.py tests/test_dropout.py tests/test_plain_decode.py
  tests/test_decode.py tests/test_topk_decode.py tests/test_paged.py tests/test_varlen_intervals.py
  tests/test_key_intervals.py tests/test_cuda_jit.py tests/test_triton_intervals.py
  tests/test_hf_integration.py tests/test_triton_fast_launch.py"}
MARK=${MARK:-gpu}
K=${K:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

if [ "${FIRST_BUILD:-0}" = 1 ]; then
  MAX_JOBS=16 /usr/bin/time -f "build wall %e s" timeout 200 \
    python3 -m flash_dmattn build d128-bf16-mask-bias:fwd >"$OUT/build-first.log" 2>&1
  tail -2 "$OUT/build-first.log"
  stamp "first forward build done"
  MAX_JOBS=16 /usr/bin/time -f "build wall %e s" timeout 200 \
    python3 -m flash_dmattn build d128-bf16-mask-bias:bwd,decode >"$OUT/build-rest.log" 2>&1
  tail -4 "$OUT/build-rest.log"
  stamp "its backward and decode built"
fi

# One recording per file, side by side: a slow file no longer cuts the others' lists short.
# (tests/conftest.py disables triton and flex while recording.)
printf '%s\n' $TESTS | sed 's/@.*//' | sort -u | xargs -P "$RECORD_P" -I{} sh -c \
  'timeout 240 python3 -m pytest -q -p no:cacheprovider "$1" ${2:+-k "$2"} -m "$3" \
     --record-cuda-specs "$0/specs-$(basename "$1" .py).txt" >"$0/record-$(basename "$1" .py).log" 2>&1;
   echo "$1 record rc=$?"' "$W" {} "$K" "$MARK" >"$OUT/record.log"
cat "$W"/specs-*.txt 2>/dev/null | sort -u >"$OUT/specs.txt"
stamp "recorded $(wc -l <"$OUT/specs.txt") modules"

xargs -P "$BUILD_P" -I{} sh -c \
  'timeout 400 python3 -m flash_dmattn build {} >"$0/build-{}.log" 2>&1 || echo "{} FAILED"' "$W" \
  <"$OUT/specs.txt" >"$OUT/build-failures.log"
for f in "$W"/build-*.log; do tail -2 "$f"; done >"$OUT/build.log"
stamp "built $(wc -l <"$OUT/specs.txt") modules, $(wc -l <"$OUT/build-failures.log") failed"

# The test files as device jobs (tools/gpu_lanes.sh): each starts on the next free GPU and runs
# until the deadline; the slowest files go first.
export DEADLINE MARK K
export SUITE_OUT=$OUT  # the jobs' OUT is the lanes' folder
# One test file until the deadline, its last line into tests-summary.log.
cat >"$W/run-test.sh" <<'RUN'
# $1: FILE or FILE@EXPR (the tests of FILE that -k EXPR selects, and K's if set).
f=${1%%@*}; n=$(basename "$f" .py); sel=""
case "$1" in *@*) sel=$(printf '%s' "${1#*@}" | tr '~' ' ')
  n="$n-$(echo "$sel" | tr -c 'A-Za-z0-9_.\n-' '_')" ;; esac
KSEL=$K
if [ -n "$sel" ]; then KSEL="($sel)"; [ -n "$K" ] && KSEL="($K) and $KSEL"; fi
left=$(( DEADLINE - $(date +%s) ))
if [ "$left" -lt 20 ]; then echo "$1 no time" >>"$SUITE_OUT/tests-summary.log"; exit 0; fi
timeout "$left" python3 -m pytest -q -p no:cacheprovider -rs "$f" ${KSEL:+-k "$KSEL"} -m "$MARK" \
  >"$SUITE_OUT/t-$n.log" 2>&1
rc=$?
[ $rc -eq 124 ] && what="cut by the deadline" || what="rc=$rc"
echo "$1 (GPU $CUDA_VISIBLE_DEVICES) $what: $(tail -n 1 "$SUITE_OUT/t-$n.log")" >>"$SUITE_OUT/tests-summary.log"
RUN
JOBS=$W/test-jobs.txt
for f in $TESTS; do echo "bash $W/run-test.sh $f"; done >"$JOBS"
OUT=$OUT/lanes DEADLINE_S=$(( DEADLINE - $(date +%s) )) bash "$(dirname "$0")/gpu_lanes.sh" "$JOBS" >/dev/null
cat "$OUT/tests-summary.log"
stamp "tests done"

# DENSE_BENCH_S=N: then the dense suite's forward + backward rows (every backend) for N seconds,
# on the modules just built (auto-dispatch takes cuda for mask-free training on Hopper).
if [ -n "${DENSE_BENCH_S:-}" ]; then
  timeout "$DENSE_BENCH_S" python3 -m benchmarks.run --out "$W/dense" --suite dense \
    >"$OUT/dense-bench.log" 2>&1
  grep -E "^== |^   " "$OUT/dense-bench.log" | head -40
  stamp "dense bench done"
fi
finish
