"""KV-cache decoding: ``cache_seqlens`` on every backend, and the Triton split-KV decode kernel.

The oracle is tests/naive.py's float64 formula with the cache folded into a full-size mask
(keys ``j < n[b]``; causal ``j <= i + n[b] - Lq``). Triton kernels run on CPU tensors under
TRITON_INTERPRET=1 (set by conftest.py without a GPU) with 16-key tiles and a few splits, so
ragged tails, empty splits and the combine step are all exercised on tiny shapes.
"""
import math

import pytest
import torch


from flash_dmattn import flash_dmattn_func, flex_dmattn_func, triton_dmattn_func
from flash_dmattn.api import reference_dmattn_func
from flash_dmattn import registry
from flash_dmattn.inputs import AttentionInputs

from naive import assert_close, naive_attention

from interpreter_only import interpreter_skip_reason, needs_triton

_NO_INTERPRETER = interpreter_skip_reason()
needs_interpreter = pytest.mark.skipif(_NO_INTERPRETER is not None, reason=str(_NO_INTERPRETER))


def cache_visibility(cs, B, Lq, Lk, causal):
    """(B, 1, Lq, Lk) bool: key j visible to query i of batch b (the contract, materialised)."""
    n = cs.long().view(B, 1, 1, 1)
    i = torch.arange(Lq).view(1, 1, Lq, 1)
    j = torch.arange(Lk).view(1, 1, 1, Lk)
    return (j <= i + n - Lq) if causal else (j < n).expand(B, 1, Lq, Lk)


def naive_kv(q, k, v, mask, bias, scale, causal, softcap, cs):
    """Float64 oracle with cache_seqlens (None: plain docs/contract.md §3)."""
    B, Lq, H, _ = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    if cs is None:
        return naive_attention(q, k, v, mask, bias, scale, causal, softcap)
    vis = cache_visibility(cs, B, Lq, Lk, causal)
    if mask is not None:
        m4 = mask
        while m4.dim() < 4:
            m4 = m4.unsqueeze(0)
        if m4.shape[1] == Hkv and Hkv != H:
            m4 = m4.repeat_interleave(H // Hkv, dim=1)
        vis = vis & m4
    return naive_attention(q, k, v, vis, bias, scale, False, softcap)


def make(B, Lq, H, Hkv, Lk, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Lq, H, D, generator=g).to(dtype)
    k = torch.randn(B, Lk, Hkv, D, generator=g).to(dtype)
    v = torch.randn(B, Lk, Hkv, D, generator=g).to(dtype)
    return q, k, v


def make_aux(kind, B, Lq, H, Hkv, Lk, seed=1):
    """(mask, bias) of a named broadcast shape."""
    g = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None, None
    if kind == "per_key":  # the dynamic-mask decode case: (B, Hkv, 1, Lk)
        return torch.rand(B, Hkv, 1, Lk, generator=g) > 0.3, torch.randn(B, Hkv, 1, Lk, generator=g)
    if kind == "full":  # per query head and query
        return torch.rand(B, H, Lq, Lk, generator=g) > 0.3, torch.randn(B, H, Lq, Lk, generator=g)
    if kind == "shared":  # one pattern for every batch and head; per-kv-head bias
        return torch.rand(1, 1, Lq, Lk, generator=g) > 0.2, torch.randn(B, Hkv, Lq, Lk, generator=g)
    if kind == "padding":  # key padding mask only
        return torch.rand(B, 1, 1, Lk, generator=g) > 0.2, None
    raise ValueError(kind)


# ---------------------------------------------------------------------------------------------
# torch-reference: exact, with gradients


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Lq,H,Hkv,kind", [(1, 4, 2, "per_key"), (3, 4, 1, "full"), (2, 2, 2, "shared")])
def test_reference_matches_naive(causal, Lq, H, Hkv, kind):
    B, Lk, D = 3, 23, 8
    q, k, v = make(B, Lq, H, Hkv, Lk, D, torch.float64)
    mask, bias = make_aux(kind, B, Lq, H, Hkv, Lk)
    bias = bias.double() if bias is not None else None
    cs = torch.tensor([0, 1, Lk], dtype=torch.int32)  # empty, shorter than Lq, full
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + (
        [bias.clone().requires_grad_()] if bias is not None else [])
    out, lse, _ = reference_dmattn_func(
        *leaves[:3], attn_mask=mask, attn_bias=leaves[3] if bias is not None else None,
        is_causal=causal, softcap=5.0, return_attn_probs=True, cache_seqlens=cs,
    )
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    nleaves = [t.clone().requires_grad_() for t in leaves]
    nb = nleaves[3] if bias is not None else None
    n_out, n_lse = naive_kv(*nleaves[:3], mask, nb, D ** -0.5, causal, 5.0, cs)
    n_grads = torch.autograd.grad(n_out, nleaves, dout)
    assert_close("out", out, n_out, 1e-10)
    assert_close("lse", lse, n_lse, 1e-6)  # lse is returned in float32
    for name, gr, ng in zip(("dq", "dk", "dv", "dbias"), grads, n_grads):
        assert_close(name, gr, ng, 1e-10)
    # Keys past the used length get no gradient at all.
    assert grads[1][0].abs().max() == 0 and grads[2][1, 1:].abs().max() == 0


def test_reference_rows_beyond_used_length_are_empty():
    # Causal with n < Lq: the first Lq - n queries see nothing -> 0 output, lse -inf, no NaN.
    B, Lq, H, Lk, D = 1, 4, 2, 10, 8
    q, k, v = make(B, Lq, H, H, Lk, D)
    cs = torch.tensor([2], dtype=torch.int32)
    out, lse, _ = reference_dmattn_func(q, k, v, is_causal=True, cache_seqlens=cs, return_attn_probs=True)
    assert torch.isneginf(lse[0, :, :2]).all() and torch.isfinite(lse[0, :, 2:]).all()
    assert (out[0, :2] == 0).all() and not out.isnan().any()


def test_auto_dispatch_on_cpu_uses_reference():
    q, k, v = make(2, 1, 4, 2, 40, 8)
    cs = torch.tensor([5, 40], dtype=torch.int32)
    out = flash_dmattn_func(q, k, v, cache_seqlens=cs)
    want, _ = naive_kv(q, k, v, None, None, 8 ** -0.5, False, 0.0, cs)
    assert_close("out", out, want, 1e-5)
    # Same as slicing each batch's cache to its used length.
    for b, n in enumerate(cs.tolist()):
        part = reference_dmattn_func(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n])
        assert_close(f"out[{b}]", out[b:b + 1], part.double(), 1e-5)


