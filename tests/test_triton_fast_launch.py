"""The direct launch of cached compiled kernels (flash_dmattn.triton_launch).

On a GPU a launch signature's first launch takes Triton's normal path and later ones call the
compiled kernel's launcher directly. Here (CPU) that is checked with Triton's own
specialisation function (the signature must tell apart every two argument lists Triton
compiles differently), with a JITFunction whose compile-and-launch is recorded (what the
direct launch passes, when it is taken and when the normal path is), and under the
interpreter, where every launch takes the normal path and computes what it always did.
"""
import pytest
import torch

from interpreter_only import needs_triton, triton_kernels_skip_reason

pytestmark = needs_triton


def _native_spec():
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:  # Triton before 3.4, where the direct launch path stays off
        pytest.skip("this Triton (before 3.4) has no native_specialize_impl to compare with; "
                    "launch.py keeps Triton's own launch path there")
    return lambda a: native_specialize_impl(BaseBackend, a, False, True, True)


def _values():
    base = torch.zeros(64, dtype=torch.float32)
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 1024, 1088, 1089,
            2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31), -(2**31) - 1, -(2**31) - 16,
            2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 16]
    tensors = [base, base[1:], base[4:], base.to(torch.bfloat16), base.to(torch.bfloat16)[8:],
               base.to(torch.int32), base.to(torch.uint8)[1:]]
    return ints + [0.0, 1.0, 0.5, True, False, None] + tensors


def test_signature_separates_what_triton_specialises_apart():
    from flash_dmattn.triton_launch import _arg_spec

    native = _native_spec()
    values = _values()
    for a in values:
        for b in values:
            if native(a) != native(b):
                assert _arg_spec((a,)) != _arg_spec((b,)), (a, b, native(a), native(b))
    # An argument type the signature does not model: no signature (Triton's path every time).
    assert _arg_spec((1, torch.int32)) is None


class _Compiled:
    """What JITFunction.run returns: a compiled kernel (for the arguments' specialisation and
    ``meta``) whose launcher records its calls."""

    def __init__(self, log, meta):
        self.function, self.packed_metadata = "function", "metadata"
        self.log, self.meta = log, meta

    def run(self, *args):
        self.log.append(("direct", args, tuple(self.meta.items())))


