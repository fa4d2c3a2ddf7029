"""The key-interval planner alone (``flash_dmattn.planning.list_kernels``): device and host time
per call, each of its kernels per call, and what building the lists reads.

    python3 tools/plan_probe.py [L ...] [--window W] [--kinds causal,shared] [--rows R]
                                [--block-m 128] [--block-n 128] [--segment-rows 1024]
                                [--coarse S,...] [--chunks C,...] [--work] [--cpu]

Per L and selection kind (``topk_intervals`` of a random per-key bias, B1 and R kv-head rows):
the planner call the cuda backend makes for a forward + backward (tiles of ``block_m`` queries,
segment items of ``segment_rows`` under the selection's window promise), timed with do_bench
(median device time) and back to back on the host (host time per call); then one
torch.profiler pass of 10 calls, printed per call: every kernel (and memset) with its launches
and device time. ``--coarse`` adds calls at other coarse segments (the default is the
planner's own choice); ``--chunks`` repeats the calls with other key chunks per program of the
per-key kernels (``list_kernels.CHUNK``: fewer keys a program, more programs). ``--work`` counts the entries the list building reads, against a fill
that scans every live key of its row for every tile (twice: covering keys, then the others);
with ``--cpu`` only that count runs (no GPU needed).

Internal modules: it calls ``list_kernels.plan_fast`` (the planner's device path, with the
arguments ``key_lists.plan_intervals`` gives it) so that the coarse segment can be chosen, and
``key_lists.key_ranges`` for the work count.
"""
import argparse

import torch

from flash_dmattn.intmath import cdiv
from flash_dmattn.planning import list_kernels
from flash_dmattn.planning.key_lists import end_bucket_for, key_ranges, segment_capacity
from flash_dmattn.utils.mask import topk_intervals

from dma_probe import cuda_trace, host_ms  # the sibling tool (tools/ is this script's path)


def kernels_per_call(fn, calls=10):
    """``[(name, launches per call, device us per call)]`` of ``calls`` calls, longest first."""
    from torch.autograd import DeviceType

    prof = cuda_trace(fn, calls)
    rows = []
    for evt in prof.key_averages():
        if evt.device_type != DeviceType.CUDA:
            continue
        total = getattr(evt, "device_time_total", None)
        if total is None:
            total = evt.cuda_time_total
        rows.append((evt.key, evt.count / calls, total / calls))
    return sorted(rows, key=lambda r: -r[2])


def cdiv_t(a, b):
    return torch.div(a + b - 1, b, rounding_mode="floor")


