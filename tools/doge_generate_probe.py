"""generate() throughput of a Doge model with sdpa and with flash_dmattn (issue 33, item 5).

    python tools/doge_generate_probe.py [--runs 5] [--profile] [--no-llama]
        [--batch 4] [--prompt 1024] [--new 64] [--layers 8] [--window 256] [--impls sdpa,dmattn]
    python tools/doge_generate_probe.py --tiny      # CPU, tiny model: checks that it runs

The issue's case: a randomly initialised 8-layer ``DogeForCausalLM`` (transformers' defaults
otherwise, ``keep_window_size`` 256), bf16 on the GPU, ``model.generate`` of 64 new tokens
(greedy, never stopping early) after a 1024-token prompt, batch 4, with
``attn_implementation="sdpa"`` and with ``"dmattn"`` (this library's, registered by
``import flash_dmattn.integrations``). Beside it a Llama of the same width and depth, whose
attention has no dynamic mask: the parity check of the integration's plain decode path.

Printed per model and implementation: tokens/s (``batch * new / seconds`` of the whole
``generate`` call, prompt included: the issue's number), the decoding step's time
(``(generate(new) - generate(1)) / (new - 1)``), medians of ``--runs`` repetitions in which the
implementations alternate; whether the greedy tokens agree with sdpa's; for dmattn, how many
attention calls of one generate took the top-W decode path (``key_index``) and how many the
dense one. ``--profile`` adds torch.profiler summaries of the prefill and of one decoding
step per implementation (host time, ops, kernel launches). The GPU's name and the versions come first.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import statistics
import time

import torch

import flash_dmattn  # noqa: E402
import flash_dmattn.integrations  # noqa: E402,F401  (registers attn_implementation="dmattn")
from flash_dmattn.integrations import hf_transformers  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true",
                    help="CPU, float32, a tiny model and short prompt (a smoke test)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--window", type=int, default=256, help="Doge's keep_window_size")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--impls", default="sdpa,dmattn")
    ap.add_argument("--no-llama", action="store_true", help="Doge only")
    ap.add_argument("--random-a", action="store_true",
                    help="draw Doge's A from N(0, 1) (transformers initialises it to 0, which "
                         "makes every key's dynamic bias 1: all ties)")
    ap.add_argument("--profile", action="store_true",
                    help="torch.profiler summaries of the prefill and of one decoding step per "
                         "implementation")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.tiny:
        a.device = a.device or "cpu"
        a.dtype = a.dtype or "float32"
        a.batch, a.prompt, a.new, a.layers, a.window = 2, 24, 6, 2, 8
        a.runs = min(a.runs, 2)
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a.dtype = getattr(torch, a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32"))
    a.impls = [s.strip() for s in a.impls.split(",") if s.strip()]
    return a


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def header(a):
    import transformers

    where = torch.cuda.get_device_name() if a.device.startswith("cuda") else "CPU"
    try:
        import triton
        triton_v = triton.__version__
    except Exception:  # triton is optional
        triton_v = "-"
    print(f"device: {where}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, triton "
          f"{triton_v}, flash_dmattn {flash_dmattn.__version__} (backends: "
          f"{', '.join(flash_dmattn.get_available_backends())})")
    print(f"batch {a.batch}, prompt {a.prompt}, new tokens {a.new}, layers {a.layers}, "
          f"{str(a.dtype).replace('torch.', '')}, runs {a.runs}", flush=True)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------
def _size_kwargs(a):
    if a.tiny:
        return dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2)
    return {}


def build(kind, a, impl):
    """A randomly initialised model on the device, in the dtype, with ``impl`` attention."""
    import transformers

    torch.manual_seed(a.seed)
    positions = max(2048, a.prompt + a.new + 8)
    if kind == "doge":
        cfg = transformers.DogeConfig(num_hidden_layers=a.layers, keep_window_size=a.window,
                                      max_position_embeddings=positions, **_size_kwargs(a))
        cls = transformers.DogeForCausalLM
    else:
        ref = transformers.DogeConfig(**_size_kwargs(a))  # the same width as the Doge model
        cfg = transformers.LlamaConfig(
            vocab_size=ref.vocab_size, hidden_size=ref.hidden_size,
            intermediate_size=ref.intermediate_size, num_hidden_layers=a.layers,
            num_attention_heads=ref.num_attention_heads,
            num_key_value_heads=ref.num_key_value_heads, max_position_embeddings=positions)
        cls = transformers.LlamaForCausalLM
    try:
        ctx = torch.device(a.device)  # build on the device (torch >= 2.0)
    except Exception:
        ctx = contextlib.nullcontext()
    with ctx:
        try:
            model = cls._from_config(cfg, attn_implementation=impl)
        except TypeError:  # older transformers: set on the config
            cfg._attn_implementation = impl
            model = cls(cfg)
    model = model.to(device=a.device, dtype=a.dtype).eval()
    if kind == "doge" and a.random_a:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.A.normal_(0.0, 1.0)
    return model


def set_impl(model, impl):
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:
        model.config._attn_implementation = impl


def gen(model, ids, new):
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                  do_sample=False, pad_token_id=0, use_cache=True)
    with torch.no_grad():
        return model.generate(ids, **kwargs)


def timed_gen(model, ids, new, device):
    sync(device)
    t0 = time.perf_counter()
    out = gen(model, ids, new)
    sync(device)
    return time.perf_counter() - t0, out


@contextlib.contextmanager
def count_paths():
    """Counts the library's attention calls by path while the block runs."""
    counts = {"top-W decode (key_index)": 0, "dense": 0}
    seams = {"_get_kernel": "dense", "_get_selected_kernel": "top-W decode (key_index)"}
    saved = {name: getattr(hf_transformers, name) for name in seams}

    def spy(real, label):
        def get():
            fn = real()

            def run(**kw):
                counts[label] += 1
                return fn(**kw)
            return run
        return get

    for name, label in seams.items():
        setattr(hf_transformers, name, spy(saved[name], label))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(hf_transformers, name, fn)


