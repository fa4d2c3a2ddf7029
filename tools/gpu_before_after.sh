#!/usr/bin/env bash
# The same benchmark rows of two trees in one device call, on the same GPU: this checkout
# ("after") and an older commit ("before", carried as a tarball), for a claim such as "a
# restructuring left T1-T3 and decode within 2 %". Each tree runs its own harness
# (`python -m benchmarks.run`) against its own library (PYTHONPATH) and kernel cache; both
# trees' cuda kernels build first, side by side; the rows then run in alternating rounds
# (before, after, before, after, ...) so that drift of the GPU's clocks hits both alike.
#   git archive <commit> -o .wheels/before.tar        (here, before the device call)
#   bash tools/gpu_before_after.sh                    (device; carry [".wheels"])
# Knobs (environment):
#   SUITES    benchmarks.run --suite (default "dense,dynamic,block_sparse,decode": T1 is the
#             dense L16384 D128 causal row, T2 the dynamic suite, T3 the block-sparse one)
#   MATCH     benchmarks.run --match (default: T1 = "dense B1 H16 L16384 D128 causal", the
#             dynamic (T2) and block-sparse (T3) rows and the decode rows at 32K keys, which
#             fit two rounds of both trees in one call; "" runs every row of the suites)
#   BACKENDS  benchmarks.run --backends (default "cuda,triton")
#   SKIP      benchmarks.run --skip (default "flex-direct,materialised": baselines that are
#             slow to compile or run and that a before/after comparison does not need)
#   SPECS     cuda specialisations to build first (default: what those rows use)
#   ROUNDS    alternating rounds (default 2); TOTAL_S the call's budget (default 560)
#   PROBE     a command to run in each tree instead of benchmarks.run (e.g. "python3
#             tools/dropout_probe.py --backends cuda"; SUITES, MATCH, BACKENDS and SKIP then
#             do nothing)
# Logs: $OUT/build-<tree>.log, $OUT/bench-<tree>-<round>.log, packed into $OUT/logs.tgz.
source "$(dirname "$0")/device_common.sh"
T0=$(date +%s)
TOTAL_S=${TOTAL_S:-560}
left() { echo $(( TOTAL_S - ($(date +%s) - T0) )); }
[ -f .wheels/before.tar ] || { echo "no .wheels/before.tar (git archive <commit> -o .wheels/before.tar)"; exit 1; }
device_install cutlass
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
SUITES=${SUITES:-dense,dynamic,block_sparse,decode}
MATCH=${MATCH-"dense B1 H16 L16384 D128 causal,dynamic,block_sparse,Lk32768 D128"}
BACKENDS=${BACKENDS:-cuda,triton}
SPECS=${SPECS:-"d128-bf16 d128-bf16-mask d128-bf16-mask-bias d64-bf16"}
ROUNDS=${ROUNDS:-2}
AFTER=$PWD
BEFORE=/tmp/before-tree
rm -rf "$BEFORE" && mkdir -p "$BEFORE" && tar -xf .wheels/before.tar -C "$BEFORE"
HALF=$(( $(nproc) / 2 > 1 ? $(nproc) / 2 : 1 ))

for tree in before after; do
  dir=$AFTER; [ $tree = before ] && dir=$BEFORE
  (cd "$dir" && FLASH_DMATTN_CACHE_DIR=/tmp/cache-$tree PYTHONPATH=$dir MAX_JOBS=$HALF \
    timeout "$(( $(left) - 120 ))" python3 -m flash_dmattn build $SPECS >"$OUT/build-$tree.log" 2>&1;
   echo "build $tree rc=$?" >>"$OUT/build-$tree.log") &
done
wait
tail -n 1 "$OUT"/build-*.log
echo "builds done at $(( $(date +%s) - T0 )) s" | tee -a "$OUT/times.log"

for round in $(seq 1 "$ROUNDS"); do
  for tree in before after; do
    dir=$AFTER; [ $tree = before ] && dir=$BEFORE
    runs_left=$(( 2 * (ROUNDS - round) + 1 )); [ $tree = before ] && runs_left=$(( runs_left + 1 ))
    budget=$(( $(left) / runs_left ))
    [ "$budget" -lt 20 ] && { echo "no time for $tree round $round" | tee -a "$OUT/times.log"; continue; }
    if [ -n "${PROBE:-}" ]; then
      cmd=(bash -c "$PROBE")
    else
      cmd=(python3 -m benchmarks.run --suite "$SUITES" --backends "$BACKENDS"
           ${MATCH:+--match "$MATCH"} --skip "${SKIP-flex-direct,materialised}"
           --out "$W/bench-$tree-$round")
    fi
    (cd "$dir" && FLASH_DMATTN_CACHE_DIR=/tmp/cache-$tree PYTHONPATH=$dir timeout "$budget" \
      "${cmd[@]}" >"$OUT/bench-$tree-$round.log" 2>&1)
    echo "$tree round $round rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$OUT/times.log"
  done
done
(cd "$OUT" && tar czf logs.tgz --remove-files $(ls | grep -v '^logs.tgz$'))
exit 0
