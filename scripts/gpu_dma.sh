#!/usr/bin/env bash
# One device call for Dynamic Mask Attention on long sequences (key-interval masks): the GPU
# tests of the selection, the interval kernels and the KeyIntervals API, a quick probe of the
# key rows, then the dma_long benchmark suite. Logs go to $OUT.
#   bash scripts/gpu_dma.sh   (TEST_S / PROBE_S / BENCH_S: per-step time limits, 0 skips;
#                              PROBE_ARGS: arguments of scripts/dma_probe.py)
source "$(dirname "$0")/device_common.sh"
device_install
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } >"$OUT/env.txt"
cat "$OUT/env.txt"
if [ "${TEST_S:-240}" -gt 0 ]; then
  timeout "${TEST_S:-240}" python3 -m pytest -q -p no:cacheprovider -x \
    $(ls tests/test_triton_intervals.py tests/test_topk_intervals.py tests/test_key_intervals.py 2>/dev/null) \
    >"$OUT/tests.log" 2>&1
  echo "tests rc=$?" >>"$OUT/tests.log"
  tail -4 "$OUT/tests.log"
fi
if [ "${PROBE_S:-300}" -gt 0 ]; then
  timeout "${PROBE_S:-300}" python3 scripts/dma_probe.py ${PROBE_ARGS:-16384 32768} >"$OUT/probe.log" 2>&1
  echo "probe rc=$?" >>"$OUT/probe.log"
  cat "$OUT/probe.log" | head -80
fi
[ "${BENCH_S:-0}" -gt 0 ] && bench dma "${BENCH_S}" --suite dma_long --backends triton
[ -d "$W/bench-dma" ] && cp "$W"/bench-dma/*.md "$W"/bench-dma/*.json "$OUT/" 2>/dev/null
exit 0
