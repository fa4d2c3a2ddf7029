"""Command line: ``python -m flash_dmattn info [--explain ...] | demo | build``."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import sys
import time

import torch

from .inputs import AttentionInputs, VarlenInputs


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
    _cache_lines()
    if not torch.cuda.is_available():
        print(
            "note: without a GPU, calls run on torch-reference (chunked plain PyTorch; flex on "
            "CPU is eager and forward only). TRITON_INTERPRET=1 runs the Triton kernels in "
            "Python on CPU tensors, to test them: far slower than torch-reference, and "
            "auto-dispatch passes over it."
        )
    return 0


def _cache_lines() -> None:
    """The cuda kernel modules this version has built (one per operation of a spec), by arch
    and spec; nothing when none are (their sources may since have changed: a call then builds
    its module again)."""
    from .backends.cuda import jit

    entries = jit.cached_entries()
    if not entries:
        return
    print(f"cuda kernel cache {jit.cache_root()}: {len(entries)} modules built")
    by_spec = {}
    for entry in entries:
        by_spec.setdefault((entry["arch"], entry["spec"]), []).append(entry["op"])
    for (arch, spec), ops in by_spec.items():
        print(f"  {arch} {spec}: {' '.join(ops)}")


_DTYPES = {"fp16": torch.float16, "float16": torch.float16, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
           "fp64": torch.float64, "float64": torch.float64}
# Broadcast shapes the --mask / --bias kinds stand for.
_AUX_KINDS = {"per-key": "B,Hkv,1,Lk", "per-query": "B,Hkv,Lq,Lk", "full": "B,H,Lq,Lk"}


def _parse_dims(text: str) -> dict:
    """``B=2,H=4,Hkv=1,Lq=100,Lk=100,D=64`` (any subset) with the defaults filled in."""
    dims = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name not in ("B", "H", "Hkv", "Lq", "Lk", "D") or not value.isdigit():
            raise ValueError(f"--shape takes B=,H=,Hkv=,Lq=,Lk=,D= (integers), got {part!r}")
        dims[name] = int(value)
    dims.setdefault("B", 1)
    dims.setdefault("H", 16)
    dims.setdefault("Hkv", dims["H"])
    dims.setdefault("Lq", 4096)
    dims.setdefault("Lk", dims["Lq"])
    dims.setdefault("D", 128)
    return dims


def _aux_shape(text: str, dims: dict, what: str) -> tuple:
    """A mask / bias shape: a kind of :data:`_AUX_KINDS` or dims such as ``B,1,Lq,Lk`` (names of
    ``--shape``'s dims or integers); 2 to 4 dims, left-padded with 1."""
    spec = _AUX_KINDS.get(text, text)
    shape = []
    for part in (p.strip() for p in spec.split(",")):
        if part in dims:
            shape.append(dims[part])
        elif part.isdigit():
            shape.append(int(part))
        else:
            raise ValueError(f"--{what} takes none, {', '.join(_AUX_KINDS)}"
                             f"{', intervals' if what == 'mask' else ''} or dims such as "
                             f"B,Hkv,1,Lk; got {text!r}")
    return tuple(shape)


def described_call(shape="", dtype="bf16", mask="none", bias="none", bias_dtype=None,
                   causal=False, softcap=0.0, train=False, bias_grad=False,
                   deterministic=False, cache_seqlens=False, device=None, capability=None,
                   varlen=False):
    """The validated inputs of a described call, on meta tensors (nothing is allocated, so a
    32K-token call describes as fast as a small one), that report ``device`` (``cpu`` or
    ``cuda``; a ``capability`` such as ``(9, 0)`` implies ``cuda``). ``varlen``: ``B``
    packed sequences of ``Lq`` / ``Lk`` tokens (``flash_dmattn_varlen_func``; a mask or bias
    is then per key, ``(Hkv, total_k)``)."""
    from .masks import KeyIntervals

    dims = _parse_dims(shape)
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype takes one of {', '.join(_DTYPES)}, got {dtype!r}")
    dt = _DTYPES[dtype]
    meta = torch.device("meta")
    B, H, Hkv, Lq, Lk, D = (dims[n] for n in ("B", "H", "Hkv", "Lq", "Lk", "D"))
    grad = bool(train or bias_grad)
    q = torch.empty(B, Lq, H, D, dtype=dt, device=meta, requires_grad=grad)
    k = torch.empty(B, Lk, Hkv, D, dtype=dt, device=meta, requires_grad=grad)
    v = torch.empty(B, Lk, Hkv, D, dtype=dt, device=meta, requires_grad=grad)
    attn_mask = attn_bias = None
    if mask == "intervals":
        bounds = torch.empty(B, Hkv, Lk, dtype=torch.int32, device=meta)
        attn_mask = KeyIntervals(bounds, bounds)
    elif mask != "none":
        attn_mask = torch.empty(_aux_shape(mask, dims, "mask"), dtype=torch.bool, device=meta)
    if bias != "none":
        bdt = _DTYPES[bias_dtype] if bias_dtype else dt
        attn_bias = torch.empty(_aux_shape(bias, dims, "bias"), dtype=bdt, device=meta,
                                requires_grad=bool(bias_grad))
    if capability is not None:
        device = "cuda"
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device takes cpu or cuda, got {device!r}")
    if varlen:
        return _described_packed(q, k, v, attn_mask, attn_bias, causal, softcap, deterministic,
                                 torch.device(device))
    lengths = torch.empty(B, dtype=torch.int32, device=meta) if cache_seqlens else None
    inputs = AttentionInputs.from_args(q, k, v, attn_mask, attn_bias, None, causal,
                                       softcap or None, deterministic, None, lengths)
    values = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)}
    return DescribedInputs(**values, described_device=torch.device(device))


