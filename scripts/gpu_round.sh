#!/usr/bin/env bash
# One short device call after a kernel change: the GPU tests of the Triton kernels (autotuning
# off, so each specialisation compiles once), then the issue's targets side by side with their
# baselines (T2/T2b with flex, T1/T1b, T3/T3b), then large-Lk and batched decode, then a profile
# of T2 (triton). Each step has its own
# time limit so a slow one cannot starve the rest; logs go to $OUT (at most 8 files back).
#   bash scripts/gpu_round.sh [pytest -k expression]
source "$(dirname "$0")/device_common.sh"
K=${1:-triton or summary}
device_install
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } >"$OUT/env.txt"

FLASH_DMATTN_TRITON_AUTOTUNE=0 timeout "${TEST_S:-170}" python3 -m pytest -q -p no:cacheprovider -x \
  tests/test_mask_summary.py tests/test_gpu.py -k "$K" >"$OUT/tests.log" 2>&1
echo "tests rc=$?" >>"$OUT/tests.log"
tail -3 "$OUT/tests.log"

bench dynamic "${DYN_S:-110}" --suite dynamic --backends triton,flex
# tile lists instead of gathered keys (the default since 2026-11-22 is auto in both kernels)
FLASH_DMATTN_TRITON_GATHER=never bench dynamic-listed "${DYNG_S:-70}" --suite dynamic --backends triton
bench targets "${TGT_S:-150}" --suite dense,block_sparse --backends triton --match "L16384 D128 causal,L32768"
bench decode "${DEC_S:-120}" --suite decode --backends triton --match "Lk131072,Lk524288,B64 "
# where T2's time goes (kernels vs planning), per call
timeout "${PROF_S:-70}" python3 -m benchmarks.profile --suite dynamic --backends triton --out "$W/prof" \
  >"$OUT/profile.log" 2>&1 && cp "$W"/prof/profile-*.txt "$OUT/" 2>/dev/null
exit 0
