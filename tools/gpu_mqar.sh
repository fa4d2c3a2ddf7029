#!/usr/bin/env bash
# One device call for the model-level demos: the MQAR window sweep of examples/mqar.py (issue 5)
# and the varlen benchmark (issue 6: packed vs one-by-one vs padded, triton and baselines).
# Results (mqar.json / .md / .png) and logs go to $OUT.
#   bash tools/gpu_mqar.sh
source "$(dirname "$0")/device_common.sh"
device_install
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } >"$OUT/env.txt"

[ -n "${VARLEN_S:-}" ] && bench varlen "$VARLEN_S" --suite varlen --backends triton

# MQAR_ARGS: the common arguments; MQAR_WINDOWS: '|'-separated window lists, one command each
# (later ones --merge into the same mqar.json), so a time limit still leaves the earlier parts.
IFS='|' read -ra PARTS <<<"${MQAR_WINDOWS:-dense,full|256,64,16}"
merge=""
end=$((SECONDS + ${MQAR_S:-420}))
for part in "${PARTS[@]}"; do
  left=$((end - SECONDS)); [ "$left" -le 10 ] && break
  timeout "$left" python3 -m examples.mqar --device cuda --no-progress --out "$OUT/mqar" $merge \
    ${MQAR_ARGS:?set MQAR_ARGS to the sweep arguments} --windows "$part" >>"$OUT/mqar.log" 2>&1
  echo "mqar windows $part rc=$?" >>"$OUT/mqar.log"
  merge="--merge"
done
tail -25 "$OUT/mqar.log"; cat "$OUT/mqar/mqar.md" 2>/dev/null
exit 0
