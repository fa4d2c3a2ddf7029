#!/usr/bin/env bash
# Where T2's time goes (scripts/t2_probe.py) on the device, plus an Nsight Compute read of the
# Triton T2 forward kernel (NCU=0 skips it). With cuda in BACKENDS, builds its T2
# specialisation first (run with carry: [".wheels"]).
source "$(dirname "$0")/device_common.sh"
export FLASH_DMATTN_CACHE_DIR=${FLASH_DMATTN_CACHE_DIR:-$W/cache}
export MAX_JOBS=16
BACKENDS=${BACKENDS:-triton,cuda}
device_install cutlass
case "$BACKENDS" in *cuda*)
  timeout 240 python3 -m flash_dmattn build d128-bf16-mask-bias >"$OUT/build.log" 2>&1
  echo "build rc=$?" >>"$OUT/build.log";;
esac
timeout "${PROBE_S:-200}" python3 scripts/t2_probe.py --backends "$BACKENDS" 2>&1 | tee "$OUT/t2-probe.log"
[ "${NCU:-1}" = 1 ] && ncu_ranges scripts/t2_probe.py t2 t2g
exit 0
