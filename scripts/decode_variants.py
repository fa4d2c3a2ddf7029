"""Triton decode launch variants side by side with cuDNN dense SDPA (GPU only): CUDA-graph
replays in shuffled, interleaved rounds, plus a per-kernel breakdown of chosen rows.

    python3 scripts/decode_variants.py [--rounds 5] [--variants base,cols4,...] [--rows ...]
                                       [--profile]

A variant is a set of overrides of :mod:`flash_dmattn.backends.triton.decode` (module
constants such as ``COMBINE_COLUMN_BLOCKS``), a split count (``per_sm`` programs per SM for
:func:`choose_num_splits`) and a split-kernel ``decode_config``. Each is captured once per row
as a graph; each round replays every graph once in a shuffled order (``time_ms``: median of
``do_bench``, L2 flushed). ``--profile``: device time per kernel (torch.profiler over 20
replays) of the base step and cuDNN, to see the split kernel, the combine and the gap apart.
"""
import argparse
import random
import statistics
import sys
from contextlib import contextmanager

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from benchmarks.impls import shuffled_page_pools  # noqa: E402
from benchmarks.timing import capture_graph as capture, time_ms  # noqa: E402
from benchmarks.workloads import build_case, decode_workload  # noqa: E402
from flash_dmattn.backends.triton import decode as td  # noqa: E402

# name -> (module overrides, per_sm or None, split-kernel (BLOCK_N, num_warps, num_stages) or None)
VARIANTS = {
    "base": ({}, None, None),
    # The launch before 2026-11-23d: one 4-warp combine program per row, two stages always.
    "old": ({"COMBINE_COLUMN_BLOCKS": 1, "use_deep_pipeline": lambda *a: False}, None, None),
    "nodeep": ({"use_deep_pipeline": lambda *a: False}, None, None),
    "deep": ({"use_deep_pipeline": lambda *a: True}, None, None),
    "keyids": ({"PAGE_ID_PER_TILE": False}, None, None),
    "c64": ({"COMBINE_MAX_ELEMS": 8192}, None, None),
    "c64w8": ({"COMBINE_MAX_ELEMS": 8192, "COMBINE_WARPS": 8}, None, None),
    "cols2": ({"COMBINE_COLUMN_BLOCKS": 2}, None, None),
    "cols4": ({"COMBINE_COLUMN_BLOCKS": 4}, None, None),
    "cols4w2": ({"COMBINE_COLUMN_BLOCKS": 4, "COMBINE_WARPS": 2}, None, None),
    "cols8w1": ({"COMBINE_COLUMN_BLOCKS": 8, "COMBINE_WARPS": 1}, None, None),
    "cols8w2": ({"COMBINE_COLUMN_BLOCKS": 8, "COMBINE_WARPS": 2}, None, None),
    "cols4w1": ({"COMBINE_COLUMN_BLOCKS": 4, "COMBINE_WARPS": 1}, None, None),
    "cols2w1": ({"COMBINE_COLUMN_BLOCKS": 2, "COMBINE_WARPS": 1}, None, None),
    "cols8w1-sm2s3": ({"COMBINE_COLUMN_BLOCKS": 8, "COMBINE_WARPS": 1}, 2, (64, 4, 3)),
    "sm2s3": ({"COMBINE_COLUMN_BLOCKS": 4}, 2, (64, 4, 3)),
    "sm2s4": ({"COMBINE_COLUMN_BLOCKS": 4}, 2, (64, 4, 4)),
    "sm2n128": ({"COMBINE_COLUMN_BLOCKS": 4}, 2, (128, 4, 2)),
    "sm3s2": ({"COMBINE_COLUMN_BLOCKS": 4}, 3, (64, 4, 2)),
}
# (B, Lk, cache fill, mask + bias[, page size]): with a page size, K/V are read from shuffled
# page pools through a block table (like the benchmark's paged rows).
ROWS = {
    "p-b1-512k": (1, 524288, None, False, 64), "p-b1-512k-mb": (1, 524288, None, True, 64),
    "p-b1-32k": (1, 32768, None, False, 64), "p-b1-32k-mb": (1, 32768, None, True, 64),
    "p-b8-128k": (8, 131072, None, False, 64), "p-b8-128k-mb": (8, 131072, None, True, 64),
    "p-b64-32k": (64, 32768, None, False, 64), "p-b64-32k-mb": (64, 32768, None, True, 64),
    "p16-b1-512k-mb": (1, 524288, None, True, 16), "p16-b64-32k-mb": (64, 32768, None, True, 16),
    "b8-128k": (8, 131072, None, False), "b8-128k-mb": (8, 131072, None, True),
    "b1-4k": (1, 4096, None, False), "b1-4k-mb": (1, 4096, None, True),
    "b1-4k-mb-c50": (1, 4096, 0.5, True), "b1-32k": (1, 32768, None, False),
    "b1-32k-mb": (1, 32768, None, True), "b1-32k-mb-c50": (1, 32768, 0.5, True),
    "b1-128k": (1, 131072, None, False), "b1-512k": (1, 524288, None, False),
    "b1-512k-mb": (1, 524288, None, True), "b8-32k": (8, 32768, None, False),
    "b8-32k-mb": (8, 32768, None, True), "b64-32k": (64, 32768, None, False),
    "b64-32k-mb": (64, 32768, None, True),
}


