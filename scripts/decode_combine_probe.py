"""Where a Triton decode step's time goes: the split kernel, the combine kernel, the whole step
(GPU only; CUDA-graph replay, the benchmark's decode timing).

    python3 scripts/decode_combine_probe.py

For each decode row: the whole ``decode_forward`` step, the split kernel alone (the combine
launch replaced by nothing), the combine kernel alone (replaying its recorded launch) and dense
cuDNN SDPA on K/V sliced to the used length. (The logs of 2026-11-22f also time the combine
before it read the splits as one 2-D load: "old combine only".)
"""
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from benchmarks.timing import graph_time_ms  # noqa: E402
from benchmarks.workloads import build_case, decode_workload  # noqa: E402
from flash_dmattn.backends.triton import decode as td  # noqa: E402


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
        w = decode_workload(B, L, masked, fill)
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
        used = w.used_k
        qt, kt, vt = (x.transpose(1, 2) for x in (c.q, c.k[:, :used], c.v[:, :used]))
        sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)  # noqa: E731
        sdpa()
        res["cudnn dense"] = graph_time_ms(sdpa, dev)[0]
        label = f"B{B} Lk{L}" + (" mask+bias" if masked else "") + (f" cache{fill}" if fill else "")
        splits = kwargs["BLOCK_S"]
        print(f"{label:30s} splits<= {splits:3d} " + "  ".join(
            f"{k} {v:.4f}" if v is not None else f"{k} n/a" for k, v in res.items())
            + f"  finite {bool(torch.isfinite(ref_out).all())}", flush=True)


if __name__ == "__main__":
    main()
