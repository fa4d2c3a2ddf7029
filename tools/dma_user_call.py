"""The user's causal top-W call (selection + attention forward) against dense causal cuDNN, in
a process that runs nothing else first.

    python3 tools/dma_user_call.py [L ...] [--rounds N] [--warmup-ms MS] [--rep-ms MS]

Per L (default 32K and 64K; bf16, B1 H16/Hkv4 D128, per-key bias, W 2048, inputs requiring
grad as in training), ``--rounds`` times: do_bench medians of dense causal cuDNN SDPA's forward,
then of ``topk_intervals`` followed by ``flash_dmattn_func_auto(backend="cuda")`` with the
intervals.

Both calls draw the GPU to its power limit within a second of back-to-back work, and its clocks
then drop (nvidia-smi reports the software power cap). With the default 25 ms warm-up a timing
sees whatever power state the work before it left: ``tools/dma_probe.py`` times this call right
after its heavy fwd+bwd rows, and its ``--spans`` after an idle moment, so the two disagree by
several percent. ``--warmup-ms 2000`` runs each function for two seconds before timing it, so
that the dense baseline and the call are both timed in the steady state at the limit, as in a
model that runs attention continuously. After each timing the GPU's SM clock, power draw and
clock-event reasons (nvidia-smi, where present) are printed.
"""
import argparse
import shutil
import subprocess

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flash_dmattn as fd
from flash_dmattn.utils.mask import topk_intervals


def power_state():
    """The GPU's SM clock, power draw and active clock-event reasons, from nvidia-smi. The GPU
    is named by its UUID: nvidia-smi numbers GPUs without CUDA_VISIBLE_DEVICES, torch within
    it (the index is the fallback where torch gives no UUID)."""
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi not found"
    idx = torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(idx), "uuid", None)
    which = str(idx) if uuid is None else str(uuid)
    if uuid is not None and not which.startswith("GPU-"):
        which = "GPU-" + which
    q = "clocks.sm,power.draw,clocks_event_reasons.active"
    r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader", "-i", which],
                       capture_output=True, text=True)
    return r.stdout.strip() or r.stderr.strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("lengths", nargs="*", type=int, default=[32768, 65536])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup-ms", type=int, default=25,
                    help="do_bench warm-up per timing (2000 reaches the power limit)")
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench timed span per timing")
    a = ap.parse_args()
    B, H, Hkv, D, W = 1, 16, 4, 128, 2048
    print(torch.cuda.get_device_name(), flush=True)
    for L in a.lengths:
        q = torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        bias = torch.randn(B, Hkv, 1, L, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        call = fd.flash_dmattn_func_auto(backend="cuda")

        def sf():
            sel = topk_intervals(bias.detach(), W, is_causal=True)
            return call(q, k, v, attn_mask=sel, attn_bias=bias, is_causal=True)

        qh, kh, vh = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))

        def dense_f():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True,
                                                      enable_gqa=True)

        # Each round times the dense baseline, then the call, so that both see the same drift
        # of the GPU's clocks.
        for _ in range(a.rounds):
            dense = do_bench(dense_f, warmup=a.warmup_ms, rep=a.rep_ms, return_mode="median")
            state = power_state()
            t = do_bench(sf, warmup=a.warmup_ms, rep=a.rep_ms, return_mode="median")
            print(f"L{L} dense causal cuDNN fwd {dense:.3f} ms [{state}], select+fwd {t:.3f} ms "
                  f"[{power_state()}] = {t / dense:.3f}x", flush=True)

if __name__ == "__main__":
    main()