def _described_packed(q, k, v, mask, bias, causal, softcap, deterministic, device):
    """The packed form of a described batch: its B sequences back to back, per-key mask / bias."""
    from .masks import KeyIntervals

    B, Lq, H, D = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    if isinstance(mask, KeyIntervals):
        raise ValueError("--varlen takes a per-key --mask (or none), not intervals")
    for name, t in (("mask", mask), ("bias", bias)):
        if t is not None and t.dim() == 4 and t.shape[2] > 1:
            raise ValueError(f"--varlen takes a per-key --{name} (packed calls have no "
                             f"per-query {name}), got {tuple(t.shape)}")

    def packed(t, length, heads):
        return torch.empty(B * length, heads, D, dtype=t.dtype, device=t.device,
                           requires_grad=t.requires_grad)

    def per_key(t):
        if t is None:
            return None
        return torch.empty(t.shape[1], B * Lk, dtype=t.dtype, device=t.device,
                           requires_grad=t.requires_grad)

    cu = torch.empty(B + 1, dtype=torch.int32, device=q.device)
    inputs = VarlenInputs.from_args(packed(q, Lq, H), packed(k, Lk, Hkv), packed(v, Lk, Hkv),
                                    cu, cu, Lq, Lk, per_key(mask), per_key(bias), None, causal,
                                    softcap or None, deterministic)
    values = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)}
    return DescribedVarlenInputs(**values, described_device=device)


@dataclasses.dataclass(frozen=True)
class DescribedInputs(AttentionInputs):
    """A described call: meta tensors that report the device the call is described on."""

    described_device: torch.device = torch.device("cpu")

    @property
    def device(self) -> torch.device:
        return self.described_device


@dataclasses.dataclass(frozen=True)
class DescribedVarlenInputs(VarlenInputs):
    """A described packed call: meta tensors that report the device it is described on."""

    described_device: torch.device = torch.device("cpu")

    @property
    def device(self) -> torch.device:
        return self.described_device


def explain(args) -> int:
    """``info --explain``: which backend auto-dispatch takes for the described call, and why
    each other backend was not taken (declined, passed over by the policy, or ranked after)."""
    import contextlib

    from . import policy, registry

    if args.rules:
        print(policy.table())
        return 0
    capability = None
    if args.capability:
        major, _, minor = args.capability.partition(".")
        if not (major.isdigit() and (minor or "0").isdigit()):
            print(f"flash_dmattn info: --capability takes MAJOR.MINOR such as 9.0, got "
                  f"{args.capability!r}", file=sys.stderr)
            return 2
        capability = (int(major), int(minor or 0))
    try:
        inputs = described_call(args.shape, args.dtype, args.mask, args.bias, args.bias_dtype,
                                args.causal, args.softcap, args.train, args.bias_grad,
                                args.deterministic, args.cache_seqlens, args.device, capability,
                                args.varlen)
    except (ValueError, TypeError) as exc:
        print(f"flash_dmattn info: {exc}", file=sys.stderr)
        return 2
    here = inputs.device.type == "cpu" or (torch.cuda.is_available() and capability is None)
    scope = (policy.simulated_capability(capability) if capability is not None
             else contextlib.nullcontext())
    with scope:
        if inputs.device.type == "cuda" and capability is None and not torch.cuda.is_available():
            print("flash_dmattn info: --device cuda on a machine without a GPU needs "
                  "--capability (e.g. 9.0 for Hopper)", file=sys.stderr)
            return 2
        result = registry.explain(inputs, assume_available=not here)
    print(f"described: {inputs.describe().replace('meta', inputs.device.type)}")
    if not here:
        print("(a GPU this machine does not have: backends are assumed installed; their "
              "availability here is not checked)")
    for line in result.lines():
        print(line)
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