@pytest.fixture
def recorded(monkeypatch):
    """A real JITFunction whose compile-and-launch (``JITFunction.run``) is recorded, a
    stand-in for Triton's driver (device 3, stream 77), and an empty launch cache."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    from flash_dmattn import triton_launch as launch_mod

    def kernel(X, Y, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr):
        pass

    jit = JITFunction(kernel)
    log = []
    compiled = {}

    def run(*args, grid, warmup, **meta):
        log.append(("triton", grid, args, meta))
        key = (tuple(a.data_ptr() % 16 if isinstance(a, torch.Tensor) else a for a in args),
               tuple(meta.items()))
        return compiled.setdefault(key, _Compiled(log, dict(meta)))

    monkeypatch.setattr(jit, "run", run)

    class Driver:
        def get_current_device(self):
            return 3

        def get_current_stream(self, device):
            return 77 if device == 3 else None

    monkeypatch.setattr(launch_mod, "driver", type("Cfg", (), {"active": Driver()})())
    cache = launch_mod.LaunchCache()
    return jit, cache, log


def test_first_launch_takes_triton_then_the_compiled_kernel_directly(recorded):
    jit, cache, log = recorded
    x = torch.zeros(64)
    meta = dict(BLOCK=16, FLAG=True, num_warps=4)
    cache.launch(jit, (5, 2), (x, x, 32, 0.5), meta)
    assert [e[0] for e in log] == ["triton"]
    y = x.clone()
    cache.launch(jit, (5, 2), (y, x, 48, 0.25), meta)
    # grid padded to 3-D, the current stream, the kernel's handles, no launch metadata or
    # hooks, then every parameter in order: the runtime arguments and the trailing constexprs.
    kind, args, _ = log[-1]
    assert kind == "direct"
    assert args[:9] == (5, 2, 1, 77, "function", "metadata", None, None, None)
    assert args[9] is y and args[10] is x and args[11:] == (48, 0.25, 16, True)
    assert len(cache.entries(jit)) == 1


def seen_by_direct(entry):
    """What a recorded direct launch passed: the first tensor's alignment and dtype, the
    runtime scalars, and (from the compiled kernel it used) the meta it was compiled for."""
    args = entry[1][9:]
    return (args[0].data_ptr() % 16, args[0].dtype, tuple(args[2:4]), entry[2])


@pytest.mark.parametrize("what", ["alignment", "divisibility", "one", "width", "dtype", "meta",
                                  "meta type", "meta order", "options", "float for int",
                                  "bool for int"])
def test_a_launch_triton_would_specialise_apart_takes_its_path(recorded, what):
    jit, cache, log = recorded
    x = torch.zeros(64)
    meta = dict(BLOCK=16, FLAG=True, num_warps=4)
    args = (x, x, 32, 0.5)
    cache.launch(jit, (1,), args, meta)
    changed = {
        "alignment": ((x[1:], x, 32, 0.5), meta),
        "divisibility": ((x, x, 33, 0.5), meta),
        "one": ((x, x, 1, 0.5), meta),
        "width": ((x, x, 2**32, 0.5), meta),
        "dtype": ((x.half(), x, 32, 0.5), meta),
        "meta": (args, dict(meta, BLOCK=32)),
        "meta type": (args, dict(meta, FLAG=1)),
        "meta order": (args, dict(num_warps=4, BLOCK=16, FLAG=True)),
        "options": (args, dict(meta, num_warps=8)),
        "float for int": ((x, x, 32.0, 0.5), meta),
        "bool for int": ((x, x, 32, True), meta),
    }[what]
    cache.launch(jit, (1,), *changed)
    assert [e[0] for e in log] == ["triton", "triton"]
    cache.launch(jit, (1,), *changed)
    assert [e[0] for e in log] == ["triton", "triton", "direct"]
    # Back and forth: each launch finds its own signature's compiled kernel.
    for launch_args in ((args, meta), changed, (args, meta)):
        cache.launch(jit, (1,), *launch_args)
        assert log[-1][0] == "direct"
        a, m = launch_args
        assert seen_by_direct(log[-1]) == (a[0].data_ptr() % 16, a[0].dtype, a[2:],
                                           tuple(m.items()))
        assert [type(v) for v in seen_by_direct(log[-1])[2]] == [type(v) for v in a[2:]]


def test_hooks_and_unmodelled_launches_keep_triton_path(recorded, monkeypatch):
    from triton import knobs

    jit, cache, log = recorded
    x = torch.zeros(64)
    meta = dict(BLOCK=16, FLAG=True)
    # A parameter left to Triton (missing here: Triton would fill a default or raise).
    for _ in range(2):
        cache.launch(jit, (1,), (x, x, 32, 0.5), dict(BLOCK=16))
    # An argument type the signature does not model.
    for _ in range(2):
        cache.launch(jit, (1,), (x, x, 32, torch.float32), meta)
    assert [e[0] for e in log] == ["triton"] * 4
    cache.launch(jit, (1,), (x, x, 32, 0.5), meta)
    cache.launch(jit, (1,), (x, x, 32, 0.5), meta)
    assert log[-1][0] == "direct"
    # A launch hook (a profiler): the normal path, which builds the launch metadata.
    hook = knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):
        hook.add(lambda metadata: None)
        added = hook.calls[-1]
        try:
            cache.launch(jit, (1,), (x, x, 32, 0.5), meta)
        finally:
            hook.remove(added)
        assert log[-1][0] == "triton"
    # Pre-run hooks on the kernel: the normal path.
    monkeypatch.setattr(jit, "pre_run_hooks", [lambda *a, **k: None])
    cache.launch(jit, (1,), (x, x, 32, 0.5), meta)
    assert log[-1][0] == "triton"


def test_the_cache_is_bounded_and_clears(recorded, monkeypatch):
    jit, cache, log = recorded
    monkeypatch.setattr(type(cache), "MAX_ENTRIES", 2)
    x = torch.zeros(64)
    for block in (16, 32, 64):
        cache.launch(jit, (1,), (x, x, 32, 0.5), dict(BLOCK=block, FLAG=True))
    assert len(cache.entries(jit)) == 1  # emptied at the bound, then refilled
    cache.clear()
    assert cache.entries(jit) == {}


def test_interpreter_launches_take_triton_path_and_compute_the_same():
    reason = triton_kernels_skip_reason()
    if reason is not None or torch.cuda.is_available():
        pytest.skip(reason or "the interpreter runs on CPU-only machines here; on a GPU "
                    "test_direct_launches_on_the_gpu_equal_triton_path runs instead")
    from flash_dmattn.backends.triton import decode
    from flash_dmattn.triton_launch import LAUNCHES

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 4, 32, generator=g)
    k = torch.randn(2, 70, 2, 32, generator=g)
    v = torch.randn(2, 70, 2, 32, generator=g)
    outs = [decode.decode_forward(q, k, v, None, None, 0.2, False, 0.0, num_splits=splits)
            for splits in (1, 3)]
    assert LAUNCHES.entries(decode._decode_split_kernel) == {}
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, 2)) * 0.2
    ref = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.repeat_interleave(2, 2))
    for out, lse in outs:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lse, s.logsumexp(-1), rtol=1e-4, atol=1e-4)
        assert lse.shape == (2, 4, 1)


@pytest.mark.gpu
def test_direct_launches_on_the_gpu_equal_triton_path():
    # The compiled counterpart of the test above: the first call of a signature goes through
    # Triton's launch (and fills the cache), the next one launches the compiled kernels
    # directly; the decode kernels are deterministic, so both give the same bits.
    from flash_dmattn.backends.triton import decode
    from flash_dmattn.triton_launch import LAUNCHES

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(4, 1, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(4, 1088, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(4, 1088, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    for splits in (1, 4):
        LAUNCHES.clear()
        first = decode.decode_forward(q, k, v, None, None, 0.1, False, 0.0, num_splits=splits)
        assert LAUNCHES.entries(decode._decode_split_kernel) != {}
        again = decode.decode_forward(q, k, v, None, None, 0.1, False, 0.0, num_splits=splits)
        for a, b in zip(first, again):
            assert torch.equal(a, b), splits


# The planner's launches (flash_dmattn.planning, backend-neutral: the cuda and flex backends
# plan with it too) go through the same direct launch. It is only taken for a launch that
# passes every kernel parameter: the runtime ones positionally, the constexprs by keyword.

LAUNCH_OPTIONS = {"num_warps", "num_stages", "num_ctas", "maxnreg"}


def _planner_kernels():
    """``{name: kernel}`` of every Triton kernel the planner launches (its modules' jit
    functions named ``*_kernel``; helpers called from inside kernels are not launched)."""
    import importlib
    import pkgutil

    import flash_dmattn.planning as planning

    found = {}
    for info in pkgutil.iter_modules(planning.__path__):
        module = importlib.import_module(f"flash_dmattn.planning.{info.name}")
        for name, obj in vars(module).items():
            if name.endswith("_kernel") and hasattr(obj, "arg_names") and hasattr(obj, "run"):
                found[name] = obj
    return found


def _constexpr_names(kernel) -> set:
    params = getattr(kernel, "params", None)
    if params and hasattr(params[0], "is_constexpr"):  # a JITFunction
        return {p.name for p in params if p.is_constexpr}
    import inspect  # the interpreter's kernels: the annotations (strings under PEP 563)

    return {name for name, p in inspect.signature(kernel.fn).parameters.items()
            if "constexpr" in str(p.annotation)}


def launch_problems(kernel, args, meta) -> list:
    """Why a launch would not take the direct path, or could take it wrongly (empty: it
    passes every parameter as the direct path needs)."""
    from flash_dmattn import triton_launch

    names = list(kernel.arg_names)
    constexprs = _constexpr_names(kernel)
    runtime = [n for n in names if n not in constexprs]
    problems = []
    if names[:len(args)] != runtime:
        problems.append(f"positional arguments {len(args)}, runtime parameters {runtime}")
    missing = [n for n in names[len(args):] if n not in meta]
    if missing:
        problems.append(f"not passed: {missing}")
    unknown = set(meta) - set(names) - LAUNCH_OPTIONS
    if unknown:
        problems.append(f"unknown keywords: {sorted(unknown)}")
    if "num_warps" not in meta:
        problems.append("num_warps left to Triton's default")
    if triton_launch._arg_spec(tuple(args)) is None:
        problems.append("an argument type the launch signature does not model: "
                        f"{[type(a).__name__ for a in args]}")
    stand_in = type("Compiled", (), {"run": None, "function": None, "packed_metadata": None})()
    if not problems and triton_launch._entry_for(kernel, stand_in, tuple(args), meta) is None:
        problems.append("the direct path's own check turns it down")
    return problems


class PlannerLaunches:
    """What :func:`planner_launches` saw: the planner's kernels by name, launches per kernel,
    the problems found, and (with ``snapshots`` a list) every planner launch's tensor
    arguments as the kernel left them. ``triton_path``: launch through ``kernel[grid]``
    instead of the launch cache."""

    def __init__(self, kernels):
        self.kernels = kernels
        self.seen, self.problems = {}, []
        self.snapshots = None
        self.triton_path = False


@pytest.fixture
def planner_launches(monkeypatch):
    """Every planner launch checked (:func:`launch_problems`) and recorded by kernel name; a
    planner kernel started other than through ``triton_launch.launch`` fails the test."""
    from flash_dmattn import triton_launch

    kernels = _planner_kernels()
    names = {id(k): name for name, k in kernels.items()}
    state = PlannerLaunches(kernels)
    inside = []
    real = triton_launch.LAUNCHES

    class Checked:
        def launch(self, kernel, grid, args, meta):
            name = names.get(id(kernel))
            if name is not None:
                state.seen[name] = state.seen.get(name, 0) + 1
                state.problems.extend(f"{name}: {p}" for p in launch_problems(kernel, args, meta))
            inside.append(kernel)
            try:
                if state.triton_path:
                    kernel[grid](*args, **meta)
                else:
                    real.launch(kernel, grid, args, meta)
            finally:
                inside.pop()
            if name is not None and state.snapshots is not None:
                state.snapshots.append((name, [a.clone() for a in args
                                               if isinstance(a, torch.Tensor)]))

        def entries(self, kernel):
            return real.entries(kernel)

        def clear(self):
            real.clear()

    for name, kernel in kernels.items():
        def run(*args, _kernel=kernel, _name=name, _run=kernel.run, **kwargs):
            if not inside or inside[-1] is not _kernel:
                state.problems.append(f"{_name}: launched without triton_launch.launch")
            return _run(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", run)
    monkeypatch.setattr(triton_launch, "LAUNCHES", Checked())
    return state


def test_the_launch_check_sees_what_the_direct_path_needs():
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    def kernel(X, n, BLOCK: tl.constexpr, FLAG: tl.constexpr):
        pass

    jit = JITFunction(kernel)
    x = torch.zeros(4)
    assert launch_problems(jit, (x, 3), dict(BLOCK=16, FLAG=True, num_warps=4)) == []
    assert "not passed" in launch_problems(jit, (x, 3), dict(BLOCK=16, num_warps=4))[0]
    assert "positional" in launch_problems(jit, (x, 3, 16), dict(FLAG=True, num_warps=4))[0]
    assert "num_warps" in launch_problems(jit, (x, 3), dict(BLOCK=16, FLAG=True))[0]
    assert "unknown" in launch_problems(jit, (x, 3), dict(BLOCK=16, FLAG=True, num_warps=4,
                                                          BLOK=2))[0]
    assert "model" in launch_problems(jit, (x, torch.int32),
                                      dict(BLOCK=16, FLAG=True, num_warps=4))[0]


def _planner_calls(device):
    """Planner work through its public paths (and, where the triton backend does not plan
    with them, its entry points): the causal and all-kept selections (fp32 and a 16-bit bias),
    key-interval forwards and backwards (window promise: capacity lists and segment items;
    no promise: exact lists and key blocks), a per-key mask's forward, a per-query (top-k)
    mask's forward (mask summary, gather plan, compacted tile lists), a per-key mask's lists
    with bits, the gather plan from key bits and from mask bytes with a per-key bias, and
    the summary's byte-wise kernel. Returns what they gave."""
    import flash_dmattn as fd
    from flash_dmattn import KeyIntervals
    from flash_dmattn.planning.gather import plan_key_gather
    from flash_dmattn.planning.key_lists import plan_intervals
    from flash_dmattn.planning.key_mask_lists import per_key_lists
    from flash_dmattn.planning.mask_summary import summarize_mask
    from flash_dmattn.utils.mask import create_mask, topk_intervals

    g = torch.Generator().manual_seed(0)
    out = {}
    B, H, Hkv, L, D = 1, 2, 1, 80, 16
    bias = torch.randn(B, Hkv, 1, L, generator=g)
    out["sel"] = topk_intervals(bias.to(device), 24, is_causal=True).bounds
    out["sel16"] = topk_intervals(bias.to(device, torch.bfloat16), 24, is_causal=True).bounds
    out["kept"] = topk_intervals(bias.to(device), L, is_causal=True).bounds
    out["kept_nc"] = topk_intervals(bias.to(device), L, is_causal=False).bounds
    sel = KeyIntervals.from_bounds(out["sel"], 24)
    for name, window in (("fwd_w", 24), ("fwd", None)):
        bounds = out["sel"]
        plan = plan_intervals(bounds, L, L, True, 16, 16, True, window=window,
                              segment_rows=32 if window else None)
        out[f"plan_{name}"] = plan
    # The Triton kernels take 16-bit inputs on a GPU (the interpreter runs float32).
    dt = torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    q = torch.randn(B, L, H, D, generator=g).to(device, dt).requires_grad_()
    k = torch.randn(B, L, Hkv, D, generator=g).to(device, dt).requires_grad_()
    v = torch.randn(B, L, Hkv, D, generator=g).to(device, dt).requires_grad_()
    o = fd.triton_dmattn_func(q, k, v, attn_mask=sel, attn_bias=bias.to(device, dt),
                              is_causal=True)
    o.sum().backward()
    out["ki_out"] = o.detach()
    per_key = create_mask(bias, window_size=24).to(device)
    out["pk_out"] = fd.triton_dmattn_func(q.detach(), k.detach(), v.detach(),
                                          attn_mask=per_key, is_causal=True)
    # A per-key mask's lists with their tiles' bits, at a key tile every device plans with.
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    out["pk_lists"] = per_key_lists(per_key, L, L, True, 16, 64, True, flag) + (flag,)
    per_query_bias = torch.randn(B, Hkv, L, L, generator=g)
    per_query = create_mask(per_query_bias, window_size=12).to(device)
    out["pq_out"] = fd.triton_dmattn_func(q.detach(), k.detach(), v.detach(),
                                          attn_mask=per_query, is_causal=True)
    # The gather plan from key bits (the cuda backend's summaries) with a per-key bias.
    Lg = 128
    mask = create_mask(torch.randn(B, Hkv, Lg, Lg, generator=g), window_size=20).to(device)
    summary = summarize_mask(mask, 64, 64, True, key_bits=True)
    key_bias = torch.randn(B, Hkv, 1, Lg, generator=g).to(device)
    out["gather_kb"] = plan_key_gather(mask, key_bias, Lg, Lg, H, True, 64, 64,
                                       policy="always", summary=summary)
    # And from the mask's bytes.
    out["gather_mb"] = plan_key_gather(mask, key_bias, Lg, Lg, H, True, 64, 64,
                                       policy="always")
    # The summary's byte-wise kernel (keys not a multiple of 4: no word view).
    odd = create_mask(torch.randn(B, Hkv, 30, 30, generator=g), window_size=5).to(device)
    out["summary_odd"] = summarize_mask(odd, 16, 16, True)
    return out


