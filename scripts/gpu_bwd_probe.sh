#!/usr/bin/env bash
# Per-kernel times of T1-T3 forward + backward, cuda next to triton (scripts/bwd_probe.py), on
# the device. Builds the cuda specialisations first (run with carry: [".wheels"]).
#   ONLY=T2 BACKENDS=cuda,triton FLAGS="-D..." bash scripts/gpu_bwd_probe.sh
source "$(dirname "$0")/device_common.sh"
export FLASH_DMATTN_CACHE_DIR=${FLASH_DMATTN_CACHE_DIR:-$W/cache}
export FLASH_DMATTN_CUDA_FLAGS=${FLAGS:-}
export MAX_JOBS=16
device_install cutlass
timeout 240 python3 -m flash_dmattn build ${SPECS:-d128-bf16 d128-bf16-mask-bias d128-bf16-mask} \
  >"$OUT/bwd-probe-build.log" 2>&1
echo "build rc=$?" | tee -a "$OUT/bwd-probe-build.log"
timeout "${PROBE_S:-300}" python3 scripts/bwd_probe.py --only "${ONLY:-T1,T2,T3}" \
  --backends "${BACKENDS:-cuda,triton}" 2>&1 | tee "$OUT/bwd-probe.log"
exit 0
