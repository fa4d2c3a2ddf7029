#!/usr/bin/env bash
# One device call for the cuda backend's split-KV decode kernel (KV cache, paged KV): build the
# specialisations its GPU tests use, run the decode tests (or with ALL_TESTS=1 every cuda GPU
# test), then time the decode suite with cuda next to triton and cuDNN. Logs go to $OUT.
#   [ALL_TESTS=1] [DEC_S=300] [DEC_MATCH=...] [TIME_AB=1] bash scripts/gpu_cuda_decode.sh
#   TIME_AB=1: scripts/cuda_decode_time.py with the warp split off, then on (same build).
#   (run with carry: [".wheels"])
# ALL_TESTS builds 26 modules at once: about 360 s on 16 cores on 2026-11-22e, over the 400 s
# per-build limit below on 2026-11-22f (26 x 6 compiles at once on 16 cores). The whole cuda
# suite with its builds now runs in scripts/gpu_cuda_suite.sh (bounded concurrency, the
# modules the tests record: 305 s on 2026-11-22l).
source "$(dirname "$0")/device_common.sh"
export FLASH_DMATTN_CACHE_DIR=$W/cache
export MAX_JOBS=16
device_install cutlass
SPECS="d128-fp16-mask-bias d256-bf16 d256-bf16-mask-bias d96-bf16 d96-bf16-mask-bias"
for d in 64 128; do for f in "" -mask -bias -mask-bias; do SPECS="$SPECS d$d-bf16$f"; done; done
if [ -n "${ALL_TESTS:-}" ]; then
  for d in 32 96 256; do for f in -mask -bias; do SPECS="$SPECS d$d-bf16$f"; done; done
  SPECS="$SPECS d32-bf16 d32-bf16-mask-bias d32-bf16-mask-bias-varlen d64-bf16-mask-bias-varlen
    d64-bf16-bias-varlen d128-bf16-varlen d128-bf16-mask-bias-varlen d256-bf16-mask-bias-varlen"
fi
start=$(date +%s)
for spec in $SPECS; do
  timeout 400 python3 -m flash_dmattn build "$spec" >"$W/build-$spec.log" 2>&1 &
done
wait
for f in "$W"/build-*.log; do echo "== $f"; tail -3 "$f"; done >"$OUT/build.log"
echo "built $(grep -c 'built in' "$OUT/build.log") modules in $(( $(date +%s) - start )) s"
grep -B2 -A20 "error" "$OUT/build.log" | head -60

K="decode"
[ -n "${ALL_TESTS:-}" ] && K="cuda"
timeout "${TEST_S:-240}" python3 -m pytest -q -p no:cacheprovider -rs -x tests/test_cuda_backend.py \
  tests/test_gpu.py -k "$K" >"$OUT/tests.log" 2>&1
echo "tests rc=$?" >>"$OUT/tests.log"
tail -30 "$OUT/tests.log" | grep -E "passed|failed|Error|error|assert|rc=" | head -20

if [ -n "${TIME_AB:-}" ]; then
  FLASH_DMATTN_CUDA_DECODE_WARP_SPLIT=0 timeout 150 python3 scripts/cuda_decode_time.py \
    >"$OUT/time-warp-split-off.log" 2>&1
  timeout 150 python3 scripts/cuda_decode_time.py >"$OUT/time-warp-split-on.log" 2>&1
  paste -d'\n' "$OUT/time-warp-split-off.log" "$OUT/time-warp-split-on.log" | tail -30
fi
[ "${DEC_S:-300}" -gt 0 ] && bench decode "${DEC_S:-300}" --suite decode --backends cuda,triton \
  ${DEC_MATCH:+--match "$DEC_MATCH"}
exit 0
