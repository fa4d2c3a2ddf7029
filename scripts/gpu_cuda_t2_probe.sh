#!/usr/bin/env bash
# Per-kernel GPU times of one T2 forward, cuda next to triton, for each FLASH_DMATTN_CUDA_FLAGS
# variant in VARIANTS ('|'-separated, "default" = none). Run with carry [".wheels"].
source "$(dirname "$0")/device_common.sh"
export FLASH_DMATTN_CACHE_DIR=$W/cache MAX_JOBS=8
device_install cutlass
IFS='|' read -ra VS <<<"${VARIANTS:-default}"
flags_of() { [ "$1" = default ] && echo "" || echo "$1"; }
for v in "${VS[@]}"; do
  FLASH_DMATTN_CUDA_FLAGS="$(flags_of "$v")" timeout 300 python3 -m flash_dmattn build \
    ${SPECS:-d128-bf16-mask-bias} >/dev/null 2>&1 &
done
wait
for v in "${VS[@]}"; do
  echo "== variant $v" >>"$OUT/t2-probe.log"
  FLASH_DMATTN_CUDA_FLAGS="$(flags_of "$v")" timeout 120 python3 scripts/cuda_probe.py --t2-only \
    >>"$OUT/t2-probe.log" 2>&1
done
grep -E "^== |T2 " "$OUT/t2-probe.log"
exit 0
