"""The host side of a decoding step's attention call (issue 33, item 5).

A ``generate()`` step is host bound, so what one decode call costs on the host decides tokens/s.
These tests run the Hugging Face integration's two decode routes (Llama's dense split-KV decode,
Doge's top-W selected keys) with the kernels replaced by recorders and the launchers planning as
on an H100 (``tools/decode_host_overhead.py``'s harness), and hold:

* no host synchronisation on either route (``.item()``, ``.tolist()``, ``bool / int /
  float(tensor)``, ``nonzero``, ``.cpu()``, ``.numpy()``, ``equal``,
  ``torch.cuda.synchronize``);
* the launches each route makes;
* the launch plans cached per call shape: a warm cache launches exactly what a cold one does
  for calls that differ in any one property (dtype, key length, mask, bias, causality,
  softcap, KV cache, batch, heads, head dim, strides);
* the dispatch decision made once per call signature (the memo answers the other layers).
"""
import argparse

import pytest
import torch

from interpreter_only import needs_triton
from tool_env import load_tool


@pytest.fixture(scope="module")
def harness():
    return load_tool("decode_host_overhead")


def _shape(**kw):
    base = dict(batch=2, heads=8, kv_heads=8, head_dim=64, keys=300, window=64)
    base.update(kw)
    return argparse.Namespace(**base)


@needs_triton
@pytest.mark.parametrize("kind,kernels", [
    ("llama", ["_decode_split_kernel", "_decode_combine_kernel"]),  # split-KV + combine
    ("doge", ["_selected_split_kernel"]),                           # W keys: one split
])
def test_decode_call_makes_no_host_sync(harness, monkeypatch, kind, kernels):
    from flash_dmattn.integrations import hf_transformers  # needs no transformers

    if kind == "doge":
        monkeypatch.setenv("FLASH_DMATTN_BACKEND", "triton")  # the selected kernel on CPU
    module, q, k, v, mask = harness.make_call(kind, _shape())
    counts = {"launches": 0, "syncs": 0, "log": []}
    with torch.no_grad(), harness.stubbed_device(counts):
        for _ in range(2):  # the first call plans, the second takes the cached plan
            counts.update(launches=0, syncs=0, log=[])
            with harness.count_syncs(counts):
                out, _ = hf_transformers.dmattn_attention_forward(module, q, k, v, mask,
                                                                  scaling=0.125, dropout=0.0)
            assert counts["syncs"] == 0, counts.get("sync_sites")
            assert [name for name, *_ in counts["log"]] == kernels
    assert out.shape == (q.shape[0], q.shape[2], q.shape[1], q.shape[3])


@needs_triton
def test_decode_steps_decide_dispatch_once_per_signature(harness, monkeypatch):
    """Every layer of a decoding step repeats its signature: the policy and the backends'
    checks answer the first layer, the dispatch memo the others; a new key length (the next
    step) is a new signature."""
    from flash_dmattn import policy, registry
    from flash_dmattn.backends.triton.backend import TritonBackend
    from flash_dmattn.integrations import hf_transformers

    asked = {"features": 0, "reasons": 0}
    real_reasons = TritonBackend.not_supported_reasons

    def reasons(self, inputs):
        asked["reasons"] += 1
        return real_reasons(self, inputs)

    monkeypatch.setattr(TritonBackend, "not_supported_reasons", reasons)
    counts = {"launches": 0, "syncs": 0}
    # The inner patch is undone before the harness restores its own.
    with torch.no_grad(), harness.stubbed_device(counts), monkeypatch.context() as patch:
        features = policy.features_of  # the harness's (an sm_90 GPU for CPU tensors)

        def counted(inputs):
            asked["features"] += 1
            return features(inputs)

        patch.setattr(policy, "features_of", counted)
        hits = registry.DISPATCH_MEMO.hits
        for keys in (300, 301):
            module, q, k, v, _ = harness.make_call("llama", _shape(keys=keys))
            for _ in range(4):  # the layers of one step
                hf_transformers.dmattn_attention_forward(module, q, k.clone(), v, None,
                                                         scaling=0.125, dropout=0.0)
        assert asked == {"features": 2, "reasons": 2}
        assert registry.DISPATCH_MEMO.hits - hits == 6


