#!/usr/bin/env bash
# One device call: A/B of the cuda backward's fused dQ (FLASH_DMATTN_CUDA_FUSED_DQ=1, dQ added
# inside the dK/dV kernel) against the separate dQ kernel (=0) on T1 and T2, each with a
# per-kernel profile, then the Triton decode rows that changed last (AB_DEC_MATCH; empty skips).
# Logs go to $OUT.   bash scripts/gpu_fused_dq_ab.sh   (run with carry: [".wheels"])
source "$(dirname "$0")/device_common.sh"
export FLASH_DMATTN_CACHE_DIR=${FLASH_DMATTN_CACHE_DIR:-$W/cache}
export MAX_JOBS=16
device_install cutlass
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } >"$OUT/env.txt"
for spec in ${AB_SPECS:-d128-bf16 d128-bf16-mask-bias}; do
  timeout 300 python3 -m flash_dmattn build "$spec" >"$W/build-$spec.log" 2>&1 &
done
wait
for v in 1 0 1 0; do
  FLASH_DMATTN_CUDA_FUSED_DQ=$v bench "fused$v" "${AB_S:-60}" --suite "${AB_SUITE:-dense,dynamic}" \
    --backends cuda --match "L16384 D128 causal,top-2048" | sed "s/^/fused=$v /"
done
if [ "${AB_PROBE:-1}" != 0 ]; then
  FLASH_DMATTN_CUDA_FUSED_DQ=1 timeout 60 python3 scripts/cuda_probe.py >"$OUT/probe-fused1.log" 2>&1
  FLASH_DMATTN_CUDA_FUSED_DQ=0 timeout 60 python3 scripts/cuda_probe.py >"$OUT/probe-fused0.log" 2>&1
  grep -h "fwd+bwd kernel" "$OUT"/probe-fused*.log
fi
AB_DEC_MATCH=${AB_DEC_MATCH-"B1 H32/8 Lq1 Lk131072,B8 "}
[ -n "$AB_DEC_MATCH" ] && bench decode "${DEC_S:-200}" --suite decode --backends triton --match "$AB_DEC_MATCH"
exit 0
