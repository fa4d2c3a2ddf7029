"""Host time of one decoding-step attention call through the Hugging Face integration.

    python tools/decode_host_overhead.py [--calls 2000] [--batch 4] [--keys 1088]     # CPU
    python tools/decode_host_overhead.py --gpu [--cprofile 30] [--steps 64]          # GPU

A ``generate()`` step of the issue-33 probe models (``tools/doge_generate_probe.py``) is
host bound: its CUDA time is a fraction of its wall time, so what the library's attention
function costs on the host, per call, sets tokens/s. Two paths are timed:

* ``llama``: ``dmattn_attention_forward`` with no mask, one query against ``--keys`` cached
  keys (the dense path: the first call validates and auto-dispatches; the calls timed are
  served by ``registry.run_plain`` and the chosen backend's plain entry: on the stubbed CPU
  machine triton's, which launches the split-KV decode kernels directly);
* ``doge``: the same with Doge's additive top-W mask ``(B, H, 1, Lk)`` (the top-W path:
  ``torch.topk`` over the mask row, the selected-keys launcher).

CPU (default): the host path on a machine without a GPU, with nothing of the device work in
it. Every Triton kernel launch of those paths is replaced by a counter (the outputs are the
launchers' ``torch.empty``); the dispatch policy is told the call is on an H100 (sm_90)
while its tensors are CPU tensors, the decode launchers plan as on an H100 (132 SMs, not
interpreted), the selected-keys path is let run there (``FLASH_DMATTN_BACKEND=triton`` for
that path only), and ``torch.topk`` answers from a table (its CPU arithmetic would swamp the
host time: the step's one selection op is left out). Host synchronisations are counted by
wrapping ``Tensor.item / tolist / __bool__ / __int__ / __float__ / __index__ / nonzero / cpu /
numpy / equal`` and ``torch.cuda.synchronize``. Printed per path: microseconds per call
(median of 5 blocks of ``--calls``), kernel launches and host synchronisations per call, and
beside them two yardsticks: transformers' ``sdpa_attention_forward`` on the same CPU tensors
(host overhead plus the CPU's attention arithmetic) and on a one-key call (mostly overhead).

GPU (``--gpu``): nothing is stubbed. Per path, beside transformers' ``sdpa_attention_forward``
on the same CUDA tensors (Doge's additive mask as its ``attn_mask``). The llama path is what
auto-dispatch picks: for these small steps one SDPA call (policy rule ``gpu-plain-decode``);
``FLASH_DMATTN_DISABLE=torch-reference`` times the split-KV decode kernels' route instead:

* host microseconds per call: the time the Python loop of ``--calls`` calls takes before the
  device is synchronised (median of 7 blocks; the device work of a call is shorter, so the
  loop never waits for it), and the wall time per call including that synchronisation;
* the same per call over a generate-like loop (``--steps`` steps of ``--layers`` calls, the
  key length growing by one a step, every cache keyed by the length emptied first: the
  amortised cost a decoding loop pays, first-call-of-a-step work included);
* checks: dmattn's output against sdpa's, and the direct launches of cached compiled kernels
  (:mod:`flash_dmattn.triton_launch`) bit-identical to Triton's normal launch path;
* with ``--cprofile N``: the N costliest functions of ``--calls`` calls (cProfile, sorted by
  ``--sort``; the profiler inflates Python-heavy entries several-fold);
* with ``--splits N`` (an experiment): the dense decode runs N key splits per (batch, kv
  head) instead of the library's choice (1: no combine launch, more device time).

Internal modules: the decode kernels' modules (``backends.triton.decode``, ``decode_selected``,
``planning.decode``) are reached directly to replace their launches by recorders (CPU), and
the caches keyed by call shape are emptied through them (GPU), so that only the host path is
timed.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

if "--gpu" not in sys.argv[1:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the triton backend is "available" on CPU

import torch  # noqa: E402

from flash_dmattn import policy, registry  # noqa: E402
from flash_dmattn.integrations import hf_transformers  # noqa: E402


class _StubKernel:
    """Stands for a ``@triton.jit`` kernel: ``kernel[grid](*args, **meta)`` counts a launch
    (and, where ``counts`` has a ``"log"`` list, records ``(name, grid, args, meta)``)."""

    def __init__(self, counts: dict, name: str) -> None:
        self.counts, self.name = counts, name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.counts["launches"] += 1
            log = self.counts.get("log")
            if log is not None:
                log.append((self.name, grid, args, kwargs))
        return launch


H100_SMS = 132


@contextlib.contextmanager
def stubbed_device(counts: dict):
    """Kernels replaced by counters; the policy sees an sm_90 GPU for CPU tensors, and the
    decode launchers plan as on an H100 (their GPU branch: not interpreted, 132 SMs)."""
    from flash_dmattn.backends.triton import decode, decode_selected
    from flash_dmattn.planning import decode as decode_planning

    saved = []

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    gpu = torch.device("cuda", 0)

    def on_gpu(fn, at):
        # The planning helpers branch on device.type: their device argument (position ``at``)
        # becomes a CUDA device.
        def call(*args, **kwargs):
            return fn(*args[:at], gpu, *args[at + 1:], **kwargs)
        return call

    # Both launchers plan their splits and launch the combine through decode's helpers
    # (split_plan, launch_split_decode): decode's names serve the selected path too.
    for mod, names in ((decode, ("_decode_split_kernel", "_decode_combine_kernel")),
                       (decode_selected, ("_selected_split_kernel",))):
        for name in names:
            patch(mod, name, _StubKernel(counts, name))
    for mod in (decode, decode_selected, decode_planning):
        patch(mod, "sm_count", lambda device: H100_SMS)
    for mod in (decode, decode_selected):
        patch(mod, "interpret_mode", lambda: False)
    for mod, name, at in ((decode, "choose_num_splits", 3), (decode, "combine_config", 3),
                          (decode, "use_deep_pipeline", 4),
                          (decode_selected, "selected_num_splits", 3)):
        patch(mod, name, on_gpu(getattr(mod, name), at))
    # torch.topk (the top-W path's selection, a device op) is answered from a table of the
    # results it gave: on a CPU its arithmetic would swamp the host time measured here.
    real_topk, answers = torch.topk, {}

    def topk(t, k, dim=-1, largest=True, sorted=True):
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), k, dim, largest, sorted)
        if key not in answers:
            answers[key] = real_topk(t, k, dim=dim, largest=largest, sorted=sorted)
        return answers[key]

    patch(torch, "topk", topk)
    real_features = policy.features_of

    def features_on_h100(inputs):
        f = real_features(inputs)
        f = f._replace(device="cuda", capability=policy.HOPPER)
        # The kernels' launch path is what a stubbed machine can time: a small plain step
        # would go to one SDPA call (rule gpu-plain-decode), whose host time only --gpu shows.
        return f._replace(plain=False) if "plain" in f._fields else f

    patch(policy, "features_of", features_on_h100)
    # Launch plans and dispatch decisions made under these patches must not outlive them (nor
    # older ones serve them).
    caches = [c for c in (getattr(decode, "_cached_decode_plan", None),  # (older trees: none)
                          decode_selected._launch_plan) if c is not None]
    memo = getattr(registry, "DISPATCH_MEMO", None)  # (older trees: none)

    def forget():
        for cache in caches:
            cache.cache_clear()
        if memo is not None:
            memo.clear()

    forget()
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
        forget()


@contextlib.contextmanager
def count_syncs(counts: dict):
    """Counts the calls that make the host wait for the device (on a GPU)."""
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero",
             "cpu", "numpy", "equal")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def spy(name, real):
        def wrapped(*args, **kwargs):
            counts["syncs"] += 1
            counts.setdefault("sync_sites", {}).setdefault(name, 0)
            counts["sync_sites"][name] += 1
            return real(*args, **kwargs)
        return wrapped

    for n, real in saved.items():
        setattr(torch.Tensor, n, spy(n, real))
    real_sync = torch.cuda.synchronize
    torch.cuda.synchronize = spy("synchronize", lambda *a, **k: None)
    try:
        yield
    finally:
        for n, real in saved.items():
            setattr(torch.Tensor, n, real)
        torch.cuda.synchronize = real_sync


class _Module(torch.nn.Module):
    """The attributes of a transformers attention layer the integration reads."""

    def __init__(self, model_type: str, window: int, groups: int = 1) -> None:
        super().__init__()
        self.config = type("Config", (), {"model_type": model_type})()
        self.is_causal = True
        self.keep_window_size = window
        self.num_key_value_groups = groups  # what sdpa_attention_forward repeats K/V by
        self.eval()


def make_call(kind: str, a, device: str = "cpu", keys: int = 0, seed: int = 0):
    """Arguments of one decoding-step call as transformers passes them (bf16), on ``device``,
    with ``keys`` cached keys (default ``a.keys``)."""
    g = torch.Generator().manual_seed(seed)
    B, H, Hkv, D, L = a.batch, a.heads, a.kv_heads, a.head_dim, keys or a.keys
    dt = torch.bfloat16
    # q from a (B, 1, H*D) projection, transposed to heads-first; K/V a DynamicCache's
    # torch.cat result (B, Hkv, L, D), contiguous.
    q = torch.randn(B, 1, H, D, generator=g, dtype=dt).to(device).transpose(1, 2)
    k = torch.randn(B, Hkv, L, D, generator=g, dtype=dt).to(device)
    v = torch.randn(B, Hkv, L, D, generator=g, dtype=dt).to(device)
    mask = None
    if kind == "doge":
        # One top-W row per kv head, repeated over its group's query heads (as Doge does).
        bias = torch.rand(B, Hkv, 1, L, generator=g).to(dt)
        keep = torch.topk(bias.float(), a.window, dim=-1).indices
        drop = torch.ones_like(bias, dtype=torch.bool).scatter(-1, keep, False)
        mask = bias.masked_fill(drop, torch.finfo(dt).min).repeat_interleave(H // Hkv, 1)
        mask = mask.to(device)
    module = _Module("doge" if kind == "doge" else "llama", a.window, H // Hkv)
    return module, q, k, v, mask


def time_calls(fn, calls: int, blocks: int = 5) -> float:
    """Median microseconds per call over ``blocks`` blocks of ``calls`` calls."""
    for _ in range(min(calls, 200)):
        fn()
    per = []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(per)


def print_cprofile(fn, a, after=None, title: str = "") -> None:
    """cProfile of ``a.calls`` calls of ``fn``: its ``a.cprofile`` top lines by ``a.sort``.
    ``after`` runs once the profile stops (the device's queue drained outside it); ``title``
    is printed above the table."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.calls):
        fn()
    prof.disable()
    if after is not None:
        after()
    if title:
        print(title)
    pstats.Stats(prof).sort_stats(a.sort).print_stats(a.cprofile)


def measure(kind: str, a) -> dict:
    module, q, k, v, mask = make_call(kind, a)
    scale = a.head_dim ** -0.5
    counts = {"launches": 0, "syncs": 0}

    def call():
        return hf_transformers.dmattn_attention_forward(module, q, k, v, mask, scaling=scale,
                                                        dropout=0.0)

    env = {"FLASH_DMATTN_BACKEND": "triton"} if kind == "doge" else {}
    old = {n: os.environ.get(n) for n in env}
    os.environ.update(env)
    try:
        with torch.no_grad(), stubbed_device(counts):
            call()  # the first call: imports, probes, logging
            counts.update(launches=0, syncs=0)
            with count_syncs(counts):
                call()
            one = dict(counts)
            us = time_calls(call, a.calls)
            if a.cprofile:
                print_cprofile(call, a)
    finally:
        for n, val in old.items():
            if val is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = val
    return dict(us=us, launches=one["launches"], syncs=one["syncs"],
                sync_sites=one.get("sync_sites", {}))


def sdpa_yardstick(a, keys: int) -> float:
    """transformers' sdpa attention function on CPU tensors (mask None, one query)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b = argparse.Namespace(**{**vars(a), "keys": keys})
    module, q, k, v, _ = make_call("llama", b)
    scale = a.head_dim ** -0.5
    with torch.no_grad():
        return time_calls(lambda: sdpa_attention_forward(module, q, k, v, None, scaling=scale),
                          a.calls if keys <= 16 else max(50, a.calls // 20))


# ---------------------------------------------------------------------------------------------
# GPU: the real path, nothing stubbed
# ---------------------------------------------------------------------------------------------

def host_time_gpu(fn, calls: int, blocks: int = 7):
    """``(host us per call, wall us per call)``, medians over ``blocks`` blocks of ``calls``
    calls: the Python loop's time before synchronising the device, and with it."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) / calls * 1e6)
        wall.append((t2 - t0) / calls * 1e6)
    return statistics.median(host), statistics.median(wall)


def _forget_shape_caches() -> None:
    """Empty what the library keeps per call shape (a new key length every decoding step)."""
    from flash_dmattn.backends.triton import decode, decode_selected

    for cache in (getattr(decode, "_cached_decode_plan", None), decode_selected._launch_plan):
        if cache is not None:
            cache.cache_clear()
    memo = getattr(registry, "DISPATCH_MEMO", None)
    if memo is not None:
        memo.clear()


def generate_like_gpu(fn, calls_per_step: list, layers: int, blocks: int = 5):
    """Host us per call over decoding steps: each step's arguments (``calls_per_step``, the key
    length growing by one a step) called ``layers`` times, the shape caches emptied before
    each block (every step's length is new to the library, as in ``generate``)."""
    def run_steps():
        for args in calls_per_step:
            for _ in range(layers):
                fn(*args)

    run_steps()
    torch.cuda.synchronize()
    per = []
    n = len(calls_per_step) * layers
    for _ in range(blocks):
        _forget_shape_caches()
        t0 = time.perf_counter()
        run_steps()
        per.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per)