# ---------------------------------------------------------------------------------------------
# flex (CPU: eager, forward only)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["none", "per_key", "full"])
def test_flex_forward(causal, kind):
    if not registry.get_backend("flex").available:
        pytest.skip("flex unavailable")
    B, Lq, H, Hkv, Lk, D = 3, 2, 4, 2, 150, 16
    q, k, v = make(B, Lq, H, Hkv, Lk, D)
    mask, bias = make_aux(kind, B, Lq, H, Hkv, Lk)
    cs = torch.tensor([0, 1, 140], dtype=torch.int32)
    out = flex_dmattn_func(q, k, v, mask, bias, is_causal=causal, softcap=10.0, cache_seqlens=cs)
    want, _ = naive_kv(q, k, v, mask, bias, D ** -0.5, causal, 10.0, cs)
    assert_close("out", out, want, 1e-5)


# ---------------------------------------------------------------------------------------------
# validation


@pytest.mark.parametrize(
    "bad,exc,words",
    [
        ([3, 4], TypeError, "torch.Tensor"),
        (torch.tensor([3.0, 4.0]), ValueError, "int32"),
        (torch.tensor([3], dtype=torch.int32), ValueError, "shape (batch,)"),
        (torch.tensor([[3, 4]], dtype=torch.int32), ValueError, "shape (batch,)"),
        (torch.tensor([3, 11], dtype=torch.int32), ValueError, "0..10"),
        (torch.tensor([-1, 4], dtype=torch.int64), ValueError, "0..10"),
        (torch.tensor([3, 4], dtype=torch.int32, device="meta"), ValueError, "is on meta"),
    ],
)
def test_cache_seqlens_validation(bad, exc, words):
    q, k, v = make(2, 1, 2, 2, 10, 8)
    with pytest.raises(exc, match=None) as info:
        flash_dmattn_func(q, k, v, cache_seqlens=bad)
    assert words in str(info.value)


def test_cache_seqlens_int64_is_normalised():
    q, k, v = make(2, 1, 2, 2, 10, 8)
    inputs = AttentionInputs.from_args(q, k, v, cache_seqlens=torch.tensor([3, 10]))
    assert inputs.cache_seqlens.dtype == torch.int32 and "cache_seqlens" in inputs.describe()