def _dense_call(dtype=torch.bfloat16, B=2, Lq=1, H=8, Hkv=2, D=64, Lk=300, mask=None,
                bias=None, causal=False, softcap=0.0, cache=False, heads_first=True, page=0,
                splits=None, seed=0):
    """``decode_forward``'s arguments (``page``: paged K/V with pages of that many keys;
    ``splits``: a split count asked for)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Lq, H, D, generator=g).to(dtype)
    table = None
    if page:
        pages = -(-Lk // page)
        k = torch.randn(B * pages, page, Hkv, D, generator=g).to(dtype)
        table = torch.randperm(B * pages, generator=g).view(B, pages).to(torch.int32)
        Lk = pages * page
    elif heads_first:  # a transformers KV cache: (B, Hkv, L, D) storage
        k = torch.randn(B, Hkv, Lk, D, generator=g).to(dtype).transpose(1, 2)
    else:
        k = torch.randn(B, Lk, Hkv, D, generator=g).to(dtype)
    m = None if mask is None else torch.rand(*mask[:-1], Lk, generator=g) > 0.3
    b = None if bias is None else torch.randn(*bias[:-1], Lk, generator=g).to(dtype)
    seqlens = torch.full((B,), Lk - 5, dtype=torch.int32) if cache or page else None
    return (q, k, k, m, b, 0.125, causal, softcap, seqlens, splits, table)


DENSE_CALLS = [
    dict(),
    dict(dtype=torch.float16),
    dict(Lk=301),
    dict(Lk=1024),
    dict(Lq=2),
    dict(Lq=2, causal=True),
    dict(mask=(2, 2, 1, 0)),                      # one row per kv head: the same for the group
    dict(mask=(1, 1, 1, 0)),
    dict(mask=(2, 8, 1, 0)),                      # per query head: rows differ in a tile
    dict(bias=(2, 2, 1, 0)),
    dict(bias=(2, 8, 1, 0)),
    dict(mask=(2, 2, 1, 0), bias=(2, 8, 1, 0)),
    dict(causal=True),
    dict(softcap=5.0),
    dict(cache=True),
    dict(B=3),
    dict(H=4),
    dict(Hkv=8),
    dict(B=16, Lk=1024),                          # the split count: from the GPU's programs ...
    dict(B=16, Lk=1024, Hkv=8),                   # ... per (batch, kv head)
    dict(splits=2),
    dict(D=128),
    dict(heads_first=False),
    dict(page=16, Lk=320),
    dict(page=32, Lk=320),
    dict(page=32, softcap=5.0),
]


def _launches(harness, calls, run, cold):
    """The recorded launches of ``run(*call)`` for each call, with the plan cache emptied
    before each call (``cold``) or kept warm across them."""
    from flash_dmattn.backends.triton import decode, decode_selected

    logs = []
    counts = {"launches": 0, "syncs": 0}
    with torch.no_grad(), harness.stubbed_device(counts):
        for call in calls:
            if cold:
                decode._cached_decode_plan.cache_clear()
                decode_selected._launch_plan.cache_clear()
            counts["log"] = []
            run(*call)
            logs.append([(name, grid, _plain(args), meta)
                         for name, grid, args, meta in counts["log"]])
    return logs


def _plain(args):
    # Tensors by their layout (the outputs are fresh allocations: their addresses differ).
    return tuple((a.dtype, tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else a
                 for a in args)


@needs_triton
def test_dense_decode_plan_cache_key_covers_every_call_property(harness):
    from flash_dmattn.backends.triton import decode

    calls = [_dense_call(**kw) for kw in DENSE_CALLS]
    run = decode.decode_forward
    # Each call twice in a row, then the whole list again: the warm cache answers every repeat.
    warm = _launches(harness, calls + calls[::-1], run, cold=False)
    cold = _launches(harness, calls + calls[::-1], run, cold=True)
    assert warm == cold
    # Every property above changes what is launched (else the list would not test the key;
    # the device and the interpreter are the same for every call here).
    distinct = {repr(log) for log in cold[:len(calls)]}
    assert len(distinct) == len(calls)
    # The strides are the call's own (read per call, never cached).
    (_, _, args, _), *_ = cold[-1]
    q, k = calls[0][0], calls[0][1]
    assert args[0] == (q.dtype, tuple(q.shape), q.stride())
    assert args[1] == (k.dtype, tuple(k.shape), k.stride())


@needs_triton
def test_dense_decode_plan_is_cached_per_call_shape(harness):
    from flash_dmattn.backends.triton import decode

    counts = {"launches": 0, "syncs": 0}
    q, k, v, *rest = _dense_call()
    with torch.no_grad(), harness.stubbed_device(counts):
        decode.decode_forward(q, k, v, *rest)
        before = decode._cached_decode_plan.cache_info()
        for _ in range(3):  # the other layers of a decoding step
            decode.decode_forward(q, k.clone(), v, *rest)
        after = decode._cached_decode_plan.cache_info()
        assert (after.hits - before.hits, after.misses - before.misses) == (3, 0)
        decode.decode_forward(*_dense_call(dtype=torch.float16))
        assert decode._cached_decode_plan.cache_info().misses == after.misses + 1


def _selected_call(dtype=torch.bfloat16, B=2, H=8, Hkv=2, D=64, Lk=300, W=64, bias=True,
                   floor=True, causal=False, softcap=0.0, cache=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 1, H, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Lk, D, generator=g).to(dtype).transpose(1, 2)
    index = torch.randperm(Lk, generator=g)[:W].expand(B, Hkv, W).contiguous()
    b = torch.randn(B, Hkv, 1, Lk, generator=g).to(dtype) if bias else None
    seqlens = torch.full((B,), Lk - 5, dtype=torch.int32) if cache else None
    return (q, k, k, index, b, 0.125, causal, softcap, seqlens,
            -1e4 if (floor and bias) else None)


SELECTED_CALLS = [
    dict(), dict(dtype=torch.float16), dict(W=300), dict(W=32), dict(bias=False),
    dict(floor=False), dict(softcap=5.0), dict(cache=True), dict(B=3),
    dict(H=4, Hkv=4), dict(D=128), dict(Lk=600),
]


@needs_triton
def test_selected_decode_plan_cache_key_covers_every_call_property(harness):
    from flash_dmattn.backends.triton import decode_selected

    calls = [_selected_call(**kw) for kw in SELECTED_CALLS]
    run = decode_selected.selected_decode_forward
    warm = _launches(harness, calls + calls[::-1], run, cold=False)
    cold = _launches(harness, calls + calls[::-1], run, cold=True)
    assert warm == cold
    assert len({repr(log) for log in cold[:len(calls)]}) == len(calls)
