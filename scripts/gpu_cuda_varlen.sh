#!/usr/bin/env bash
# One device call for the cuda backend's packed-sequence (varlen) path: build the varlen
# modules the tests and benchmark use, run the cuda varlen GPU tests, time the varlen suite
# (packed vs sequential vs padded, cuda next to triton and flex), and -- when exp_base/ holds an
# older export (see gpu_ab.sh) -- A/B-time T2 on the cuda backend against it in the same call,
# to show what the change did to dense calls. Logs go to $OUT.
#   [ALL_TESTS=1] [AB_RUNS="base new"] [VARLEN_S=200] bash scripts/gpu_cuda_varlen.sh
#   (run with carry: [".wheels"], or [".wheels", "exp_base"] for the A/B)
source "$(dirname "$0")/device_common.sh"
export FLASH_DMATTN_CACHE_DIR=$W/cache
export MAX_JOBS=16
device_install cutlass
ROOT=$(pwd)
SPECS="d128-bf16-mask-bias d128-bf16 d32-bf16-mask-bias-varlen d64-bf16-mask-bias-varlen
  d64-bf16-bias-varlen d128-bf16-varlen d128-bf16-mask-bias-varlen d256-bf16-mask-bias-varlen"
# ALL_TESTS=1: every cuda GPU test (dense too), so every specialisation those tests use.
if [ -n "${ALL_TESTS:-}" ]; then
  for d in 32 64 96 128 256; do for f in "" -mask -bias -mask-bias; do SPECS="$SPECS d$d-bf16$f"; done; done
  SPECS="$SPECS d128-fp16-mask-bias"
fi
for spec in $SPECS; do
  timeout 300 python3 -m flash_dmattn build "$spec" >"$W/build-$spec.log" 2>&1 &
done
if [ -d exp_base ]; then
  (cd exp_base && timeout 300 python3 -m flash_dmattn build d128-bf16-mask-bias >"$W/build-base.log" 2>&1) &
fi
wait
for f in "$W"/build-*.log; do echo "== $f"; tail -2 "$f"; done >"$OUT/build.log"
grep -c "built in" "$OUT/build.log"

K="varlen and cuda"
[ -n "${ALL_TESTS:-}" ] && K="cuda"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda_backend.py tests/test_gpu.py \
  -k "$K" >"$OUT/tests.log" 2>&1
echo "tests rc=$?" >>"$OUT/tests.log"
tail -4 "$OUT/tests.log"

if [ -d exp_base ]; then
  for name in ${AB_RUNS:-base new base2 new2}; do
    dir=$([ "${name#base}" != "$name" ] && echo exp_base || echo .)
    (cd "$ROOT/$dir" && timeout 100 python3 -m benchmarks.run --out "$W/ab-$name" --suite dynamic \
      --backends cuda,triton) >"$OUT/ab-$name.log" 2>&1
    echo "== $name ($dir)"; grep -E "^   flash|^   sdpa-cudnn" "$OUT/ab-$name.log" | head -4
  done
fi
bench varlen "${VARLEN_S:-200}" --suite varlen --backends cuda,triton
exit 0