# ---------------------------------------------------------------------------------------------
# Profile of one decoding step
# ---------------------------------------------------------------------------------------------
def _cache_kwarg(model):
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


ATTN_LABEL = "attention function"


@contextlib.contextmanager
def labelled_attention(impl):
    """The registered attention function of ``impl`` runs inside a profiler range named
    :data:`ATTN_LABEL` while the block runs (its host time, mask work included, per layer)."""
    try:
        from transformers import AttentionInterface
        mapping = AttentionInterface._global_mapping
        real = mapping[impl]
    except (ImportError, AttributeError, KeyError):
        yield
        return

    def labelled(*args, **kwargs):
        with torch.profiler.record_function(ATTN_LABEL):
            return real(*args, **kwargs)

    mapping[impl] = labelled
    try:
        yield
    finally:
        mapping[impl] = real


def _print_profile(prof, title, a):
    """A profile's launch count, the attention function's host time and its tables (host time,
    then device time on a GPU)."""
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in (
        "cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"))
    attn = [e for e in events if e.key == ATTN_LABEL]
    attn_text = ""
    if attn:
        e = attn[0]
        attn_text = (f"; attention function: {e.count} calls, {e.cpu_time_total / 1e3:.2f} ms "
                     f"host in all ({e.cpu_time_total / max(e.count, 1):.0f} us a call)")
    print(f"\n--- {title}, {launches} kernel launches{attn_text}")
    print(events.table(sort_by="self_cpu_time_total", row_limit=25))
    if a.device.startswith("cuda"):
        for key in ("self_device_time_total", "self_cuda_time_total"):  # torch renamed it
            try:
                print(events.table(sort_by=key, row_limit=12))
                break
            except (AttributeError, KeyError, ValueError):
                continue


