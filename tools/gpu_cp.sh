#!/usr/bin/env bash
# One device call for context-parallel attention (issue 37) on a machine with 2-4 GPUs: the
# GPUs, the gloo tests, the NCCL tests (the example under torchrun on 2 and 4 GPUs, both
# layouts, equal and uneven shards, checked against one process; its output is in
# tests-gpu.log), the example at a longer sequence, optionally the DMA profile (PROFILE_S), then
# the cp benchmark suite with whatever time is left. Logs go to $OUT; phases are timed in $OUT/times.log.
#   bash tools/gpu_cp.sh
# Knobs (environment):
#   TOTAL_S    the whole call's budget in seconds (default 540); the benchmark gets what is left
#   GLOO_S / TEST_S / EXAMPLE_S   per-step limits (0 skips the step)
#   EXAMPLE_GPUS / EXAMPLE_LEN   the longer example runs: on these GPU counts (default "4"),
#              EXAMPLE_LEN tokens per GPU (default 32768)
#   PROFILE_S  the DMA profile's limit (default 0: skipped): tools/cp_profile.py under torchrun
#              on PROFILE_GPUS GPUs (default: all), PROFILE_LEN tokens per GPU (default 262144,
#              the 1M row on 4), PROFILE_ARGS extra arguments (e.g. "--trace $OUT/traces");
#              log in $OUT/profile.log
#   BENCH_S    the benchmark's limit (default: the rest of TOTAL_S; 0 skips it)
#   BENCH_MATCH   benchmarks.run --match (default "dense causal,DMA": the issue's target rows,
#              not the 128K mask + bias one; "" runs every workload)
#   FLASH_DMATTN_CP_VARIANTS   default "1,4:zigzag" (what the targets compare; "" runs every
#              variant: + 2 GPUs and 4 GPUs contiguous, ~2 min more)
#   BENCH_ARGS extra arguments of benchmarks.run
#   FLASH_DMATTN_CP_REPEATS="W,R" / FLASH_DMATTN_CP_LAUNCH_S   see benchmarks/cp.py
#   CUDA=1     the cuda backend as the local kernel (installs the CUTLASS wheel: run with carry
#              [".wheels"]; builds the specialisations the benchmark uses first, ~2 min);
#              default: triton
source "$(dirname "$0")/device_common.sh"
export FLASH_DMATTN_CACHE_DIR=${FLASH_DMATTN_CACHE_DIR:-$W/cache}
T0=$(date +%s)
TOTAL_S=${TOTAL_S:-540}
stamp() { echo "$1 at $(( $(date +%s) - T0 )) s" | tee -a "$OUT/times.log"; }
left() { echo $(( TOTAL_S - ($(date +%s) - T0) )); }
# min(the step's own limit, what is left of TOTAL_S minus a reserve for the steps after it)
# (at least 1: `timeout 0` would mean no limit)
limit() {
  local own=$1 reserve=$2 rest; rest=$(( $(left) - reserve ))
  rest=$(( own < rest ? own : rest )); echo $(( rest > 1 ? rest : 1 ))
}

if [ "${CUDA:-0}" = 1 ]; then
  device_install cutlass
  BACKEND=cuda
  for spec in d128-bf16 d128-bf16-mask-bias d128-bf16-mask; do
    timeout "${BUILD_S:-240}" python3 -m flash_dmattn build "$spec" >"$W/build-$spec.log" 2>&1 &
  done
  wait
  for f in "$W"/build-*.log; do echo "== $f"; tail -2 "$f"; done >"$OUT/build.log"
  grep -B1 -iE "error|fail" "$OUT/build.log" | head -20
else
  device_install
  BACKEND=triton
  export FLASH_DMATTN_DISABLE=${FLASH_DMATTN_DISABLE:-cuda}  # no kernel builds mid-run
fi
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader;
  echo "gpus: $(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)";
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "triton", triton.__version__, "devices", torch.cuda.device_count())';
  nvidia-smi topo -m 2>/dev/null | head -8; } >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
stamp "installed (local kernel: $BACKEND)"