@needs_triton
def test_triton_declines_large_lq_with_reason():
    backend = registry._BACKENDS["triton"]
    q, k, v = make(1, 40, 4, 1, 64, 16)  # 40 * 4 rows > 64
    inputs = AttentionInputs.from_args(q, k, v, cache_seqlens=torch.tensor([30], dtype=torch.int32))
    reasons = backend.not_supported_reasons(inputs)
    assert any("cache_seqlens" in r and "torch-reference or flex" in r for r in reasons)
    # Gradients through a causal multi-query decode with a per-kv-head mask would need a
    # (B, Hkv, Lq, Lk) folded mask: declined too.
    q, k, v = make(1, 3, 4, 2, 64, 16)
    q.requires_grad_()
    mask = torch.ones(1, 2, 1, 64, dtype=torch.bool)
    inputs = AttentionInputs.from_args(q, k, v, mask, None, None, True,
                                       cache_seqlens=torch.tensor([30], dtype=torch.int32))
    assert any("gradients with cache_seqlens" in r for r in backend.not_supported_reasons(inputs))
    with torch.no_grad():
        inputs = AttentionInputs.from_args(q, k, v, mask, None, None, True,
                                           cache_seqlens=torch.tensor([30], dtype=torch.int32))
        assert not any("cache_seqlens" in r for r in backend.not_supported_reasons(inputs))


# ---------------------------------------------------------------------------------------------
# Triton decode kernel (interpreter)


TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def run_decode(B, Lq, H, Hkv, Lk, D, kind="none", causal=False, softcap=0.0, cs=None,
               num_splits=None, dtype=torch.float32, bias_override=None, mask_override=None):
    from flash_dmattn.backends.triton.decode import decode_forward

    q, k, v = make(B, Lq, H, Hkv, Lk, D, dtype)
    mask, bias = make_aux(kind, B, Lq, H, Hkv, Lk)
    if mask_override is not None:
        mask = mask_override
    if bias_override is not None:
        bias = bias_override
    if bias is not None and dtype != torch.float32:
        bias = bias.to(dtype)
    cs_t = torch.tensor(cs, dtype=torch.int32) if cs is not None else None
    scale = 1.0 / math.sqrt(D)
    out, lse = decode_forward(q, k, v, mask, bias, scale, causal, softcap, cs_t, num_splits)
    want_o, want_l = naive_kv(q, k, v, mask, bias, scale, causal, softcap, cs_t)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close("out", out, want_o, TOL[dtype])
    assert_close("lse", lse, want_l, TOL[dtype])
    return out, lse


@needs_interpreter
@pytest.mark.parametrize("Lq", [1, 2, 3, 4])
@pytest.mark.parametrize("H,Hkv", [(2, 2), (8, 2)])
@pytest.mark.parametrize("Lk", [1, 17, 129, 300])
def test_decode_kernel_shapes(poison, Lq, H, Hkv, Lk):
    # Per-key mask + bias (the important case), causal, cache lengths 0 / partial / full.
    cs = [0, min(Lk, 5), Lk] if Lq != 4 else None
    B = 3 if cs is not None else 2
    run_decode(B, Lq, H, Hkv, Lk, 16, "per_key", causal=(Lq % 2 == 1), cs=cs)


@needs_interpreter
@pytest.mark.parametrize("kind", ["none", "full", "shared", "padding"])
@pytest.mark.parametrize("causal", [False, True])
def test_decode_kernel_broadcast_shapes(poison, kind, causal):
    run_decode(2, 3, 4, 2, 75, 24, kind, causal=causal, softcap=3.0 if causal else 0.0, cs=[40, 75])


@needs_interpreter
@pytest.mark.parametrize("num_splits", [1, 2, 5, 64])
def test_decode_kernel_splits(poison, num_splits):
    # 64 splits of a 90-key cache: clamped to whole 16-key tiles (6 splits), several empty for
    # the shorter batch; the combine must weigh them to zero.
    run_decode(2, 2, 4, 1, 90, 16, "per_key", cs=[9, 90], num_splits=num_splits)


