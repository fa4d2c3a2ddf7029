#!/usr/bin/env bash
# Quick device check of the cuda forward: build d128-bf16 for each variant of
# FLASH_DMATTN_CUDA_FLAGS (in parallel), count the wgmma (HGMMA) instructions in each module and
# run scripts/cuda_probe.py (kernel names, T1 forward vs cuDNN). Run with carry: [".wheels"].
source "$(dirname "$0")/device_common.sh"
export MAX_JOBS=16
device_install cutlass
VARIANTS=${VARIANTS:-"default|-DFLASH_DMATTN_NO_SM90=1"}
IFS='|' read -ra VS <<<"$VARIANTS"
i=0
for v in "${VS[@]}"; do
  f=$v; [ "$v" = default ] && f=""
  (FLASH_DMATTN_CACHE_DIR="$W/cache$i" FLASH_DMATTN_CUDA_FLAGS="$f" \
     python3 -m flash_dmattn build ${SPECS:-d128-bf16} >"$W/build$i.log" 2>&1
   echo "variant '$v' build rc=$?"; tail -2 "$W/build$i.log") &
  i=$((i + 1))
done
wait
OBJ=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
i=0
for v in "${VS[@]}"; do
  f=$v; [ "$v" = default ] && f=""
  for so in $(find "$W/cache$i" -name "*.so"); do
    echo "variant '$v' $(basename $(dirname $so)): HGMMA $($OBJ -sass $so | grep -c HGMMA), HMMA $($OBJ -sass $so | grep -c HMMA)"
  done
  FLASH_DMATTN_CACHE_DIR="$W/cache$i" FLASH_DMATTN_CUDA_FLAGS="$f" timeout 120 python3 scripts/cuda_probe.py 2>&1 | tail -20
  i=$((i + 1))
done | tee "$OUT/probe.log"
