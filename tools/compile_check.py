"""Compile the Triton kernels for a GPU target on a machine without one, and report on them.

CI and the CPU development machine have no GPU, and device time is scarce: this catches
compile errors in the real (non-interpreted) kernels before a device run, and shows what the
compiler made of them -- registers and spills (``ptxas -v``), whether the key loop's loads
were software-pipelined (async copies inside the loop) and how many layout conversions the
loop body pays. Usage::

    python tools/compile_check.py [--arch 90] [--workload t2|dense|per-key|varlen|decode|decode-selected|intervals|selection|planner]
                                    [--dump DIR]
                                    [--first-config] [--dropout P]

The workload's inputs are built on CPU at a small length (the kernels' code does not depend
on it); every kernel launch of one forward and one backward is captured instead of run and
compiled for each autotuning config that the launch would try.

Internal modules: it imports the Triton backend's forward / backward modules and the planner
directly and replaces their launch functions by recorders, since the kernels it compiles have no
public entry point that stops short of running them.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile the real kernels

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flash_dmattn.backends.triton import backward as bwd_mod  # noqa: E402
from flash_dmattn.backends.triton import forward as fwd_mod  # noqa: E402
from flash_dmattn.backends.triton import forward_kernel  # noqa: E402
from flash_dmattn.backends.triton import forward_varlen  # noqa: E402

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
           torch.float64: "fp64", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8",
           torch.bool: "i1"}


def _signature(kernel, args, meta):
    """Triton signature / constexprs / divisibility attrs for one captured launch."""
    names = kernel.arg_names
    params = kernel.params
    values = dict(zip(names, args))
    values.update(meta)
    sig, consts, attrs = {}, {}, {}
    for i, (name, p) in enumerate(zip(names, params)):
        if p.is_constexpr:
            val = values[name] if name in values else p.default
            sig[name] = "constexpr"
            consts[name] = val
            continue
        val = values[name]
        if isinstance(val, torch.Tensor):
            sig[name] = "*" + _DTYPES[val.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # allocations are 16-byte aligned
        elif isinstance(val, bool):
            sig[name] = "i1"
        elif isinstance(val, int):
            sig[name] = "i32" if -2**31 <= val < 2**31 else "i64"
            if val == 1:
                # The JIT specialises ints equal to 1 into constants.
                sig[name] = "constexpr"
                consts[name] = 1
            elif val % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(val, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{name}: cannot type {type(val)}")
    return sig, consts, attrs


def _configs(tuned):
    configs = tuned.configs
    prune = getattr(tuned, "early_config_prune", None)
    return configs, prune


class _Fixed:
    """A plain (not autotuned) kernel launched with fixed warps / stages, shaped like an
    autotuner for :func:`main` (``fn``, ``configs``)."""

    def __init__(self, fn, num_warps, num_stages, maxnreg=None):
        self.fn = fn
        self.configs = [triton.Config({}, num_warps=num_warps, num_stages=num_stages,
                                      maxnreg=maxnreg)]


class _PlanCapture:
    """Stands in for a planning kernel: ``kernel[grid](*args, **meta)`` is recorded."""

    def __init__(self, name, kernel, launches):
        self.name, self.kernel, self.launches = name, kernel, launches

    def __getitem__(self, grid):
        def launch(*args, num_warps=4, num_stages=3, maxnreg=None, **meta):
            label = {"_compact_keys_kernel": "keys", "_gather_mask_bits_kernel": "gbits",
                     "_gather_bias_kernel": "gbias", "_per_key_lists_kernel": "keyl",
                     "_decode_split_kernel": "dsplit", "_selected_split_kernel": "ssplit",
                     "_decode_combine_kernel": "dcomb", "_ki_fwd_kernel": "ifwd",
                     "_ki_dq_kernel": "idq", "_ki_dkv_kernel": "idkv",
                     "_score_kernel": "sscore",
                     "_prep_kernel": "sprep", "_partition_kernel": "spart",
                     "_query_kernel": "squery", "_ranges_kernel": "lranges",
                     "_scan_kernel": "lscan", "_coarse_kernel": "lcoarse",
                     "_fill_kernel": "lfill", "_items_kernel": "litems",
                     "_blocks_kernel": "lblocks"}.get(self.name, self.name[:5])
            self.launches.append((label, _Fixed(self.kernel, num_warps, num_stages, maxnreg),
                                  args, meta))
        return launch


def capture(workload: str, dtype=torch.bfloat16, seqlen: int = 512, dropout_p: float = 0.0):
    """Run one forward + backward on CPU with every Triton launch captured, not executed
    (with attention dropout ``dropout_p``: the kernels' DROPOUT specialisations)."""
    launches = []
    drop = {}
    if dropout_p:
        if workload in ("decode", "decode-selected", "selection", "planner"):
            raise ValueError(f"the {workload} kernels have no attention dropout")
        drop = dict(dropout_p=dropout_p, dropout_rng=torch.zeros(2, dtype=torch.int64))

    def grab(name, tuned):
        def launch(grid, args, meta):
            launches.append((name + ("+net" if meta.get("CUT_ROWS") else ""), tuned, args, meta))
        return launch

    class _NoLaunch:
        def __getitem__(self, grid):
            return lambda *a, **k: None

    forward_kernel.launch_fwd = grab("fwd", forward_kernel._attn_fwd_tuned)
    forward_kernel.launch_fwd_untuned = grab("fwd", forward_kernel._attn_fwd_tuned)
    fwd_mod.sm_count = lambda device: 132  # an H100 SXM / H200
    bwd_mod._launch_dkdv = grab("dkdv", bwd_mod._dkdv_tuned)
    bwd_mod._launch_dq = grab("dq", bwd_mod._dq_tuned)
    bwd_mod._bwd_preprocess = _NoLaunch()
    # Plans then come from torch reductions (same lists; the summary kernel needs a device).
    from flash_dmattn.planning import gather_build
    from flash_dmattn.planning import plan as plan_mod

    fwd_mod.wants_summary = plan_mod.wants_summary = lambda *a: False
    # The gather plan's own kernels are captured too (their outputs stay unwritten: zero
    # totals choose gathering, which is all the rest of the capture needs).
    for kname in ("_compact_keys_kernel", "_gather_mask_bits_kernel", "_gather_bias_kernel"):
        setattr(gather_build, kname, _PlanCapture(kname, getattr(gather_build, kname), launches))
    # And a per-key mask's list planner (its plain-PyTorch twin serves CPU calls otherwise).
    from flash_dmattn.planning import key_mask_lists as klists
    from flash_dmattn.planning import tiles as tiles_mod

    klists._per_key_lists_kernel = _PlanCapture("_per_key_lists_kernel",
                                                klists._per_key_lists_kernel, launches)
    tiles_mod.per_key_lists_reference = klists.per_key_lists
    klists._interpreted = lambda device: False  # the GPU's chunk and warps

    B, H, Hkv, L, D = 1, 16, 4, seqlen, 128
    g = torch.Generator().manual_seed(0)
    if workload == "selection":
        # topk_intervals' kernels: causal calls at lengths of one to four tree levels (radix 16
        # and 32), with and without padding, and the all-kept calls of both kinds.
        from flash_dmattn.planning import selection_kernels as sel_mod

        for kname in ("_score_kernel", "_prep_kernel", "_partition_kernel", "_query_kernel"):
            setattr(sel_mod, kname, _PlanCapture(kname, getattr(sel_mod, kname), launches))
        for length, bdtype, pad in ((300, torch.float32, True), (5000, torch.bfloat16, False),
                                    (40000, torch.float64, True), (9, torch.float16, False)):
            bias = torch.randn(2, 3, length, generator=g).to(bdtype)
            padding = (torch.rand(2, length, generator=g) > 0.2) if pad else None
            sel_mod.causal_bounds(bias, padding, -1e30, 4, 2, 3)
            sel_mod.all_kept_bounds(bias, padding, 0.5, 2, 3, True)
            sel_mod.all_kept_bounds(bias, padding, 0.5, 2, 3, False)
        return launches
    if workload == "planner":
        # The key-interval planner's list kernels (flash_dmattn.planning.list_kernels) at the
        # cuda backend's tiles: under a window promise with segment items, and without a
        # promise with key blocks (its captured host wait reads an unwritten "hides nothing",
        # so the exactly sized lists' fill, which differs only in reading tile starts, is not
        # compiled).
        from flash_dmattn.planning import list_kernels as lk_mod
        from flash_dmattn.planning.key_lists import end_bucket_for, segment_capacity
        from flash_dmattn.utils.mask import topk_intervals

        for kname in ("_ranges_kernel", "_scan_kernel", "_coarse_kernel", "_fill_kernel",
                      "_blocks_kernel", "_items_kernel"):
            setattr(lk_mod, kname, _PlanCapture(kname, getattr(lk_mod, kname), launches))
        length = max(L, 4096)
        bias = torch.randn(1, Hkv, 1, length, generator=g)
        bounds = topk_intervals(bias, length // 8, is_causal=True).bounds
        w = length // 8
        args = (bounds, length, length, True, 128, 128)
        lk_mod.plan_fast(*args, True, end_bucket_for(length), capacity=w + 127,
                         segment_rows=1024, segment_capacity=segment_capacity(length, 1024, 128, w))
        lk_mod.plan_fast(*args, True, end_bucket_for(length))
        return launches
    if workload == "intervals":
        # A causal top-W key-interval call with a per-key bias: the gathering forward, dQ and
        # dK/dV kernels (the plain-PyTorch planner builds their lists on CPU).
        from flash_dmattn.backends.triton import intervals as iv_mod
        from flash_dmattn.utils.mask import topk_intervals

        for kname in ("_ki_fwd_kernel", "_ki_dq_kernel", "_ki_dkv_kernel"):
            setattr(iv_mod, kname, _PlanCapture(kname, getattr(iv_mod, kname), launches))
        iv_mod._bwd_preprocess = _NoLaunch()
        q = torch.randn(B, L, H, D, generator=g).to(dtype)
        k = torch.randn(B, L, Hkv, D, generator=g).to(dtype)
        bias = torch.randn(B, Hkv, 1, L, generator=g).to(dtype)
        bounds = topk_intervals(bias, L // 8, is_causal=True).bounds
        out, lse, plan = iv_mod.interval_forward(
            q, k, k, bias, bounds, D ** -0.5, True, 0.0,
            plan=iv_mod.plan_for(q, k, bounds, True, backward=True), **drop)
        iv_mod.interval_backward(torch.randn_like(out), q, k, k, bias, bounds, out,
                                 torch.zeros(B, H, L), D ** -0.5, True, 0.0, False,
                                 (True, True, True, True), plan=plan, **drop)
        return launches
    if workload == "decode":
        # One decode step, H32/Hkv8, per-key mask + bias, with and without a part-filled cache;
        # then without mask or bias, and paged (64-key pages: one page id per tile; 16-key
        # pages: one per key).
        from flash_dmattn.backends.triton import decode as dec_mod

        for kname in ("_decode_split_kernel", "_decode_combine_kernel"):
            setattr(dec_mod, kname, _PlanCapture(kname, getattr(dec_mod, kname), launches))
        q = torch.randn(B, 1, 32, D, generator=g).to(dtype)
        k = torch.randn(B, L, 8, D, generator=g).to(dtype)
        v = torch.randn(B, L, 8, D, generator=g).to(dtype)
        bias = torch.randn(B, 8, 1, L, generator=g).to(dtype)
        for cache in (None, torch.tensor([L // 2], dtype=torch.int32)):
            # 66 splits: what an H200 (132 SMs) runs for B1 Hkv8.
            dec_mod.decode_forward(q, k, v, bias > 0, bias, D ** -0.5, False, 0.0, cache, 66)
        dec_mod.decode_forward(q, k, v, None, None, D ** -0.5, False, 0.0, None, 66)
        for page in (64, 16):
            pages = L // page
            table = torch.randperm(B * pages, generator=g).view(B, pages).to(torch.int32)
            pool = k.reshape(B * pages, page, 8, D)
            dec_mod.decode_forward(q, pool, pool, bias > 0, bias, D ** -0.5, False, 0.0,
                                   torch.tensor([L // 2], dtype=torch.int32), 66,
                                   block_table=table)
        return launches
    if workload == "decode-selected":
        # Decoding steps over 256 selected keys per kv head (flash_dmattn.topk_decode), H32 /
        # Hkv8: a Doge step (the additive mask read as bias and visibility, one split); a
        # per-key bias with a part-filled cache in 4 splits; a per-query-head bias, causal, 2
        # queries, softcap.
        from flash_dmattn.backends.triton import decode as dec_mod
        from flash_dmattn.backends.triton import decode_selected as sel_mod

        # The combine is launched by decode's launch_split_decode for both launchers.
        for mod, kname in ((sel_mod, "_selected_split_kernel"),
                           (dec_mod, "_decode_combine_kernel")):
            setattr(mod, kname, _PlanCapture(kname, getattr(mod, kname), launches))
        q = torch.randn(B, 1, 32, D, generator=g).to(dtype)
        k = torch.randn(B, L, 8, D, generator=g).to(dtype)
        v = torch.randn(B, L, 8, D, generator=g).to(dtype)
        bias = torch.randn(B, 8, 1, L, generator=g).to(dtype)
        index = torch.stack([torch.randperm(L, generator=g)[:256] for _ in range(8)])[None]
        cache = torch.tensor([L // 2], dtype=torch.int32)
        sel_mod.selected_decode_forward(q, k, v, index, bias, D ** -0.5, False, 0.0, None,
                                        bias_floor=-1e38, num_splits=1)
        sel_mod.selected_decode_forward(q, k, v, index.to(torch.int32), bias, D ** -0.5, False,
                                        0.0, cache, num_splits=4)
        q2 = torch.randn(B, 2, 32, D, generator=g).to(dtype)
        bias2 = torch.randn(B, 32, 2, L, generator=g).to(dtype)
        sel_mod.selected_decode_forward(q2, k, v, index, bias2, D ** -0.5, True, 30.0, cache,
                                        bias_floor=-1e38, num_splits=1)
        return launches
    q = torch.randn(B, L, H, D, generator=g).to(dtype)
    k = torch.randn(B, L, Hkv, D, generator=g).to(dtype)
    v = torch.randn(B, L, Hkv, D, generator=g).to(dtype)
    causal = True
    if workload == "t2":
        bias = torch.randn(B, Hkv, 1, L, generator=g).to(dtype)
        mask = torch.rand(B, Hkv, L, L, generator=g) < 0.3
    elif workload == "per-key":
        bias = None
        mask = (torch.rand(B, 1, 1, L, generator=g) < 0.3).repeat_interleave(1, -1)
    elif workload == "full-bias":
        bias = torch.randn(B, Hkv, L, L, generator=g).to(dtype)
        mask = None
    elif workload == "dense":
        bias = mask = None
    elif workload == "varlen":
        # Packed sequences with a per-key (Hkv, total_k) mask and bias: the key-tile lists.
        lens = torch.tensor([L // 2, L // 4 + 3, L // 4 - 3])
        cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
        qv, kv, vv = q[0], k[0], v[0]
        mask = torch.rand(Hkv, L, generator=g) < 0.3
        bias = torch.randn(Hkv, L, generator=g).to(dtype)
        scale = D ** -0.5
        mx = int(lens.max())
        out, lse = forward_varlen.attention_forward_varlen(qv, kv, vv, cu, cu, mx, mx, mask, bias,
                                                           scale, causal, 0.0, **drop)
        bwd_mod.attention_backward_varlen(torch.randn_like(out), qv, kv, vv, out, lse, cu, cu,
                                          mx, mx, mask, bias, scale, causal, 0.0, True, **drop)
        return launches
    else:
        raise ValueError(workload)
    scale = D ** -0.5
    out, lse = fwd_mod.attention_forward(q, k, v, mask, bias, scale, causal, 0.0, **drop)
    bwd_mod.attention_backward(torch.randn_like(out), q, k, v, out, lse, mask, bias, scale,
                               causal, 0.0, False, bias is not None, **drop)
    return launches


_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def _ptxas_for(ptx: str) -> Path:
    """The bundled ptxas that accepts this PTX version (newer Tritons emit PTX that only
    their ``ptxas-blackwell`` reads, whatever the target)."""
    m = re.search(r"^\.version (\d+)\.(\d+)", ptx, re.M)
    newest = _BIN / "ptxas-blackwell"
    if m and int(m.group(1)) >= 9 and newest.exists():
        return newest
    return _BIN / "ptxas"


def _ptxas_report(ptx: str, arch: int) -> str:
    # A file of this run's own: runs at the same time must not read each other's PTX.
    with tempfile.TemporaryDirectory(prefix="flash_dmattn_compile_check_") as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        sm = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        res = subprocess.run([str(_ptxas_for(ptx)), "-v", f"--gpu-name={sm}", str(path), "-o",
                              "/dev/null"], capture_output=True, text=True)
    text = res.stdout + res.stderr
    regs = re.findall(r"Used (\d+) registers", text)
    spill = re.findall(r"(\d+) bytes spill stores", text)
    return f"regs {','.join(regs) or '?'} spill-stores {','.join(spill) or '?'}"


def _loop_report(ttgir: str) -> str:
    """Per ``scf.for`` of the TTGIR (outermost first): async copies, synchronous loads, layout
    conversions, branches and wgmma/mma ops in its body."""
    keys = ("async_copy_global_to_local", "tt.load ", "convert_layout", "scf.if",
            "warp_group_dot ", "tt.dot ")
    short = ("async", "load", "cvt", "if", "wgmma", "mma")
    loops, stack, depth = [], [], 0
    for line in ttgir.splitlines():
        if "scf.for" in line:
            loops.append(dict.fromkeys(short, 0))
            stack.append((len(loops) - 1, depth))
        for key, name in zip(keys, short):
            if key in line:
                for idx, _ in stack:
                    loops[idx][name] += 1
        depth += line.count("{") - line.count("}")
        while stack and depth <= stack[-1][1]:
            stack.pop()
    return " | ".join(" ".join(f"{k}={v}" for k, v in c.items() if v) for c in loops)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--workload", default="t2", choices=["t2", "dense", "per-key", "full-bias", "varlen", "decode",
                             "decode-selected", "intervals", "selection", "planner"])
    ap.add_argument("--dump", type=Path, default=None, help="write each kernel's TTGIR here")
    ap.add_argument("--seqlen", type=int, default=512,
                    help="sequence length of the captured call (divisibility by 16 changes codegen)")
    ap.add_argument("--plain-rows", default="never", choices=["never", "always"],
                    help="per-key workload: the one-kernel forward, or the two kernels of "
                         "flash_dmattn.planning.plain_rows (fwd, fwd+net)")
    ap.add_argument("--first-config", action="store_true",
                    help="compile only the first autotuning config per kernel (quick check)")
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="attention dropout of the captured call (the kernels' DROPOUT code)")
    args = ap.parse_args()
    from flash_dmattn.planning import plain_rows

    plain_rows._FORCED = args.plain_rows == "always"  # the planner's hook: one way, no lag
    target = GPUTarget("cuda", args.arch, 32)
    failures = 0
    for name, tuned, kargs, meta in capture(args.workload, seqlen=args.seqlen,
                                               dropout_p=args.dropout):
        kernel = tuned.fn
        sig, consts, attrs = _signature(kernel, kargs, meta)
        configs, prune = _configs(tuned)
        if prune is not None:
            named = dict(zip(kernel.arg_names, kargs))
            configs = prune(configs, named, **meta)
        if args.first_config:
            configs = configs[:1]
        for cfg in configs:
            opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
            if getattr(cfg, "maxnreg", None):
                opts["maxnreg"] = cfg.maxnreg
            label = f"{name:8s} w{cfg.num_warps} s{cfg.num_stages}"
            try:
                src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
                ck = triton.compile(src, target=target, options=opts)
            except Exception as exc:  # report every failing variant, then exit non-zero
                failures += 1
                print(f"{label}: COMPILE FAILED: {type(exc).__name__}: {str(exc)[:2000]}")
                continue
            smem = getattr(ck.metadata, "shared", None)
            print(f"{label}: {_ptxas_report(ck.asm['ptx'], args.arch)} smem {smem}; "
                  f"loop: {_loop_report(ck.asm['ttgir'])}")
            if args.dump:
                args.dump.mkdir(parents=True, exist_ok=True)
                (args.dump / f"{name}-w{cfg.num_warps}-s{cfg.num_stages}.ttgir").write_text(ck.asm["ttgir"])
                (args.dump / f"{name}-w{cfg.num_warps}-s{cfg.num_stages}.ptx").write_text(ck.asm["ptx"])
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
