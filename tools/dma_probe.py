"""Quick timings of key-interval attention on a GPU (fast iteration beside benchmarks' dma_long).

    python3 tools/dma_probe.py [L ...] [--window W] [--kinds shared,causal]
                                 [--backends triton,cuda] [--profile [--trace DIR]] [--spans]

Per L and selection kind: topk_intervals build, the planner alone, each backend's forward and
forward+backward (planning included, as a user's call), the same with the selection built in
the timed call, dense causal cuDNN SDPA, and cuDNN over the W gathered keys ("selected keys
only"); medians of do_bench, bf16, B1 H16/Hkv4 D128. ``--profile`` prints torch.profiler tables of
the plan, the selection, the forward, the selection and forward together, and fwd+bwd (three
calls each); ``--trace DIR`` also writes their chrome traces (kernel gaps show host-bound stretches).
``--spans`` adds the device time per call of the forward and of the selection with the forward,
read from a profiler trace of calls back to back (the host runs ahead of the device, so this is
the time of the call's kernels and the gaps between them, whatever the host's load; do_bench's
median also counts the time the device waits for a host that fell behind).

The rows run back to back, so each timing sees the power state the rows before it left: a
GPU at its power limit lowers its clocks, and the select+fwd rows, timed right after the
fwd+bwd rows, come out several percent above ``--spans`` (a few calls after an idle moment,
at full clocks). ``tools/dma_user_call.py --warmup-ms 2000`` times the dense baseline and the
user's call both at the limit.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flash_dmattn as fd
from flash_dmattn.utils.mask import topk_intervals


def med(fn, rep=200):
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def host_ms(fn, calls=50, sync=None):
    """Host time of one call: the wall time of enqueuing ``calls`` calls back to back, while the
    device runs behind (a call whose device work is shorter than its host work is host bound).
    ``sync`` waits for the device (default ``torch.cuda.synchronize``)."""
    import time
    sync = sync or torch.cuda.synchronize
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    sync()
    return (t1 - t0) * 1e3 / calls


def cuda_trace(fn, calls):
    """A torch.profiler trace (device activity only) of ``calls`` calls of ``fn`` back to back,
    after one untraced call (compilation, caches)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof


def device_span_ms(fn, calls=8):
    """Median device time per call of ``fn`` run ``calls`` times back to back, and the
    kernels' busy time in it (:func:`spans_per_call` on a trace of the calls)."""
    from torch.autograd import DeviceType

    prof = cuda_trace(fn, calls)
    return spans_per_call([(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                           if e.device_type == DeviceType.CUDA])


def spans_per_call(events):
    """``(span ms, busy ms)`` medians over the calls of a trace, from ``events`` ``[(name,
    start us, end us)]`` of device activity: a call runs from the end of the previous call's
    longest kernel (the one with the most time in the trace) to the end of its own, and is
    busy for the summed durations of the activity in that stretch. The first two calls, which
    the host may not be ahead of yet, are left out (the first span starts at the second call's
    end)."""
    events = sorted(events, key=lambda e: e[1])
    total = {}
    for name, start, end in events:
        total[name] = total.get(name, 0) + end - start
    marker = max(total, key=total.get)
    ends = [i for i, e in enumerate(events) if e[0] == marker]
    spans, busy = [], []
    for i, j in zip(ends[1:], ends[2:]):
        spans.append(events[j][2] - events[i][2])
        busy.append(sum(end - start for _, start, end in events[i + 1:j + 1]))
    spans.sort()
    busy.sort()
    return spans[len(spans) // 2] / 1e3, busy[len(busy) // 2] / 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("lengths", nargs="*", type=int, default=[16384, 32768])
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--kinds", default="shared,causal")
    ap.add_argument("--backends", default="triton")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--trace", default="", help="with --profile: write chrome traces here")
    ap.add_argument("--spans", action="store_true",
                    help="device time per call of fwd and select+fwd, from a profiler trace")
    a = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    B, H, Hkv, D, W = 1, 16, 4, 128, a.window
    print(torch.cuda.get_device_name(), flush=True)
    for L in a.lengths:
        q = torch.randn(B, L, H, D, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(B, L, Hkv, D, device=dev, dtype=dt, requires_grad=True)
        v = torch.randn(B, L, Hkv, D, device=dev, dtype=dt, requires_grad=True)
        bias = torch.randn(B, Hkv, 1, L, device=dev, dtype=dt, requires_grad=True)
        g = torch.randn(B, L, H, D, device=dev, dtype=dt)
        qh, kh, vh = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        gh = g.transpose(1, 2).contiguous()
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            def dense_f():
                return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
            dense_fwd = med(dense_f)
            dense_fb = med(lambda: torch.autograd.grad(dense_f(), (qh, kh, vh), gh))
            idx = bias.detach()[0, :, 0].topk(W, dim=-1).indices.sort(-1).values  # (Hkv, W)
            kg = torch.stack([kh[0, h, idx[h]] for h in range(Hkv)])[None].detach().requires_grad_()
            vg = torch.stack([vh[0, h, idx[h]] for h in range(Hkv)])[None].detach().requires_grad_()
            def sel_f():
                return F.scaled_dot_product_attention(qh, kg, vg, enable_gqa=True)
            sel_fwd = med(sel_f)
            sel_fb = med(lambda: torch.autograd.grad(sel_f(), (qh, kg, vg), gh))
        print(f"L{L} W{W} dense causal cuDNN fwd {dense_fwd:.3f} fwd+bwd {dense_fb:.3f} | "
              f"selected-keys fwd {sel_fwd:.3f} fwd+bwd {sel_fb:.3f}", flush=True)
        for kind in a.kinds.split(","):
            causal_sel = kind == "causal"
            ki = topk_intervals(bias.detach(), W, is_causal=causal_sel)
            t_sel = med(lambda: topk_intervals(bias.detach(), W, is_causal=causal_sel))
            if "cuda" in a.backends.split(","):
                from flash_dmattn.backends.cuda.intervals import plan_for as cuda_plan

                def plan_fn():
                    return cuda_plan(q, k, bias, ki.bounds, True, backward=True, window=ki.window)
            else:
                from flash_dmattn.backends.triton.intervals import plan_for

                def plan_fn():
                    return plan_for(q, k, ki.bounds, True, backward=True, window=ki.window)
            t_plan = med(plan_fn)

            h_sel = host_ms(lambda: topk_intervals(bias.detach(), W, is_causal=causal_sel))
            h_plan = host_ms(plan_fn)
            print(f"  {kind:6s} select {t_sel:.3f} (host {h_sel:.3f}) plan {t_plan:.3f} "
                  f"(host {h_plan:.3f})", flush=True)
            for name in a.backends.split(","):
                call = fd.flash_dmattn_func_auto(backend=name)

                def f():
                    return call(q, k, v, attn_mask=ki, attn_bias=bias, is_causal=True)
                t_f = med(f)
                t_fb = med(lambda: torch.autograd.grad(f(), (q, k, v, bias), g))
                h_f = host_ms(f)
                h_fb = host_ms(lambda: torch.autograd.grad(f(), (q, k, v, bias), g), calls=10)
                # What a user's step runs: the selection, then the attention (host and device
                # work of the two overlap, unlike the sum of their separate medians).
                def sf():
                    sel = topk_intervals(bias.detach(), W, is_causal=causal_sel)
                    return call(q, k, v, attn_mask=sel, attn_bias=bias, is_causal=True)
                t_sf = med(sf)
                t_sfb = med(lambda: torch.autograd.grad(sf(), (q, k, v, bias), g))
                print(f"    {name:6s} select+fwd {t_sf:.3f} ({t_sf / dense_fwd:.3f}x dense) | "
                      f"select+fwd+bwd {t_sfb:.3f} ({t_sfb / dense_fb:.3f}x dense)", flush=True)
                if a.spans:
                    span_f, busy_f = device_span_ms(f)
                    span_sf, busy_sf = device_span_ms(sf)
                    print(f"    {name:6s} device per call: fwd {span_f:.3f} (kernels {busy_f:.3f}, "
                          f"{span_f / dense_fwd:.3f}x dense) | select+fwd {span_sf:.3f} (kernels "
                          f"{busy_sf:.3f}, {span_sf / dense_fwd:.3f}x dense)", flush=True)
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                torch.autograd.grad(f(), (q, k, v, bias), g)
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                print(f"    {name:6s} fwd {t_f:.3f} ({t_f / dense_fwd:.3f}x dense, "
                      f"{t_f / sel_fwd:.2f}x sel) | fwd+bwd {t_fb:.3f} ({t_fb / dense_fb:.3f}x "
                      f"dense, {t_fb / sel_fb:.2f}x sel) | host fwd {h_f:.3f} fwd+bwd {h_fb:.3f} "
                      f"| peak extra {peak:.0f} MiB", flush=True)
            if a.profile:
                from torch.profiler import ProfilerActivity, profile
                for what, fn in (("plan", plan_fn),
                                 ("select", lambda: topk_intervals(bias.detach(), W,
                                                                   is_causal=causal_sel)),
                                 ("fwd", f),
                                 ("select+fwd", sf),
                                 ("fwd+bwd", lambda: torch.autograd.grad(f(), (q, k, v, bias), g))):
                    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                        for _ in range(3):
                            fn()
                        torch.cuda.synchronize()
                    print(f"--- {kind} {what} (3 calls)")
                    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12,
                                                    max_name_column_width=60))
                    if a.trace:
                        import os
                        os.makedirs(a.trace, exist_ok=True)
                        prof.export_chrome_trace(
                            os.path.join(a.trace, f"{kind}-{L}-{what.replace('+', '_')}.json"))


if __name__ == "__main__":
    main()
