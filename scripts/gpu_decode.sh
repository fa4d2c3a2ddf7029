#!/usr/bin/env bash
# One device call for issue 6 (packed sequences and decoding) on the Triton backend: the GPU
# tests of decode, paged KV and varlen, then the full decode benchmark (B 1/8/64, Lk 4K-512K,
# with and without a per-key mask + bias, part-filled caches) and the varlen benchmark
# (packed vs one-by-one vs padded, without and with a per-key mask + bias). Logs go to $OUT.
#   bash scripts/gpu_decode.sh   (TEST_S / DEC_S / VARLEN_S: per-step time limits, 0 skips;
#                                 DEC_MATCH: --match for the decode suite)
source "$(dirname "$0")/device_common.sh"
device_install
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } >"$OUT/env.txt"

if [ "${TEST_S:-150}" -gt 0 ]; then
  timeout "${TEST_S:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_decode.py tests/test_paged.py tests/test_gpu.py -k "decode or paged or varlen" \
    >"$OUT/tests.log" 2>&1
  echo "tests rc=$?" >>"$OUT/tests.log"
  tail -3 "$OUT/tests.log"
fi

timeout 90 python3 scripts/decode_overhead.py 32768 >"$OUT/overhead.log" 2>&1
grep "us/call" "$OUT/overhead.log"
bench decode "${DEC_S:-300}" --suite decode --backends triton ${DEC_MATCH:+--match "$DEC_MATCH"}
[ "${VARLEN_S:-150}" -gt 0 ] && bench varlen "${VARLEN_S:-150}" --suite varlen --backends triton
[ -d "$W/bench-decode" ] && cp "$W"/bench-decode/*.md "$OUT/" 2>/dev/null
exit 0
