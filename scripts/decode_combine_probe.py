"""Where a Triton decode step's time goes: the split kernel, the combine kernel, the whole step
(GPU only; CUDA-graph replay, the benchmark's decode timing).

    python3 scripts/decode_combine_probe.py

For each decode row: the whole ``decode_forward`` step, the split kernel alone (the combine
launch replaced by nothing), the combine kernel alone (replaying its recorded launch), the
combine of the previous version (one split per loop step, kept here for the A/B) and dense
cuDNN SDPA on K/V sliced to the used length.
"""
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, ".")
from benchmarks.timing import graph_time_ms  # noqa: E402
from benchmarks.workloads import Workload, build_case  # noqa: E402
from flash_dmattn.backends.triton import decode as td  # noqa: E402


@triton.jit
def _loop_combine_kernel(
    OPart, LPart, Out, Lse,
    num_splits, split_rows, num_heads, seqlen_q,
    stride_ob, stride_om, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # The combine of commit 1de2d29: one split's partial per loop step.
    r = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    ls = tl.load(LPart + offs_s.to(tl.int64) * split_rows + r, mask=offs_s < num_splits,
                 other=float("-inf"))
    m = tl.max(ls, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.sum(tl.exp2(ls - m_use), 0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s in range(0, num_splits):
        row = s * split_rows + r
        w = tl.exp2(tl.load(LPart + row) - m_use)
        o = tl.load(OPart + row * HEAD_DIM + offs_d, mask=d_ok, other=0.0)
        acc += w * o
    has_any = denom > 0.0
    out = acc / tl.where(has_any, denom, 1.0)
    lse = tl.where(has_any, (m_use + tl.log2(tl.where(has_any, denom, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    i = r % seqlen_q
    bh = r // seqlen_q
    h = bh % num_heads
    b = bh // num_heads
    tl.store(Out + b * stride_ob + i * stride_om + h * stride_oh + offs_d,
             out.to(Out.dtype.element_ty), mask=d_ok)
    tl.store(Lse + r, lse)


class _Recorder:
    """Stands in for the combine kernel: records its launch, or skips it."""

    def __init__(self, real, run):
        self.real, self.run, self.launch = real, run, None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launch = (grid, args, kwargs)
            if self.run:
                self.real[grid](*args, **kwargs)
        return launch


def main():
    dev = torch.device("cuda")
    rows = ((1, 4096, None, False), (1, 32768, None, False), (1, 131072, None, False),
            (1, 524288, None, False), (1, 32768, None, True), (1, 32768, 0.5, True),
            (1, 131072, 0.5, True), (1, 524288, 0.5, True), (8, 32768, None, False),
            (8, 131072, 0.5, True), (64, 32768, None, True))
    print(torch.cuda.get_device_name(), "ms per call (graph replay)")
    real = td._decode_combine_kernel
    for B, L, fill, masked in rows:
        w = Workload("decode", B, 32, 8, 1, L, 128, False,
                     "relu-per-key" if masked else "none", masked, forward_only=True,
                     cache_fill=fill)
        c = build_case(w, dev, torch.bfloat16)
        scale = 128 ** -0.5

        def step():
            return td.decode_forward(c.q, c.k, c.v, c.mask, c.bias, scale, False, 0.0,
                                     c.cache_seqlens)

        res = {}
        ref_out = step()[0]
        res["step"] = graph_time_ms(step, dev)[0]
        rec = _Recorder(real, run=False)
        td._decode_combine_kernel = rec
        try:
            step()
            res["split only"] = graph_time_ms(step, dev)[0]
        finally:
            td._decode_combine_kernel = real
        grid, args, kwargs = rec.launch
        res["combine only"] = graph_time_ms(lambda: real[grid](*args, **kwargs), dev)[0]
        old_kwargs = {k: v for k, v in kwargs.items() if k != "CHUNK_S"}
        old_kwargs["num_warps"] = 2
        _loop_combine_kernel[grid](*args, **old_kwargs)
        res["old combine only"] = graph_time_ms(
            lambda: _loop_combine_kernel[grid](*args, **old_kwargs), dev)[0]
        out_new = args[2].clone()
        real[grid](*args, **kwargs)
        same = torch.equal(args[2], out_new)
        used = w.used_k
        qt, kt, vt = (x.transpose(1, 2) for x in (c.q, c.k[:, :used], c.v[:, :used]))
        sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)  # noqa: E731
        sdpa()
        res["cudnn dense"] = graph_time_ms(sdpa, dev)[0]
        label = f"B{B} Lk{L}" + (" mask+bias" if masked else "") + (f" cache{fill}" if fill else "")
        splits = kwargs["BLOCK_S"]
        print(f"{label:30s} splits<= {splits:3d} " + "  ".join(
            f"{k} {v:.4f}" if v is not None else f"{k} n/a" for k, v in res.items())
            + f"  finite {bool(torch.isfinite(ref_out).all())} replay-equal {same}", flush=True)


if __name__ == "__main__":
    main()