@needs_interpreter
def test_decode_kernel_empty_rows_and_neg_inf_bias(poison):
    B, Lq, H, Hkv, Lk = 2, 2, 4, 2, 70
    mask = torch.ones(B, Hkv, Lq, Lk, dtype=torch.bool)
    mask[0, 1] = False  # kv head 1 of batch 0: every row fully masked
    bias = torch.randn(B, H, Lq, Lk)
    bias[1, :, 0] = float("-inf")  # whole rows of -inf bias
    bias[:, :, :, ::3] = float("-inf")
    out, lse = run_decode(B, Lq, H, Hkv, Lk, 16, cs=[70, 33], mask_override=mask,
                          bias_override=bias, num_splits=3)
    assert torch.isneginf(lse[0, 2:]).all() and (out[0, :, 2:] == 0).all()
    assert torch.isneginf(lse[1, :, 0]).all()


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_kernel_half(poison, dtype):
    run_decode(2, 1, 8, 2, 100, 32, "per_key", causal=True, cs=[100, 61], dtype=dtype)


@needs_interpreter
def test_decode_kernel_strided_inputs(poison):
    from flash_dmattn.backends.triton.decode import decode_forward

    B, Lq, H, Hkv, Lk, D = 2, 2, 4, 2, 50, 16
    # Non-contiguous q/k/v (heads-first storage) and a transposed per-key bias.
    q = torch.randn(B, H, Lq, D).transpose(1, 2)
    k = torch.randn(B, Hkv, Lk, D).transpose(1, 2)
    v = torch.randn(B, Hkv, Lk, D).transpose(1, 2)
    bias = torch.randn(B, Lk, Hkv, 1).permute(0, 2, 3, 1)
    mask = (torch.rand(Lk, B) > 0.3).t().reshape(B, 1, 1, Lk)
    cs = torch.tensor([50, 20], dtype=torch.int32)
    out, lse = decode_forward(q, k, v, mask, bias, 0.3, False, 0.0, cs, 2)
    want_o, want_l = naive_kv(q, k, v, mask, bias, 0.3, False, 0.0, cs)
    assert_close("out", out, want_o, 2e-5)
    assert_close("lse", lse, want_l, 2e-5)


