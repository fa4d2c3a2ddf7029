"""Where does the flex backend's time go? Block-mask build vs kernel vs recompiles."""

import torch
import torch._dynamo.utils as dyn_utils
from triton.testing import do_bench

from flash_dmattn import flex_dmattn_func
from flash_dmattn.backends import flex as flex_mod
from flash_dmattn.inputs import AttentionInputs
from flash_dmattn.utils.mask import create_mask

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
for (B, L, H, Hkv, D, kind) in [(2, 4096, 8, 2, 64, "perkey"), (1, 4096, 8, 2, 64, "perkey"), (2, 4096, 8, 2, 128, "perkey"), (2, 4096, 8, 2, 64, "none"), (1, 8192, 16, 4, 128, "none"), (1, 8192, 16, 4, 128, "perkey")]:
    q = torch.randn(B, L, H, D, device=dev, dtype=dt)
    k = torch.randn(B, L, Hkv, D, device=dev, dtype=dt)
    v = torch.randn(B, L, Hkv, D, device=dev, dtype=dt)
    bias = mask = None
    if kind == "perkey":
        bias = torch.randn(B, Hkv, 1, L, device=dev, dtype=dt)
        mask = create_mask(bias, None, B, L, L, L // 8, torch.finfo(dt).min)
    inputs = AttentionInputs.from_args(q, k, v, mask, bias, None, True)
    fa = flex_mod._flex_module()
    bm = flex_mod._block_mask(inputs)
    sm = flex_mod._score_mod(inputs)
    comp = flex_mod._compiled_flex()
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    direct = lambda: comp(qt, kt, vt, score_mod=sm, block_mask=bm, scale=D ** -0.5, enable_gqa=H != Hkv)
    ours = lambda: flex_dmattn_func(q, k, v, mask, bias, is_causal=True)
    build = lambda: flex_mod._block_mask(inputs)
    c0 = dict(dyn_utils.counters["stats"])
    t_direct = do_bench(direct, warmup=25, rep=100, return_mode="median")
    t_ours = do_bench(ours, warmup=25, rep=100, return_mode="median")
    t_build = do_bench(build, warmup=5, rep=50, return_mode="median")
    c1 = dict(dyn_utils.counters["stats"])
    dense = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=H != Hkv)
    t_sdpa = do_bench(dense, warmup=25, rep=100, return_mode="median")
    print(f"B{B} L{L} H{H}/{Hkv} D{D} {kind}: flex direct {t_direct:.3f} ms, flex backend {t_ours:.3f} ms, "
          f"block-mask build {t_build:.3f} ms, sdpa causal {t_sdpa:.3f} ms; dynamo stats delta "
          f"{ {k: c1.get(k, 0) - c0.get(k, 0) for k in c1 if c1.get(k, 0) != c0.get(k, 0)} }")