def _launch_check(call) -> str:
    """Whether the direct launches of cached compiled kernels give Triton's normal launch
    path's output bit for bit (the first call after emptying the launch cache takes the
    normal path, the next ones the direct one)."""
    try:
        from flash_dmattn import triton_launch as launch
    except ImportError:
        try:  # trees where the launch cache lived in the triton backend
            from flash_dmattn.backends.triton import launch
        except ImportError:  # (older trees: no launch cache)
            return "n/a"
    launch.LAUNCHES.clear()
    normal = call().clone()
    direct = [call() for _ in range(3)]
    same = all(torch.equal(normal, d) for d in direct)
    return "bit-identical" if same else "DIFFERENT"


def gpu_report(a) -> None:
    import triton

    try:
        import transformers
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError as exc:
        raise SystemExit(f"--gpu compares with transformers' sdpa_attention_forward: {exc}")
    dev = "cuda"
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}, triton "
          f"{triton.__version__}, transformers {transformers.__version__}; B {a.batch}, "
          f"H {a.heads}, Hkv {a.kv_heads}, D {a.head_dim}, Lq 1, Lk {a.keys}, window "
          f"{a.window}, bf16")
    scale = a.head_dim ** -0.5
    kinds = [p.strip() for p in a.paths.split(",") if p.strip()]
    if a.splits:
        # The experiment: the dense decode with a fixed split count (1: no combine launch).
        from flash_dmattn.backends.triton import decode

        decode.choose_num_splits = lambda *args, **kwargs: a.splits
        _forget_shape_caches()
        print(f"(the dense decode runs {a.splits} key split(s) per (batch, kv head))")
    with torch.no_grad():
        for kind in kinds:
            module, q, k, v, mask = make_call(kind, a, dev)

            def dm(q=q, k=k, v=v, mask=mask):
                return hf_transformers.dmattn_attention_forward(
                    module, q, k, v, mask, scaling=scale, dropout=0.0)[0]

            def sd(q=q, k=k, v=v, mask=mask):
                return sdpa_attention_forward(module, q, k, v, mask, scaling=scale)[0]

            err = (dm().float() - sd().float()).abs().max().item()
            same = _launch_check(dm)
            dm_host, dm_wall = host_time_gpu(dm, a.calls)
            sd_host, sd_wall = host_time_gpu(sd, a.calls)
            print(f"{kind:6s} dmattn {dm_host:7.1f} us/call host ({dm_wall:7.1f} wall)   "
                  f"sdpa {sd_host:7.1f} us/call host ({sd_wall:7.1f} wall)   "
                  f"ratio {dm_host / sd_host:4.2f}x;  max |dmattn - sdpa| {err:.3g}, "
                  f"direct launches vs Triton's path: {same}")
            if a.steps:
                steps = [make_call(kind, a, dev, keys=a.keys - a.steps + s, seed=s)[1:]
                         for s in range(a.steps)]
                dm_steps = generate_like_gpu(
                    lambda q, k, v, m: hf_transformers.dmattn_attention_forward(
                        module, q, k, v, m, scaling=scale, dropout=0.0), steps, a.layers)
                sd_steps = generate_like_gpu(
                    lambda q, k, v, m: sdpa_attention_forward(module, q, k, v, m, scaling=scale),
                    steps, a.layers)
                print(f"{kind:6s} generate-like ({a.steps} steps x {a.layers} layers, Lk "
                      f"{a.keys - a.steps}..{a.keys - 1}): dmattn {dm_steps:7.1f} us/call host, "
                      f"sdpa {sd_steps:7.1f}, ratio {dm_steps / sd_steps:4.2f}x")
            if a.cprofile:
                print_cprofile(dm, a, torch.cuda.synchronize,
                               f"--- {kind}: cProfile of {a.calls} dmattn calls, by {a.sort} ---")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=None,
                    help="calls per timed block (default 2000 on CPU, 200 with --gpu: the "
                         "loop must not outrun the device's launch queue)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--keys", type=int, default=1088)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--paths", default="llama,doge")
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--cprofile", type=int, default=0,
                    help="print the N costliest functions (cProfile) of each path")
    ap.add_argument("--sort", default="tottime", choices=["tottime", "cumulative"],
                    help="cProfile's order")
    ap.add_argument("--gpu", action="store_true",
                    help="time the real path on the GPU beside transformers' sdpa")
    ap.add_argument("--steps", type=int, default=64,
                    help="--gpu: decoding steps of the generate-like loop (0: none)")
    ap.add_argument("--layers", type=int, default=8,
                    help="--gpu: calls per step of the generate-like loop")
    ap.add_argument("--splits", type=int, default=0,
                    help="--gpu experiment: the dense decode with this many key splits (1: no "
                         "combine launch; default: the library's choice)")
    a = ap.parse_args(argv)
    if a.gpu:
        if not torch.cuda.is_available():
            raise SystemExit("--gpu needs a CUDA device")
        a.calls = a.calls or 200
        gpu_report(a)
        return 0
    a.calls = a.calls or 2000
    torch.set_num_threads(1)  # host time: no thread-pool wake-ups in the yardsticks
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; B {a.batch}, H {a.heads}, "
          f"Hkv {a.kv_heads}, D {a.head_dim}, Lq 1, Lk {a.keys}, window {a.window}, bf16")
    for kind in [p.strip() for p in a.paths.split(",") if p.strip()]:
        r = measure(kind, a)
        sites = ", ".join(f"{n} {c}" for n, c in r["sync_sites"].items()) or "none"
        print(f"{kind:6s} dmattn_attention_forward: {r['us']:7.1f} us/call, "
              f"{r['launches']} kernel launches, {r['syncs']} host syncs ({sites})")
    if not a.no_sdpa:
        try:
            print(f"yardstick sdpa_attention_forward, Lk {a.keys}: "
                  f"{sdpa_yardstick(a, a.keys):7.1f} us/call (CPU arithmetic included)")
            print(f"yardstick sdpa_attention_forward, Lk 1:    "
                  f"{sdpa_yardstick(a, 1):7.1f} us/call (mostly host overhead)")
        except ImportError as exc:
            print(f"no transformers sdpa yardstick ({exc})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
