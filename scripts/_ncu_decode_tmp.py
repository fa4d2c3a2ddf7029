import sys, torch
sys.path.insert(0, ".")
from benchmarks.workloads import Workload, build_case
from flash_dmattn.backends.cuda import kernels as ck
dev = torch.device("cuda")
w = Workload("decode", 64, 32, 8, 1, 32768, 128, False, "relu-per-key", True, forward_only=True)
c = build_case(w, dev, torch.bfloat16)
which = sys.argv[1]
m, b = {"none": (None, None), "mb": (c.mask, c.bias)}[which]
for _ in range(3):
    ck.cuda_decode_forward(c.q, c.k, c.v, m, b, 0.08, False, 0.0)
torch.cuda.synchronize()
