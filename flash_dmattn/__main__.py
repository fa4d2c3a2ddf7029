"""Command line: ``python -m flash_dmattn info | demo | build``."""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import torch


def _device_line() -> str:
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        return f"cuda: {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}), torch {torch.__version__}"
    return f"cpu ({torch.get_num_threads()} threads), torch {torch.__version__}, no CUDA device"


def info() -> int:
    """Print every backend with availability, version and reasons, and the device."""
    from . import __version__, registry

    print(f"flash_dmattn {__version__}")
    print(f"device: {_device_line()}")
    forced, disabled = registry.forced_name(), registry.disabled_names()
    if forced or disabled:
        print(f"environment: FLASH_DMATTN_BACKEND={forced or ''} FLASH_DMATTN_DISABLE={','.join(sorted(disabled))}")
    rows = []
    for name in registry.PRIORITY:
        backend = registry._BACKENDS.get(name)
        if backend is None:
            rows.append((name, "no", "-", registry.NOT_BUILT))
            continue
        reason = registry.unavailable_reason(backend)
        rows.append((name, "yes" if reason is None else "no", backend.version(), reason or ""))
    widths = [max(len(r[i]) for r in rows + [("backend", "available", "version", "")]) for i in range(3)]
    print(f"{'backend':<{widths[0]}}  {'available':<{widths[1]}}  {'version':<{widths[2]}}  reason")
    for name, ok, version, reason in rows:
        print(f"{name:<{widths[0]}}  {ok:<{widths[1]}}  {version:<{widths[2]}}  {reason}")
    return 0


def _time_ms(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up (compiles, caches)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def demo(seqlen: int = 0, repeats: int = 0) -> int:
    """Run every available backend on one dynamic-mask problem; print time and error."""
    from . import flash_dmattn_func_auto, get_available_backends, registry
    from .inputs import AttentionInputs
    from .reference import reference_attention
    from .utils.mask import topk_intervals

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    B, H, Hkv, D = 2, 8, 2, 64
    L = seqlen or (4096 if on_gpu else 512)
    repeats = repeats or (20 if on_gpu else 3)
    window = L // 8
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B, L, H, D, device=device, dtype=dtype, generator=gen)
    k = torch.randn(B, L, Hkv, D, device=device, dtype=dtype, generator=gen)
    v = torch.randn(B, L, Hkv, D, device=device, dtype=dtype, generator=gen)
    # A dynamic-mask layer's per-key bias and its selection: each query keeps the top-`window`
    # keys of its causal prefix, as key intervals (O(L) numbers, as DynamicMaskAttention
    # builds them).
    bias = torch.randn(B, Hkv, 1, L, device=device, dtype=dtype, generator=gen)
    mask = topk_intervals(bias, window, is_causal=True)
    print(f"device: {_device_line()}")
    print(
        f"problem: B={B} L={L} H={H} Hkv={Hkv} D={D} {str(dtype).replace('torch.', '')}, "
        f"per-key bias {tuple(bias.shape)}, causal top-{window} per query as KeyIntervals "
        f"{mask.shape}"
    )
    exact, _ = reference_attention(
        q.double(), k.double(), v.double(), mask.to_dense(L), bias.double(), D ** -0.5, True, 0.0
    )
    print(f"{'backend':<16} {'fwd ms':>9} {'fwd+bwd ms':>11} {'max |err|':>10}  note")
    auto = flash_dmattn_func_auto(None)
    for name in get_available_backends():
        fn = flash_dmattn_func_auto(name)
        backend = registry.get_backend(name)
        fwd_inputs = AttentionInputs.from_args(q, k, v, mask, bias, is_causal=True)
        reasons = backend.not_supported_reasons(fwd_inputs)
        if reasons:
            print(f"{name:<16} {'-':>9} {'-':>11} {'-':>10}  declined: {'; '.join(reasons)}")
            continue
        with torch.no_grad():
            out = fn(q, k, v, mask, bias, is_causal=True)
            fwd = _time_ms(lambda: fn(q, k, v, mask, bias, is_causal=True), device, repeats)
        err = (out.double() - exact).abs().max().item()
        qg, kg, vg, bg = (t.detach().requires_grad_() for t in (q, k, v, bias))
        grad_reasons = backend.not_supported_reasons(
            AttentionInputs.from_args(qg, kg, vg, mask, bg, is_causal=True)
        )
        if grad_reasons:
            bwd, note = "-", f"no backward: {'; '.join(grad_reasons)}"
        else:
            def step():
                o = fn(qg, kg, vg, mask, bg, is_causal=True)
                torch.autograd.grad(o, (qg, kg, vg, bg), torch.ones_like(o))

            bwd, note = f"{_time_ms(step, device, repeats):.3f}", ""
        print(f"{name:<16} {fwd:>9.3f} {bwd:>11} {err:>10.2e}  {note}")
    with torch.no_grad():
        out = auto(q, k, v, mask, bias, is_causal=True)
    picked = registry.select_backend(AttentionInputs.from_args(q, k, v, mask, bias, is_causal=True))
    print(
        f"flash_dmattn_func picks {picked.name!r} here; output max |err| "
        f"{(out.double() - exact).abs().max().item():.2e}"
    )
    return 0


