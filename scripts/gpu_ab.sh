#!/usr/bin/env bash
# A/B timing of two versions of the package in one device call, so both sides meet the same
# GPU, clocks and baselines. The base version is an untracked export of an older commit in
# exp_base/ (made locally, carried with the working tree):
#   rm -rf exp_base && mkdir exp_base && git archive REV | tar -x -C exp_base
# Each variant runs `python -m benchmarks.run ARGS` from its own tree (the tree's own
# flash_dmattn and benchmarks packages come first on sys.path); VARIANTS is a list of
# NAME:DIR[:ENV=VALUE...] entries, run in that order (a variant may repeat to see the noise).
#   VARIANTS="base:exp_base new:." bash scripts/gpu_ab.sh --suite dynamic --backends triton
source "$(dirname "$0")/device_common.sh"
device_install
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } >"$OUT/env.txt"
ROOT=$(pwd)
for spec in ${VARIANTS:-base:exp_base new:.}; do
  IFS=: read -r name dir envs <<<"$spec"
  log="$OUT/ab-$name.log"
  (cd "$ROOT/$dir" &&
   python3 -c 'import flash_dmattn, sys; print("package:", flash_dmattn.__file__)' &&
   env ${envs//:/ } timeout "${AB_S:-200}" python3 -m benchmarks.run --out "$W/ab-$name" "$@") >"$log" 2>&1
  echo "== $name ($dir ${envs}) rc=$?"
  grep -E "^package|^== |^   " "$log" | head -40
done
exit 0