@contextmanager
def overrides(values, config):
    saved = {k: getattr(td, k) for k in values}
    cfg = td.decode_config
    try:
        for k, v in values.items():
            setattr(td, k, v)
        if config is not None:
            td.decode_config = lambda *a: (*config, cfg(*a)[3])
        yield
    finally:
        for k, v in saved.items():
            setattr(td, k, v)
        td.decode_config = cfg


def cudnn_graph(c, used):
    """Dense cuDNN SDPA on the case's K/V sliced to the ``used`` keys, captured."""
    qt, kt, vt = (x.transpose(1, 2) for x in (c.q, c.k[:, :used], c.v[:, :used]))
    return capture(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))[0]


def round_medians(graphs, rounds, rng, device):
    """Median ms of each graph over ``rounds`` rounds, each replaying every graph once in a
    shuffled order (clock drift then spreads over all of them)."""
    times = {k: [] for k in graphs}
    for _ in range(rounds):
        order = list(graphs)
        rng.shuffle(order)
        for k in order:
            times[k].append(time_ms(graphs[k].replay, device))
    return {k: statistics.median(v) for k, v in times.items()}


def kernel_times(graph, replays=20):
    """Mean device microseconds per replay of each kernel in ``graph``."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    res = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.count:
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            res[e.key[:28]] = t / replays
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    names = args.variants.split(",")
    print(torch.cuda.get_device_name(), f"ms per step (graph replay), median of {args.rounds} "
          "shuffled rounds; H32/Hkv8 D128 bf16", flush=True)
    rng = random.Random(0)
    scale = 128 ** -0.5
    for row in args.rows.split(","):
        B, L, fill, masked, *paged = ROWS[row]
        c = build_case(decode_workload(B, L, masked, fill), dev, torch.bfloat16)
        k, v, table = c.k, c.v, None
        if paged:
            k, v, table = shuffled_page_pools(c.k, c.v, paged[0])
        graphs, outs = {}, {}
        for name in names:
            values, per_sm, config = VARIANTS[name]
            n = None if per_sm is None else td.choose_num_splits(B, 8, L, dev, per_sm=per_sm)
            with overrides(values, config):
                graphs[name], outs[name] = capture(
                    lambda n=n: td.decode_forward(c.q, k, v, c.mask, c.bias, scale, False,
                                                  0.0, c.cache_seqlens, n, table)[0])
        ref = outs[names[0]]
        diffs = {k: (o.float() - ref.float()).abs().max().item() for k, o in outs.items()}
        graphs["cudnn"] = cudnn_graph(c, L if fill is None else int(L * fill))
        med = round_medians(graphs, args.rounds, rng, dev)
        best = min((k for k in med if k != "cudnn"), key=med.get)
        print(f"{row:14s} " + " ".join(f"{k} {v:.4f}" for k, v in med.items())
              + f" | cudnn/base {med['cudnn'] / med[names[0]]:.3f} best {best} "
              f"cudnn/best {med['cudnn'] / med[best]:.3f} maxdiff {max(diffs.values()):.2e}",
              flush=True)
        if args.profile:
            for k in graphs:
                kt_ = kernel_times(graphs[k])
                print(f"  kernels {k}: " + "; ".join(f"{n} {t:.2f}us" for n, t in kt_.items()),
                      flush=True)
        del graphs, outs


if __name__ == "__main__":
    main()