def build(specs, build_all: bool = False, list_only: bool = False) -> int:
    """Prebuild CUDA kernel specialisations into the on-disk cache (``--all`` or named specs).

    ``--list`` prints the specs (those named, else every one ``--all`` means) and builds
    nothing. Exit status: 0 done, 1 a build failed, 2 bad arguments or the cuda backend is
    unavailable here (the reason is printed, no traceback).
    """
    from . import registry
    from .backends.cuda import jit
    from .backends.cuda.spec import KernelSpec, all_specs

    if build_all and specs:
        print("flash_dmattn build: give --all or spec names, not both", file=sys.stderr)
        return 2
    try:
        targets = [KernelSpec.parse(s) for s in specs] if specs else all_specs()
    except ValueError as exc:
        print(f"flash_dmattn build: {exc}", file=sys.stderr)
        return 2
    if list_only:
        for spec in targets:
            print(spec.name)
        return 0
    if not (build_all or specs):
        print("flash_dmattn build: name specs (e.g. d128-bf16-mask-bias), --all or --list",
              file=sys.stderr)
        return 2
    reason = registry._BACKENDS["cuda"].unavailable_reason()
    if reason is not None:
        print(f"flash_dmattn build: the cuda backend is unavailable here: {reason}",
              file=sys.stderr)
        return 2
    if not logging.getLogger().handlers:
        # Show jit's one "compiling ..." line per build.
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("flash_dmattn").setLevel(logging.INFO)
    from .backends.cuda import toolchain

    tc = toolchain.detect()
    failures = 0
    for spec in targets:
        cached = jit.is_built(spec, tc)
        start = time.perf_counter()
        try:
            jit.load_kernel(spec, tc)
        except Exception as exc:  # report every spec's failure, then exit 1
            failures += 1
            print(f"{spec.name}: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        took = "already built" if cached else f"built in {time.perf_counter() - start:.1f} s"
        print(f"{spec.name}: {took}")
    print(f"{len(targets) - failures}/{len(targets)} specialisations ready for {tc.arch} "
          f"in {jit.cache_root()}")
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flash_dmattn")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="list backends, availability and the device")
    p_demo = sub.add_parser("demo", help="run every available backend on a small problem")
    p_demo.add_argument("--seqlen", type=int, default=0)
    p_demo.add_argument("--repeats", type=int, default=0)
    p_build = sub.add_parser("build", help="prebuild cuda kernel specialisations")
    p_build.add_argument("specs", nargs="*", metavar="SPEC", help="e.g. d128-bf16-mask-bias")
    p_build.add_argument("--all", action="store_true", help="every specialisation")
    p_build.add_argument("--list", action="store_true", help="print the specs, build nothing")
    args = parser.parse_args(argv)
    if args.command == "info":
        return info()
    if args.command == "build":
        return build(args.specs, args.all, args.list)
    return demo(args.seqlen, args.repeats)


if __name__ == "__main__":
    sys.exit(main())
