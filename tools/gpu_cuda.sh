#!/usr/bin/env bash
# One device call for the cuda backend: install the package and the CUTLASS headers (the
# nvidia-cutlass wheel, carried in .wheels/ because the GPU machine has no network), time the
# first-use build of the T2 specialisation, run the cuda GPU tests, then benchmark cuda next to
# triton and the baselines on T2 and T1 (and T3 with SPARSE_S=seconds, the varlen suite with
# VARLEN_S=seconds, a per-kernel profile with PROBE_S=seconds). Logs go to $OUT.
#   bash tools/gpu_cuda.sh            (run with carry: [".wheels"])
source "$(dirname "$0")/device_common.sh"
export FLASH_DMATTN_CACHE_DIR=${FLASH_DMATTN_CACHE_DIR:-$W/cache}
export MAX_JOBS=16
device_install cutlass
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nvcc --version | tail -2;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)';
  python3 -m flash_dmattn info 2>&1 | grep -E "^cuda|^triton"; } >"$OUT/env.txt" 2>&1

# First-use compile of one specialisation (issue target: <= 90 s on this machine).
/usr/bin/time -f "build wall %e s" timeout "${BUILD_S:-240}" \
  python3 -m flash_dmattn build d128-bf16-mask-bias >"$OUT/build.log" 2>&1
echo "build rc=$?" >>"$OUT/build.log"
# Every other specialisation the cuda tests use, built side by side (16 cores, ~2.5 min).
ALL_SPECS=""
for d in 32 64 96 128 256; do for f in "" -mask -bias -mask-bias; do ALL_SPECS="$ALL_SPECS d$d-bf16$f"; done; done
# Packed-sequence (varlen) modules of the varlen tests and benchmark.
for spec in d32-bf16-mask-bias d64-bf16-mask-bias d64-bf16-bias d128-bf16 d128-bf16-mask-bias \
    d256-bf16-mask-bias; do ALL_SPECS="$ALL_SPECS $spec-varlen"; done
for spec in ${PREBUILD:-$ALL_SPECS d128-fp16-mask-bias}; do
  timeout "${BUILD_S:-300}" python3 -m flash_dmattn build "$spec" >"$W/build-$spec.log" 2>&1 &
done
wait
for f in "$W"/build-*.log; do echo "== $f"; tail -3 "$f"; done >>"$OUT/build.log"
tail -30 "$OUT/build.log"

timeout "${TEST_S:-240}" python3 -m pytest -q -p no:cacheprovider --maxfail=6 -rs tests/test_cuda_backend.py \
  ${CUDA_K:+-k "$CUDA_K"} >"$OUT/tests.log" 2>&1
echo "tests rc=$?" >>"$OUT/tests.log"
tail -15 "$OUT/tests.log"
# The shared GPU equivalence tests (tests/test_gpu.py) with the cuda backend.
timeout "${GPU_TEST_S:-150}" python3 -m pytest -q -p no:cacheprovider --maxfail=6 -rs tests/test_gpu.py \
  -k "${GPU_K:-cuda}" >"$OUT/tests-gpu.log" 2>&1
echo "tests rc=$?" >>"$OUT/tests-gpu.log"
tail -8 "$OUT/tests-gpu.log"

bench dynamic "${DYN_S:-100}" --suite dynamic --backends cuda,triton
bench dense "${DENSE_S:-100}" --suite dense --backends cuda,triton --match "L16384 D128 causal"
[ -n "${SPARSE_S:-}" ] && bench block-sparse "$SPARSE_S" --suite block_sparse --backends cuda,triton --match "L32768"
# Packed sequences (issue 6): 16 random lengths up to 8K, packed vs sequential vs padded.
[ -n "${VARLEN_S:-}" ] && bench varlen "$VARLEN_S" --suite varlen --backends cuda,triton
# Per-kernel GPU times of one T1 forward and forward + backward (where the time goes).
[ -n "${PROBE_S:-}" ] && timeout "$PROBE_S" python3 -m tools.cuda_probe >"$OUT/probe.log" 2>&1
exit 0
