import sys, torch
sys.path.insert(0, ".")
from benchmarks.timing import graph_time_ms
from benchmarks.workloads import Workload, build_case
from flash_dmattn.backends.cuda import kernels as ck
dev = torch.device("cuda")
for B, L in ((64, 32768), (1, 524288)):
    w = Workload("decode", B, 32, 8, 1, L, 128, False, "relu-per-key", True, forward_only=True)
    c = build_case(w, dev, torch.bfloat16)
    ones = torch.ones_like(c.mask)
    line = f"B{B} L{L}:"
    for name, m, b in (("none", None, None), ("mask", c.mask, None), ("bias", None, c.bias),
                       ("mask+bias", c.mask, c.bias), ("allTrue+bias", ones, c.bias)):
        fn = lambda m=m, b=b: ck.cuda_decode_forward(c.q, c.k, c.v, m, b, 0.08, False, 0.0)
        fn(); t, _ = graph_time_ms(fn, dev)
        line += f"  {name} {t:.4f}"
    print(line, flush=True)