def _profile_once(fn, warm, a, impl):
    """``(profile, wall seconds)`` of one call of ``fn`` after ``warm`` unprofiled ones (kernels
    compiled, plans and allocator primed), the attention function labelled."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warm):
        fn()
    sync(a.device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device.startswith("cuda")
                                     else [])
    with labelled_attention(impl), profile(activities=acts) as prof:
        t0 = time.perf_counter()
        fn()
        sync(a.device)
        wall = time.perf_counter() - t0
    return prof, wall


def profile_prefill(model, ids, a, impl):
    """Profile of the prompt's forward (the prefill of ``generate``, with its cache)."""
    with torch.no_grad():
        prof, wall = _profile_once(
            lambda: model(ids, attention_mask=torch.ones_like(ids), use_cache=True), 2, a, impl)
    _print_profile(prof, f"the prefill ({ids.shape[1]} tokens), {impl}: {wall * 1e3:.2f} ms wall",
                   a)


def profile_step(model, ids, a, impl):
    """Profile of one decoding step after the prefill (and three unprofiled steps)."""
    kw = _cache_kwarg(model)
    with torch.no_grad():
        out = model(ids, attention_mask=torch.ones_like(ids), use_cache=True)
        cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
        nxt = out.logits[:, -1:].argmax(-1)
        length = ids.shape[1]

        def step():
            nonlocal nxt, length
            length += 1
            mask = torch.ones(ids.shape[0], length, dtype=ids.dtype, device=ids.device)
            o = model(nxt, attention_mask=mask, use_cache=True, **{kw: cache})
            nxt = o.logits[:, -1:].argmax(-1)

        prof, wall = _profile_once(step, 3, a, impl)
    _print_profile(prof, f"one decoding step, {impl}: {wall * 1e3:.2f} ms wall (cache "
                         f"{length - 1} keys)", a)


# ---------------------------------------------------------------------------------------------
def run_model(kind, a):
    print(f"\n== {kind} ==", flush=True)
    model = build(kind, a, a.impls[0])
    g = torch.Generator().manual_seed(a.seed + 1)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (a.batch, a.prompt), generator=g).to(a.device)
    for impl in a.impls:  # warm-up: every kernel specialisation of the run compiled
        set_impl(model, impl)
        gen(model, ids, a.new)
        gen(model, ids, 1)
    full = {impl: [] for impl in a.impls}
    first = {impl: [] for impl in a.impls}
    tokens = {}
    for _ in range(a.runs):
        for impl in a.impls:  # alternate, so drifts of clock and load hit both alike
            set_impl(model, impl)
            t, out = timed_gen(model, ids, a.new, a.device)
            full[impl].append(t)
            tokens[impl] = out[:, a.prompt:]
            first[impl].append(timed_gen(model, ids, 1, a.device)[0])
    base = a.impls[0]
    for impl in a.impls:
        t = statistics.median(full[impl])
        t1 = statistics.median(first[impl])
        step = (t - t1) / max(1, a.new - 1)
        agree = (tokens[impl] == tokens[base]).float().mean().item()
        line = (f"{impl:8s} {a.batch * a.new / t:8.1f} tok/s  generate {t * 1e3:8.1f} ms  "
                f"prefill+1 {t1 * 1e3:7.1f} ms  step {step * 1e3:6.2f} ms")
        if impl != base:
            line += f"  tokens equal to {base}'s: {agree * 100:.1f} %"
        print(line, flush=True)
    if "dmattn" in a.impls:
        set_impl(model, "dmattn")
        with count_paths() as counts:
            gen(model, ids, a.new)
        print("dmattn attention calls in one generate: "
              + ", ".join(f"{k} {v}" for k, v in counts.items()))
    if a.profile:
        for impl in a.impls:
            set_impl(model, impl)
            profile_prefill(model, ids, a, impl)
            profile_step(model, ids, a, impl)
    del model
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()


def main(argv=None):
    a = parse_args(argv)
    # The library logs which backend auto-dispatch takes, once per kind of call.
    import logging
    logging.basicConfig(format="%(message)s")
    logging.getLogger("flash_dmattn").setLevel(logging.INFO)
    header(a)
    try:
        import transformers
        transformers.DogeForCausalLM  # noqa: B018
    except (ImportError, AttributeError) as exc:
        print(f"this transformers has no Doge ({exc}); Llama only")
        kinds = ["llama"]
    else:
        kinds = ["doge"] + ([] if a.no_llama else ["llama"])
    for kind in kinds:
        run_model(kind, a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