# 1. gloo (CPU) tests, without the CPU torchrun ones (the GPU steps below launch torchrun).
if [ "${GLOO_S:-60}" -gt 0 ]; then
  timeout "$(limit "${GLOO_S:-60}" 420)" python3 -m pytest -q -p no:cacheprovider -m "not gpu" \
    -k "not torchrun and not benchmark" tests/test_context_parallel.py >"$OUT/tests-gloo.log" 2>&1
  echo "gloo tests rc=$?" >>"$OUT/tests-gloo.log"
  tail -3 "$OUT/tests-gloo.log"
  stamp "gloo tests"
fi

# 2. NCCL tests: the example on 2 and 4 GPUs, both layouts, shards checked against one process.
if [ "${TEST_S:-180}" -gt 0 ]; then
  timeout "$(limit "${TEST_S:-180}" 280)" python3 -m pytest -q -p no:cacheprovider -rsP -m gpu \
    tests/test_context_parallel.py >"$OUT/tests-gpu.log" 2>&1
  echo "gpu tests rc=$?" >>"$OUT/tests-gpu.log"
  grep -E "passed|failed|error|SKIP|rc=" "$OUT/tests-gpu.log" | tail -8
  stamp "gpu tests"
fi

# 3. The example as a user runs it, longer sequences (timing and bytes per rank, no check).
if [ "${EXAMPLE_S:-45}" -gt 0 ]; then
  for p in ${EXAMPLE_GPUS:-4}; do
    [ "$NGPU" -lt "$p" ] && { echo "example on $p GPUs: only $NGPU GPUs"; continue; }
    len=$(( ${EXAMPLE_LEN:-32768} * p ))
    timeout "$(limit "${EXAMPLE_S:-45}" 250)" torchrun --standalone --nproc-per-node "$p" \
      examples/context_parallel.py --seq-len "$len" --window 2048 --heads 16 --kv-heads 4 \
      --head-dim 128 --backend "$BACKEND" --no-check >"$OUT/example-$p.log" 2>&1
    echo "example on $p GPUs rc=$?" >>"$OUT/example-$p.log"
    grep -E "^rank|^  |rc=|Error" "$OUT/example-$p.log" | head -20
  done
  stamp "examples"
fi

# 3b. The DMA profile: one fwd+bwd under torch.profiler (top CUDA / CPU ops, host waits, kernel
#     launches), then one rank against the plain call at the per-GPU length (tools/cp_profile.py).
if [ "${PROFILE_S:-0}" -gt 0 ]; then
  # shellcheck disable=SC2086
  timeout "$(limit "$PROFILE_S" 20)" torchrun --standalone --nproc-per-node "${PROFILE_GPUS:-$NGPU}" \
    tools/cp_profile.py --per-gpu "${PROFILE_LEN:-262144}" --backend "$BACKEND" ${PROFILE_ARGS:-} \
    >"$OUT/profile.log" 2>&1
  echo "profile rc=$?" >>"$OUT/profile.log"
  grep -E "^== |host synchronisations|^trace|selected.py|^-- device timeline|^  rank [0-9]|rc=|Error" \
    "$OUT/profile.log" | head -32
  stamp "profile"
fi

# 4. The cp suite: 1, 2 and 4 GPUs (one torchrun a variant), with the time that is left.
BENCH_LIMIT=${BENCH_S:-$(( $(left) - 10 ))}
BENCH_MATCH=${BENCH_MATCH-dense causal,DMA}
export FLASH_DMATTN_CP_VARIANTS=${FLASH_DMATTN_CP_VARIANTS-1,4:zigzag}
if [ "$BENCH_LIMIT" -gt 0 ]; then
  # launches end 15 s before the limit, so that the report (markdown, JSON) is still written
  export FLASH_DMATTN_CP_DEADLINE=$(( $(date +%s) + BENCH_LIMIT - 15 ))
  # shellcheck disable=SC2086
  bench cp "$BENCH_LIMIT" --suite cp --backends "$BACKEND" ${BENCH_MATCH:+--match "$BENCH_MATCH"} \
    ${BENCH_ARGS:-}
  echo "bench limit $BENCH_LIMIT s" | tee -a "$OUT/bench-cp.log"
  [ -d "$W/bench-cp" ] && cp "$W"/bench-cp/*/*.md "$W"/bench-cp/*/*.json "$OUT/" 2>/dev/null
  grep -A6 "^| target" "$OUT"/*cp*.md 2>/dev/null | head -8
  stamp "benchmark"
fi
exit 0
