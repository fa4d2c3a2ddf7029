#!/usr/bin/env bash
# cuda forward A/B in one device call: builds SPECS for the first FLASH_DMATTN_CUDA_FLAGS
# variant and AB_SPECS (the benchmarked modules) for the others (VARIANTS, '|'-separated;
# "default" = no flags) side by side, runs the cuda tests whose ids match TEST_GREP against the
# first variant (a kernel hang ends at TEST_S), then times the SUITES workloads matching MATCH
# for every variant, twice, next to triton and cuDNN (PROBE=1: then per-kernel times of T1 and
# T2). Run with carry [".wheels"]; logs to $OUT.
source "$(dirname "$0")/device_common.sh"
export FLASH_DMATTN_CACHE_DIR=${FLASH_DMATTN_CACHE_DIR:-$W/cache} MAX_JOBS=${MAX_JOBS:-8}
device_install cutlass
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$OUT/env.txt" 2>&1
VARIANTS=${VARIANTS:-default}
AB_SPECS=${AB_SPECS:-"d128-bf16 d128-bf16-mask-bias"}
SPECS=${SPECS:-$AB_SPECS}
IFS='|' read -ra VS <<<"$VARIANTS"
flags_of() { [ "$1" = default ] && echo "" || echo "$1"; }
T0=$(date +%s)
first=1
for v in "${VS[@]}"; do
  specs=$AB_SPECS; [ $first = 1 ] && specs=$SPECS; first=0
  for spec in $specs; do
    FLASH_DMATTN_CUDA_FLAGS="$(flags_of "$v")" timeout 300 python3 -m flash_dmattn build "$spec" \
      >"$W/b-$spec-$(echo "$v" | md5sum | cut -c1-6).log" 2>&1 &
  done
done
wait
tail -qn 1 "$W"/b-*.log >"$OUT/ab-build.log"
echo "built in $(( $(date +%s) - T0 )) s" | tee -a "$OUT/ab-build.log"
python3 -m pytest --collect-only -q tests/test_cuda_backend.py 2>/dev/null |
  grep -E "${TEST_GREP:-lq<lk|poisoned|neg_inf|scale_of_any}" >"$W/ids.txt"
echo "== variant: ${VS[0]} ($(wc -l <"$W/ids.txt") tests)" >>"$OUT/ab-tests.log"
FLASH_DMATTN_CUDA_FLAGS="$(flags_of "${VS[0]}")" timeout "${TEST_S:-150}" python3 -m pytest -q \
  -p no:cacheprovider -x $(cat "$W/ids.txt") >>"$OUT/ab-tests.log" 2>&1
echo "tests rc=$?" >>"$OUT/ab-tests.log"
grep -E "== variant|passed|failed|rc=|Error" "$OUT/ab-tests.log" | tail -12
MATCH=${MATCH:-"top-2048,L16384 D128 causal"}
SUITES=${SUITES:-dynamic,dense}
for round in 1 2; do
  i=0
  for v in "${VS[@]}"; do
    echo "== round $round variant: $v" >>"$OUT/ab-bench.log"
    backends=cuda; [ "$i" = 0 ] && backends=cuda,triton
    FLASH_DMATTN_CUDA_FLAGS="$(flags_of "$v")" timeout "${BENCH_S:-120}" python3 -m benchmarks.run \
      --out "$W/bench-$round-$i" --suite "$SUITES" --backends "$backends" --match "$MATCH" \
      >>"$OUT/ab-bench.log" 2>&1
    i=$((i+1))
  done
done
grep -E "^== |^   " "$OUT/ab-bench.log" | head -60
# PROBE=1: per-kernel GPU times of T1 / T2 (scripts/cuda_probe.py $PROBE_ARGS), every variant.
if [ -n "${PROBE:-}" ]; then
  for v in "${VS[@]}"; do
    echo "== variant $v" >>"$OUT/ab-probe.log"
    FLASH_DMATTN_CUDA_FLAGS="$(flags_of "$v")" timeout 150 python3 scripts/cuda_probe.py \
      ${PROBE_ARGS:-} >>"$OUT/ab-probe.log" 2>&1
  done
  grep -E "T1 |T2 " "$OUT/ab-probe.log" | head -30
fi
exit 0