def test_every_planner_launch_passes_every_kernel_parameter(planner_launches):
    reason = triton_kernels_skip_reason()
    if reason is not None or torch.cuda.is_available():
        pytest.skip(reason or "on a GPU test_planner_direct_launches_on_the_gpu_equal_triton_path "
                    "runs the planner instead")
    state = planner_launches
    _planner_calls(torch.device("cpu"))
    assert not state.problems, "\n".join(state.problems)
    # Every planner kernel ran (through launch), so every launch site was checked.
    assert sorted(set(state.kernels) - set(state.seen)) == []
    from flash_dmattn.triton_launch import LAUNCHES

    # The interpreter keeps Triton's own path: nothing cached.
    assert all(LAUNCHES.entries(k) == {} for k in state.kernels.values())


def _assert_same(a, b, where="result"):
    """``a`` and ``b`` equal bit for bit: tensors, and tensors inside plans (dataclasses,
    objects with ``__dict__`` or ``__slots__``), tuples, lists and dicts."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif hasattr(a, "__dict__") or hasattr(type(a), "__slots__"):
        assert type(a) is type(b), where
        fields = set(getattr(a, "__dict__", {})) | set(getattr(type(a), "__slots__", ()))
        for name in sorted(fields):
            _assert_same(getattr(a, name, None), getattr(b, name, None), f"{where}.{name}")
    else:
        assert a == b, where


@pytest.mark.gpu
def test_planner_direct_launches_on_the_gpu_equal_triton_path(planner_launches, monkeypatch):
    # The planner's work (selection bounds, interval lists, mask summaries, tile, per-key and
    # gather lists) through Triton's own launch path, then twice through the launch cache
    # (its first launch of each signature takes Triton's path and fills the cache, the second
    # calls the compiled kernels directly): every planner launch leaves the same tensors and
    # the planner returns the same bounds and lists, bit for bit.
    from flash_dmattn import triton_launch
    from flash_dmattn.planning import gather, gather_verdicts, plain_rows, tiles

    state = planner_launches
    real_empty = torch.empty
    # Outputs the kernels leave partly unwritten (lists past their counts, gaps) start
    # zeroed, so that whole tensors compare.
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).zero_())
    # The forwards' speed choices that depend on earlier calls (gather verdicts, the plain
    # rows' samples) fixed: every run launches the same kernels.
    monkeypatch.setattr(gather, "_FORCED_POLICY", "never")
    monkeypatch.setattr(plain_rows, "_FORCED", False)
    device = torch.device("cuda")
    runs = []
    for triton_path in (True, False, False):
        gather_verdicts._LAGGED_TOTALS.clear()
        tiles._CAUSAL_CACHE.clear()
        if len(runs) == 1:  # the launch cache's runs start from an empty cache
            triton_launch.LAUNCHES.clear()
        state.triton_path = triton_path
        state.snapshots = []
        out = _planner_calls(device)
        torch.cuda.synchronize()
        runs.append((out, state.snapshots))
    assert not state.problems, "\n".join(state.problems)
    assert sorted(set(state.kernels) - set(state.seen)) == []
    for name, kernel in state.kernels.items():
        entries = triton_launch.LAUNCHES.entries(kernel)
        # Every signature's compiled kernel is called directly after its first launch.
        assert entries and all(e is not None for e in entries.values()), name
    (ref, ref_launches), *direct = runs
    for i, (out, launches) in enumerate(direct):
        assert [n for n, _ in launches] == [n for n, _ in ref_launches], i
        for k, ((name, got), (_, want)) in enumerate(zip(launches, ref_launches)):
            _assert_same(got, want, f"run {i + 1}, launch {k} ({name})")
        attention = {key for key in ref if key.endswith("_out")}
        _assert_same({k: v for k, v in out.items() if k not in attention},
                     {k: v for k, v in ref.items() if k not in attention}, f"run {i + 1}")
        for key in attention:  # the attention kernels read the same lists
            torch.testing.assert_close(out[key], ref[key], rtol=0, atol=0)