@needs_interpreter
@pytest.mark.parametrize("causal", [False, True])
def test_triton_backend_decode_with_grads(poison, causal):
    # Through the public function: decode forward, main backward with the cache folded into
    # the (per-key) mask; dq, dk, dv and dbias against the float64 oracle.
    B, Lq, H, Hkv, Lk, D = 2, 2 if causal else 1, 4, 2, 40, 16
    q, k, v = make(B, Lq, H, Hkv, Lk, D)
    mask, bias = make_aux("per_key", B, Lq, H, Hkv, Lk)
    if causal:
        mask = mask[:, :1]  # (B, 1, 1, Lk): the folded (B, 1, Lq, Lk) mask stays O(B*Lq*Lk)
    cs = torch.tensor([17, 40], dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    out = triton_dmattn_func(*leaves[:3], mask, leaves[3], is_causal=causal, cache_seqlens=cs)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    nleaves = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    want, _ = naive_kv(*nleaves[:3], mask, nleaves[3], D ** -0.5, causal, 0.0, cs)
    n_grads = torch.autograd.grad(want, nleaves, dout.double())
    assert_close("out", out, want, 2e-5)
    for name, gr, ng in zip(("dq", "dk", "dv", "dbias"), grads, n_grads):
        assert_close(name, gr, ng, 5e-5)


@needs_interpreter
def test_triton_backend_uses_decode_kernel(monkeypatch):
    from flash_dmattn.backends.triton import decode as decode_mod

    calls = []
    real = decode_mod.decode_forward

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(decode_mod, "decode_forward", spy)
    q, k, v = make(1, 1, 4, 2, decode_mod.DECODE_MIN_SEQLEN_K, 16)
    with torch.no_grad():
        out = triton_dmattn_func(q, k, v)  # long enough: decode kernel without cache_seqlens
        want, _ = naive_kv(q, k, v, None, None, 0.25, False, 0.0, None)
    assert calls and calls[0] == q.shape
    assert_close("out", out, want, 2e-5)


@needs_interpreter
@pytest.mark.parametrize("chunk,cols", [(None, 1), (2, 1), (None, 2), (2, 4)])
def test_decode_kernel_split_merge_edge_rows(poison, monkeypatch, chunk, cols):
    # The combine over 5 splits with causality, softcap, -inf biases on a whole prefix and a
    # batch whose cache is empty (every split of it empty: zeros, lse -inf, no NaN); read in
    # one chunk, or in chunks of 2 (the running max rescales the sums, the last chunk is
    # partly past the last split); one program per row, or the head dim cut into column
    # blocks (each writes its columns, only the first the lse: the poison shows the rest).
    from flash_dmattn.backends.triton import decode as decode_mod

    real = decode_mod.combine_config

    def config(num_splits, block_d, split_rows, device):
        natural = real(num_splits, block_d, split_rows, device)[0] * cols
        return (chunk or natural), cols, 1

    monkeypatch.setattr(decode_mod, "combine_config", config)
    bias = torch.randn(3, 2, 1, 90)
    bias[1, :, :, :40] = float("-inf")
    # Head dim 64: up to four 16-column blocks.
    out, lse = run_decode(3, 2, 4, 2, 90, 64, "per_key", causal=True, softcap=5.0,
                          cs=[90, 61, 0], num_splits=5, bias_override=bias)
    assert not out.isnan().any()
    assert (out[2] == 0).all() and (lse[2] == float("-inf")).all()


@needs_triton
def test_decode_launch_rules(monkeypatch):
    # The combine's column blocks aim at ~4 programs per SM (8 at most, >= 16 columns each,
    # one warp each; a single 4-warp program per row when rows alone fill the GPU), and the
    # split kernel's three-stage pipeline applies without mask or bias while B * Hkv fits two
    # programs per SM. Pure Python: the SM count is patched.
    from flash_dmattn.backends.triton import decode as decode_mod

    monkeypatch.setattr(decode_mod, "sm_count", lambda device: 132)
    gpu = torch.device("cuda")
    assert decode_mod.combine_config(64, 128, 32, gpu) == (64, 8, 1)    # B1 H32
    assert decode_mod.combine_config(8, 128, 256, gpu) == (8, 2, 1)     # B8 H32
    assert decode_mod.combine_config(1, 128, 2048, gpu) == (2, 1, 4)    # B64 H32
    assert decode_mod.combine_config(100, 128, 512, gpu) == (32, 1, 4)  # chunks of 16 KiB
    assert decode_mod.combine_config(64, 64, 32, gpu) == (64, 4, 1)     # >= 16 columns
    assert decode_mod.combine_config(64, 256, 16, gpu) == (64, 8, 1)
    assert decode_mod.use_deep_pipeline(1, 8, False, False, gpu)
    assert decode_mod.use_deep_pipeline(33, 8, False, False, gpu)
    assert not decode_mod.use_deep_pipeline(34, 8, False, False, gpu)
    assert not decode_mod.use_deep_pipeline(1, 8, True, False, gpu)
    assert not decode_mod.use_deep_pipeline(1, 8, False, True, gpu)  # paged
    assert not decode_mod.use_deep_pipeline(1, 8, False, False, torch.device("cpu"))
    assert decode_mod.decode_config(128, 16, False, True)[2] == 3
    assert decode_mod.decode_config(128, 16)[2] == 2


# ---------------------------------------------------------------------------------------------
# GPU, realistic sizes (runs on a CUDA machine; skipped here)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8])
@pytest.mark.parametrize("Lk", [4096, 32768, 131072])
@pytest.mark.parametrize("with_aux", [False, True])
def test_gpu_decode_vs_reference(B, Lk, with_aux):
    if B * Lk > 8 * 32768 and with_aux:
        Lk = 8 * 32768 // B  # keep the fp32 reference's memory modest
    dev, dtype = "cuda", torch.bfloat16
    H, Hkv, D, Lq = 32, 8, 128, 1
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, Lq, H, D, device=dev, dtype=dtype, generator=g)
    k = torch.randn(B, Lk, Hkv, D, device=dev, dtype=dtype, generator=g)
    v = torch.randn(B, Lk, Hkv, D, device=dev, dtype=dtype, generator=g)
    mask = bias = None
    if with_aux:
        bias = torch.randn(B, Hkv, 1, Lk, device=dev, dtype=dtype, generator=g)
        mask = bias > 0
    cs = torch.randint(Lk // 4, Lk, (B,), device=dev, generator=g, dtype=torch.int32)
    cs[0] = Lk  # one full cache
    for cache in (None, cs):
        out = triton_dmattn_func(q, k, v, mask, bias, cache_seqlens=cache)
        ref = reference_dmattn_func(q.float(), k.float(), v.float(), mask,
                                    bias.float() if bias is not None else None, cache_seqlens=cache)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 2e-2, err
        assert not out.isnan().any()


def _gpu_decode_case(B, Lq, H, Hkv, D, Lk, seed):
    dev, dtype = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(B, Lq, H, D, device=dev, dtype=dtype, generator=g)
    k = torch.randn(B, Lk, Hkv, D, device=dev, dtype=dtype, generator=g)
    v = torch.randn(B, Lk, Hkv, D, device=dev, dtype=dtype, generator=g)
    bias = torch.randn(B, Hkv, 1, Lk, device=dev, dtype=dtype, generator=g)
    mask = bias > 0
    cs = torch.randint(0, Lk + 1, (B,), device=dev, generator=g, dtype=torch.int32)
    cs[0] = Lk
    return q, k, v, mask, bias, cs


@pytest.mark.gpu
def test_gpu_decode_alternating_shapes(poison):
    # Calls of alternating shapes (1 to 128 splits -- the combine then reads two chunks --,
    # GQA groups of 1 to 8, 1 to 16 queries, head dims 64 to 256, part-filled and empty
    # caches) against the fp32 reference. Poisoned outputs and partials: anything the combine
    # reads unwritten, or leaves unwritten, shows.
    from flash_dmattn.backends.triton import decode as decode_mod

    shapes = [(1, 1, 32, 8, 128, 4096), (3, 1, 16, 2, 64, 70000), (1, 4, 32, 8, 128, 9000),
              (2, 1, 8, 8, 256, 3000), (1, 16, 32, 8, 128, 5000), (5, 2, 8, 1, 128, 1000)]
    for rnd in range(2):
        for i, (B, Lq, H, Hkv, D, Lk) in enumerate(shapes):
            q, k, v, mask, bias, cs = _gpu_decode_case(B, Lq, H, Hkv, D, Lk, 10 * rnd + i)
            splits = 128 if i == 1 else None
            out, lse = decode_mod.decode_forward(q, k, v, mask, bias, D ** -0.5, Lq > 1, 0.0,
                                                 cs, splits)
            ref = reference_dmattn_func(q.float(), k.float(), v.float(), mask, bias.float(),
                                        is_causal=Lq > 1, cache_seqlens=cs)
            assert not out.isnan().any() and not lse.isnan().any(), (rnd, i)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            assert err < 2e-2, (rnd, i, err)


@pytest.mark.gpu
def test_gpu_decode_graph_replay_and_streams():
    # A captured step replays to the eager result after its inputs change in place, and two
    # streams decoding at once both get the eager results.
    from flash_dmattn.backends.triton import decode as decode_mod

    q, k, v, mask, bias, cs = _gpu_decode_case(2, 1, 32, 8, 128, 32768, 3)
    scale = 128 ** -0.5

    def step(qq):
        return decode_mod.decode_forward(qq, k, v, mask, bias, scale, False, 0.0, cs)[0]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(q)
    torch.cuda.current_stream().wait_stream(side)
    static_q = q.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(static_q)
    for seed in range(3):
        static_q.copy_(torch.randn(q.shape, device="cuda", dtype=q.dtype,
                                   generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        torch.testing.assert_close(static_out, step(static_q), atol=0, rtol=0)

    qs = [torch.randn_like(q) for _ in range(2)]
    want = [step(x) for x in qs]
    streams = [torch.cuda.Stream() for _ in range(2)]
    got = [None, None]
    for _ in range(20):
        for j, st in enumerate(streams):
            st.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(st):
                got[j] = step(qs[j])
        for st in streams:
            torch.cuda.current_stream().wait_stream(st)
        for j in range(2):
            torch.testing.assert_close(got[j], want[j], atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("Lq", [1, 4])
def test_gpu_decode_causal_gqa(Lq):
    dev, dtype = "cuda", torch.float16
    B, H, Hkv, D, Lk = 4, 32, 8, 128, 8192
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(B, Lq, H, D, device=dev, dtype=dtype, generator=g)
    k = torch.randn(B, Lk, Hkv, D, device=dev, dtype=dtype, generator=g)
    v = torch.randn(B, Lk, Hkv, D, device=dev, dtype=dtype, generator=g)
    cs = torch.tensor([0, 3, 5000, Lk], device=dev, dtype=torch.int32)
    out = triton_dmattn_func(q, k, v, is_causal=True, softcap=30.0, cache_seqlens=cs)
    ref = reference_dmattn_func(q.float(), k.float(), v.float(), is_causal=True, softcap=30.0,
                                cache_seqlens=cs)
    assert not out.isnan().any()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err
