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
