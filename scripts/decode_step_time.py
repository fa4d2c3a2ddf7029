"""Triton decode steps beside cuDNN dense SDPA on the benchmark's decode rows (GPU only): CUDA-
graph replays in shuffled, interleaved rounds.

    python3 scripts/decode_step_time.py [--rounds 7] [--splits-x 0.5,2]

Each variant is captured once as a CUDA graph; rounds replay every variant once in a shuffled
order (``triton.testing.do_bench`` per replay, L2 flushed), and the median over rounds is
reported with the ratio of cuDNN (K/V sliced to the used length) to the default step. A few
microseconds separate variants at 4K keys, so a fixed order would let clock drift decide.
``--splits-x``: also time the step at these multiples of the default split count. To compare
two trees, run it from each in turn (``scripts/gpu_ab.sh`` style).

History: ``decode-2026-11-22l-fused-combine-ab.log`` compared a combine done by the split
kernel's last program (slower: one program merged a whole group), ``decode-2026-11-22l-pdl-
ab.log`` the combine kernel launched as a programmatic dependent of the split kernel (no gain);
neither was kept.
"""
import argparse
import random
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.timing import capture_graph as capture  # noqa: E402
from benchmarks.workloads import build_case, decode_workload  # noqa: E402
from flash_dmattn.backends.triton import decode as td  # noqa: E402
from scripts.decode_variants import cudnn_graph, round_medians  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--splits-x", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = ((1, 4096, None, False), (1, 4096, None, True), (1, 4096, 0.5, True),
            (8, 4096, None, True), (1, 8192, None, True), (2, 4096, None, True),
            (1, 16384, None, True), (1, 32768, None, False), (1, 32768, None, True),
            (1, 32768, 0.5, True), (1, 131072, None, True), (1, 524288, None, True),
            (8, 32768, None, True), (8, 131072, 0.5, True), (64, 32768, None, True))
    mults = [float(x) for x in args.splits_x.split(",") if x]
    print(torch.cuda.get_device_name(), f"ms per step (graph replay), median of {args.rounds} "
          "shuffled rounds", flush=True)
    rng = random.Random(0)
    for B, L, fill, masked in rows:
        w = decode_workload(B, L, masked, fill)
        c = build_case(w, dev, torch.bfloat16)
        scale = 128 ** -0.5
        n0 = td.choose_num_splits(B, 8, L, dev)
        graphs, outs = {}, {}
        variants = [("default", None)] + [(f"x{m:g}", m) for m in mults]
        for name, mult in variants:
            n = None if mult is None else max(1, int(n0 * mult))
            graphs[name], outs[name] = capture(
                lambda n=n: td.decode_forward(c.q, c.k, c.v, c.mask, c.bias, scale, False, 0.0,
                                              c.cache_seqlens, n)[0])
        graphs["cudnn"] = cudnn_graph(c, w.used_k)
        med = round_medians(graphs, args.rounds, rng, dev)
        label = f"B{B} Lk{L}" + (" mask+bias" if masked else "") + (f" cache{fill}" if fill else "")
        print(f"{label:30s} splits {n0:3d} " + "  ".join(f"{k} {v:.4f}" for k, v in med.items())
              + f"  cudnn/default {med['cudnn'] / med['default']:.3f}", flush=True)
        del graphs


if __name__ == "__main__":
    main()