def work(bounds, L, causal, block_m, segment_rows, coarse):
    """Entries read while building the lists (see the module docstring), as a dict."""
    r = key_ranges(bounds, L, L, causal)
    lo, hi = r.lo.long(), r.hi.long()
    rows = lo.shape[0]
    live = lo < hi
    cum = torch.cumsum(live.long(), 1)

    def live_before(q1):
        """Live keys at positions < q1 (the causal bound of a tile ending at q1), per row."""
        b = q1.clamp(0, L)
        return torch.where(b > 0, cum[:, (b - 1).clamp(min=0)], torch.zeros_like(cum[:, :1]))

    def meets(size):
        """Per row and segment of ``size`` queries: the keys meeting it."""
        n = cdiv(L, size)
        first = torch.where(live, lo // size, n)
        after = torch.where(live, (hi - 1) // size + 1, n)
        diff = torch.zeros(rows, n + 1, dtype=torch.long)
        diff.scatter_add_(1, first, torch.ones_like(first))
        diff.scatter_add_(1, after, -torch.ones_like(after))
        return torch.cumsum(diff, 1)[:, :n]

    tiles = torch.arange(cdiv(L, block_m))
    t_q1 = ((tiles + 1) * block_m).clamp(max=L)
    segs = torch.arange(cdiv(L, segment_rows))
    s_q1 = ((segs + 1) * segment_rows).clamp(max=L)
    scan = (lambda q1: live_before(q1)) if causal else (lambda q1: cum[:, -1:].expand(-1,
                                                                                      len(q1)))
    old = 2 * (scan(t_q1).sum() + scan(s_q1).sum())
    coarse_len = meets(coarse)
    new_fill = coarse_len[:, tiles * block_m // coarse].sum()
    new_seg = 2 * meets(segment_rows).sum() if segment_rows == coarse else 2 * scan(s_q1).sum()
    # The coarse lists' writer reads a chunk's live keys (COARSE_SUB at a time) once per
    # segment they reach.
    chunk, sub = list_kernels.CHUNK, list_kernels.COARSE_SUB
    n_chunks = cdiv(L, chunk)
    pad = n_chunks * chunk - L

    def per_chunk(x, fill):
        return torch.nn.functional.pad(x, (0, pad), value=fill).view(rows, n_chunks, chunk)

    f = per_chunk(torch.where(live, lo // coarse, 1 << 30), 1 << 30).amin(2)
    a = per_chunk(torch.where(live, (hi - 1) // coarse, -1), -1).amax(2)
    n_live = per_chunk(live.long(), 0).sum(2)
    visits = ((a - f + 1).clamp(min=0) * cdiv_t(n_live, sub) * sub).sum()
    out = meets(block_m).sum() + meets(segment_rows).sum()
    return dict(live=int(live.sum()), out=int(out), old=int(old), fill=int(new_fill),
                seg=int(new_seg), coarse=int(coarse_len.sum()), visits=int(visits))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("lengths", nargs="*", type=int, default=[32768, 65536])
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--kinds", default="causal,shared")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--block-m", type=int, default=128)
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--segment-rows", type=int, default=1024)
    ap.add_argument("--coarse", default="", help="other coarse segments to time, e.g. 2048,4096")
    ap.add_argument("--chunks", default="", help="other key chunks to time, e.g. 256,512")
    ap.add_argument("--work", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="only the work count, on CPU")
    a = ap.parse_args()
    dev = "cpu" if a.cpu else "cuda"
    if not a.cpu:
        from triton.testing import do_bench

        print(torch.cuda.get_device_name(), flush=True)
    W, bm, bn, seg = a.window, a.block_m, a.block_n, a.segment_rows
    for L in a.lengths:
        bias = torch.randn(1, a.rows, 1, L, device=dev)
        for kind in a.kinds.split(","):
            ki = topk_intervals(bias, W, is_causal=kind == "causal")
            default = list_kernels.coarse_rows_for(bm, seg)
            if a.work or a.cpu:
                w = work(ki.bounds.cpu(), L, True, bm, seg, default)
                print(f"L{L} {kind:6s} rows {a.rows}: live keys {w['live']}, list entries "
                      f"{w['out']} | entries read: row scans {w['old']:.3e}, now tile fills "
                      f"{w['fill']:.3e} + segment fills {w['seg']:.3e} + coarse lists "
                      f"{w['coarse']:.3e} written from {w['visits']:.3e} key visits "
                      f"(coarse {default}) | row scans / tile+segment fills "
                      f"{w['old'] / max(1, w['fill'] + w['seg']):.1f}x", flush=True)
            if a.cpu:
                continue
            default_chunk = list_kernels.CHUNK
            variants = ([(c, default_chunk) for c in [None] + [int(c) for c in a.coarse.split(",") if c]]
                        + [(None, int(c)) for c in a.chunks.split(",") if c])
            for coarse, chunk in variants:
                list_kernels.CHUNK = chunk

                def plan():
                    return list_kernels.plan_fast(
                        ki.bounds, L, L, True, bm, bn, True, end_bucket_for(L),
                        capacity=min(L, W + bm - 1), segment_rows=seg,
                        segment_capacity=segment_capacity(L, seg, bn, W), coarse_rows=coarse)
                t = do_bench(plan, warmup=25, rep=200, return_mode="median")
                h = host_ms(plan)
                print(f"L{L} {kind:6s} coarse {coarse or default} chunk {chunk}: plan "
                      f"{t * 1e3:.1f} us (host {h * 1e3:.1f} us)", flush=True)
                for name, n, us in kernels_per_call(plan):
                    print(f"    {us:8.1f} us  x{n:g}  {name[:90]}")
            list_kernels.CHUNK = default_chunk


if __name__ == "__main__":
    main()
