#!/usr/bin/env bash
# Forward variant experiment for the cuda backend (tile shapes, sm80 vs sm90, ...): T2 and T1 with the default tiles and with
# FLASH_DMATTN_CUDA_FLAGS variants, side by side with triton and the baselines; plus the cuda
# tests named by CUDA_K. Run with carry [".wheels"]; logs to $OUT.
source "$(dirname "$0")/device_common.sh"
export FLASH_DMATTN_CACHE_DIR=${FLASH_DMATTN_CACHE_DIR:-$W/cache} MAX_JOBS=16
device_install cutlass
VARIANTS=${VARIANTS:-"default|-DFLASH_DMATTN_NO_SM90=1"}
IFS='|' read -ra VS <<<"$VARIANTS"
for v in "${VS[@]}"; do
  flags=$([ "$v" = default ] && echo "" || echo "$v")
  for spec in d128-bf16 d128-bf16-mask-bias ${EXTRA_SPECS:-}; do
    FLASH_DMATTN_CUDA_FLAGS="$flags" timeout 200 python3 -m flash_dmattn build "$spec" >"$W/b-$spec-${#flags}.log" 2>&1 &
  done
done
wait
tail -n 2 "$W"/b-*.log | grep -E "built|error|Error" >"$OUT/variants-build.log"
if [ -n "${CUDA_K:-}" ]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda_backend.py -k "$CUDA_K" >"$OUT/variants-tests.log" 2>&1
  echo "tests rc=$?" >>"$OUT/variants-tests.log"; tail -4 "$OUT/variants-tests.log"
fi
i=0
for v in "${VS[@]}"; do
  flags=$([ "$v" = default ] && echo "" || echo "$v")
  echo "== variant: $v" | tee -a "$OUT/variants-bench.log"
  FLASH_DMATTN_CUDA_FLAGS="$flags" timeout 90 python3 -m benchmarks.run --out "$W/bench$i" \
    --suite dynamic,dense --backends cuda${BENCH_TRITON:+,triton} --match "top-2048,L16384 D128 causal" \
    >>"$OUT/variants-bench.log" 2>&1
  grep -E "^== |^   " "$OUT/variants-bench.log" | tail -12
  i=$((i+1))
done
exit 0