# The Triton interpreter runs each kernel program in Python: minutes at the demo's CPU size.
# Interpreted backends get a problem of their own this small, which takes seconds.
INTERPRETER_SEQLEN = 64


class _Problem:
    """One dynamic-mask attention call and its float64 answer."""

    def __init__(self, device, dtype, batch, seqlen, heads, kv_heads, head_dim):
        from .reference import reference_attention
        from .utils.mask import topk_intervals

        self.shape = (batch, seqlen, heads, kv_heads, head_dim)
        self.dtype = dtype
        gen = torch.Generator(device=device).manual_seed(0)
        self.q = torch.randn(batch, seqlen, heads, head_dim, device=device, dtype=dtype, generator=gen)
        self.k = torch.randn(batch, seqlen, kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
        self.v = torch.randn(batch, seqlen, kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
        # A dynamic-mask layer's per-key bias and its selection: each query keeps the top-`window`
        # keys of its causal prefix, as key intervals (O(L) numbers, as DynamicMaskAttention
        # builds them).
        self.window = max(seqlen // 8, 1)
        self.bias = torch.randn(batch, kv_heads, 1, seqlen, device=device, dtype=dtype, generator=gen)
        self.mask = topk_intervals(self.bias, self.window, is_causal=True)
        self.exact, _ = reference_attention(
            self.q.double(), self.k.double(), self.v.double(), self.mask.to_dense(seqlen),
            self.bias.double(), head_dim ** -0.5, True, 0.0,
        )

    def describe(self) -> str:
        b, length, h, hkv, d = self.shape
        return (
            f"B={b} L={length} H={h} Hkv={hkv} D={d} {str(self.dtype).replace('torch.', '')}, "
            f"per-key bias {tuple(self.bias.shape)}, causal top-{self.window} per query as "
            f"KeyIntervals {self.mask.shape}"
        )

    def inputs(self, *tensors):
        from .inputs import AttentionInputs

        q, k, v, bias = tensors or (self.q, self.k, self.v, self.bias)
        return AttentionInputs.from_args(q, k, v, self.mask, bias, is_causal=True)


def _backend_row(name: str, prob: _Problem, device: torch.device, repeats: int) -> None:
    """Time one backend's forward and forward + backward on ``prob``; print its row.

    The backend's name is printed first, so a slow backend shows which one is running."""
    from . import flash_dmattn_func_auto, registry

    print(f"{name:<16}", end=" ", flush=True)
    fn = flash_dmattn_func_auto(name)
    backend = registry.get_backend(name)
    q, k, v, bias, mask = prob.q, prob.k, prob.v, prob.bias, prob.mask
    reasons = backend.not_supported_reasons(prob.inputs())
    if reasons:
        print(f"{'-':>9} {'-':>11} {'-':>10}  declined: {'; '.join(reasons)}", flush=True)
        return
    with torch.no_grad():
        out = fn(q, k, v, mask, bias, is_causal=True)
        fwd = _time_ms(lambda: fn(q, k, v, mask, bias, is_causal=True), device, repeats)
    err = (out.double() - prob.exact).abs().max().item()
    print(f"{fwd:>9.3f}", end=" ", flush=True)
    qg, kg, vg, bg = (t.detach().requires_grad_() for t in (q, k, v, bias))
    grad_reasons = backend.not_supported_reasons(prob.inputs(qg, kg, vg, bg))
    if grad_reasons:
        bwd, note = "-", f"no backward: {'; '.join(grad_reasons)}"
    else:
        def step():
            o = fn(qg, kg, vg, mask, bg, is_causal=True)
            torch.autograd.grad(o, (qg, kg, vg, bg), torch.ones_like(o))

        bwd, note = f"{_time_ms(step, device, repeats):.3f}", ""
    print(f"{bwd:>11} {err:>10.2e}  {note}", flush=True)


def _interpreted(name: str, device: torch.device) -> bool:
    """Whether ``name`` runs its kernels through the Triton interpreter here (a testing aid)."""
    return name == "triton" and device.type == "cpu"


def demo(seqlen: int = 0, repeats: int = 0) -> int:
    """Run every available backend on one dynamic-mask problem; print time and error.

    Backends that run interpreted on this machine (Triton under ``TRITON_INTERPRET=1`` on CPU)
    are testing aids: they run on a problem of ``INTERPRETER_SEQLEN`` tokens instead, in a
    table of their own, so the demo finishes in seconds wherever it runs."""
    from . import flash_dmattn_func_auto, get_available_backends, registry

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    repeats = repeats or (20 if on_gpu else 3)
    print(f"device: {_device_line()}", flush=True)
    prob = _Problem(device, dtype, 2, seqlen or (4096 if on_gpu else 512), 8, 2, 64)
    print(f"problem: {prob.describe()}")
    header = f"{'backend':<16} {'fwd ms':>9} {'fwd+bwd ms':>11} {'max |err|':>10}  note"
    print(header, flush=True)
    names = get_available_backends()
    for name in names:
        if not _interpreted(name, device):
            _backend_row(name, prob, device, repeats)
    with torch.no_grad():
        out = flash_dmattn_func_auto(None)(prob.q, prob.k, prob.v, prob.mask, prob.bias, is_causal=True)
    picked = registry.select_backend(prob.inputs())
    print(
        f"flash_dmattn_func picks {picked.name!r} here; output max |err| "
        f"{(out.double() - prob.exact).abs().max().item():.2e}"
    )
    aids = [name for name in names if _interpreted(name, device)]
    if aids:
        small = _Problem(device, dtype, 1, INTERPRETER_SEQLEN, 2, 1, 32)
        print(
            f"testing aids (kernels interpreted in Python on CPU tensors, TRITON_INTERPRET=1; "
            f"not for use), on a small problem: {small.describe()}"
        )
        print(header, flush=True)
        for name in aids:
            _backend_row(name, small, device, 1)
    return 0


def build_targets(specs, build_all: bool = False, ops=None):
    """``[(KernelSpec, op), ...]`` that ``build`` means: each spec named (``SPEC`` or
    ``SPEC:OP[,OP]``), else every spec with ``build_all``, each with the operations its name
    gives, else ``ops``, else every operation (fwd, bwd, decode). ``ValueError`` says what is
    wrong."""
    from .backends.cuda import jit
    from .backends.cuda.spec import KernelSpec, all_specs

    default_ops = tuple(jit.check_op(op) for op in ops) if ops else jit.OPS
    named = []
    for text in specs:
        name, sep, op_list = text.partition(":")
        spec_ops = tuple(jit.check_op(op.strip()) for op in op_list.split(",")) if sep else None
        named.append((KernelSpec.parse(name), spec_ops or default_ops))
    if not specs and build_all:
        named = [(spec, default_ops) for spec in all_specs()]
    targets = []
    for spec, spec_ops in named:
        for op in jit.OPS:  # in the operations' order, each once
            if op in spec_ops and (spec, op) not in targets:
                targets.append((spec, op))
    return targets


def build(specs, build_all: bool = False, list_only: bool = False, ops=None,
          jobs: int = 0) -> int:
    """Prebuild CUDA kernel modules into the on-disk cache (``--all`` or named specs), one per
    operation of a spec: every operation, or those ``SPEC:OP[,OP]`` or ``--op`` select.

    ``--list`` prints the specs (those named, else every one ``--all`` means), each with the
    operations selected when not all are, and builds nothing. ``jobs`` modules build side by
    side (default: one per operation), each with ``$MAX_JOBS`` compiles. Exit status: 0 done,
    1 a build failed, 2 bad arguments or the cuda backend is unavailable here (the reason is
    printed, no traceback).
    """
    import concurrent.futures

    from . import registry
    from .backends.cuda import jit

    if build_all and specs:
        print("flash_dmattn build: give --all or spec names, not both", file=sys.stderr)
        return 2
    try:
        targets = build_targets(specs, True, ops)
    except ValueError as exc:
        print(f"flash_dmattn build: {exc}", file=sys.stderr)
        return 2
    if list_only:
        by_spec = {}
        for spec, op in targets:
            by_spec.setdefault(spec, []).append(op)
        for spec, spec_ops in by_spec.items():
            print(spec.name if tuple(spec_ops) == jit.OPS else f"{spec.name}:{','.join(spec_ops)}")
        return 0
    if not (build_all or specs):
        print("flash_dmattn build: name specs (e.g. d128-bf16-mask-bias or "
              "d128-bf16-mask-bias:fwd), --all or --list", file=sys.stderr)
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

    def build_one(target):
        spec, op = target
        cached = jit.is_built(spec, op, tc)
        start = time.perf_counter()
        jit.load_kernel(spec, op, tc)
        return "already built" if cached else f"built in {time.perf_counter() - start:.1f} s"

    failures = 0
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs or len(jit.OPS))) as pool:
        futures = [(target, pool.submit(build_one, target)) for target in targets]
        for (spec, op), future in futures:
            try:
                took = future.result()
            except Exception as exc:  # report every module's failure, then exit 1
                failures += 1
                print(f"{spec.name} {op}: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            print(f"{spec.name} {op}: {took}", flush=True)
    print(f"{len(targets) - failures}/{len(targets)} kernel modules ready for {tc.arch} "
          f"in {jit.cache_root()}")
    return 1 if failures else 0


def main(argv=None) -> int:
    from .backends.cuda.jit import OPS

    parser = argparse.ArgumentParser(prog="python -m flash_dmattn")
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="list backends, availability and the device; "
                                         "--explain: which backend auto takes for a call, why")
    p_info.add_argument("--explain", action="store_true",
                        help="describe a call with the flags below; print the dispatch rule, "
                             "the backend auto takes and why each other one was not taken")
    p_info.add_argument("--rules", action="store_true", help="with --explain: print the table")
    p_info.add_argument("--shape", default="", help="B=,H=,Hkv=,Lq=,Lk=,D= (defaults B1 H16 "
                                                    "Hkv=H Lq4096 Lk=Lq D128)")
    p_info.add_argument("--dtype", default="bf16", help="bf16 | fp16 | fp32 | fp64")
    p_info.add_argument("--mask", default="none",
                        help="none | per-key | per-query | full | intervals | dims such as "
                             "B,Hkv,1,Lk")
    p_info.add_argument("--bias", default="none",
                        help="none | per-key | per-query | full | dims such as 1,1,Lq,Lk")
    p_info.add_argument("--bias-dtype", default=None, help="the bias's dtype (default: --dtype)")
    p_info.add_argument("--causal", action="store_true")
    p_info.add_argument("--softcap", type=float, default=0.0)
    p_info.add_argument("--train", action="store_true", help="q, k, v need gradients")
    p_info.add_argument("--bias-grad", action="store_true", help="the bias needs a gradient")
    p_info.add_argument("--deterministic", action="store_true")
    p_info.add_argument("--cache-seqlens", action="store_true", help="a KV cache's used lengths")
    p_info.add_argument("--varlen", action="store_true",
                        help="B packed sequences (flash_dmattn_varlen_func); per-key mask / bias")
    p_info.add_argument("--device", default=None, help="cpu | cuda (default: this machine's)")
    p_info.add_argument("--capability", default=None,
                        help="a GPU generation, e.g. 9.0 (Hopper), 8.0 (Ampere), 10.0: "
                             "describe the call on it (implies --device cuda)")
    p_demo = sub.add_parser("demo", help="run every available backend on a small problem")
    p_demo.add_argument("--seqlen", type=int, default=0)
    p_demo.add_argument("--repeats", type=int, default=0)
    p_build = sub.add_parser("build", help="prebuild cuda kernel modules (one per operation "
                                           "of a specialisation)")
    p_build.add_argument("specs", nargs="*", metavar="SPEC[:OP,...]",
                         help="e.g. d128-bf16-mask-bias (every operation) or "
                              "d128-bf16-mask-bias:fwd")
    p_build.add_argument("--all", action="store_true", help="every specialisation")
    p_build.add_argument("--op", action="append", choices=OPS,
                         help="only this operation of specs named without one (repeatable; "
                              "default: fwd, bwd and decode)")
    p_build.add_argument("--jobs", type=int, default=0,
                         help="modules built side by side (default 3; each runs $MAX_JOBS "
                              "compiles)")
    p_build.add_argument("--list", action="store_true", help="print the specs, build nothing")
    args = parser.parse_args(argv)
    if args.command == "info":
        return explain(args) if (args.explain or args.rules) else info()
    if args.command == "build":
        return build(args.specs, args.all, args.list, args.op, args.jobs)
    return demo(args.seqlen, args.repeats)


if __name__ == "__main__":
    sys.exit(main())
