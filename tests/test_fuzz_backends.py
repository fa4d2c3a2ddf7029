"""Random calls through every backend: each either declines up front with a reason or answers
correctly (outputs and gradients against the float64 implementation of tests/naive.py); no
internal error escapes, and auto-dispatch answers every call.

CPU: torch-reference and flex (forward) on float32, and the Triton kernels under the
interpreter (slow tier). GPU (marker ``gpu``): cuda, triton and flex on bf16 / fp16 over
random shapes, head dims, broadcasts, GQA groups, causal, softcap and ``-inf`` biases.
"""
import random

import pytest
import torch
from hypothesis import given, settings

from flash_dmattn import flash_dmattn_func, registry
from flash_dmattn.inputs import AttentionInputs

from cases import Case, cases
from interpreter_only import interpreting, skip_unless_available
from naive import naive_attention


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def assert_matches(label, got, want, tol, relative, scale=None):
    """``relative``: the norm-wise relative error of tests/test_gpu.py (low-precision kernels);
    else element-wise ``assert_close`` as tests/test_triton_backend.py.

    A bias broadcast over whole softmax rows (its key dim 1) shifts each row by a constant: its
    gradient is 0 exactly, a sum of score gradients that cancel, so it has no relative error.
    Its entries are held to ``tol`` times ``scale``, the magnitudes of what each entry adds up
    (what rounding in those sums is relative to; see :func:`score_gradient_scale`)."""
    got, want = got.double().cpu(), want.double().cpu()
    assert got.shape == want.shape and not got.isnan().any(), label
    if scale is not None and want.abs().max() <= 1e-9 * scale.max():
        excess = (got - want).abs() - tol * scale
        assert excess.max() <= 0, (label, "cancelling sum", excess.max().item())
    elif not relative:
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=label)
    else:
        assert rel_err(got, want) < tol, (label, rel_err(got, want))


def score_gradient_scale(case, rq, rk, rv, rmask, rbias, gout):
    """For each entry of the bias: the sum, over the (batch, head, query, key) entries of the
    score gradient it is broadcast to, of the magnitudes of the terms each such entry
    ``dS = P (dP - delta)`` is computed from, ``P (|dP| + |delta|)`` (float64 reference). A
    kernel's dS carries rounding relative to those terms even where they cancel to 0 (a row
    with one visible key has P = 1 and dP = delta)."""
    B, Lq, H, _ = rq.shape
    Lk, Hkv = rk.shape[1], rk.shape[2]
    b4 = rbias.detach()
    while b4.dim() < 4:
        b4 = b4[None]
    bx, hx, qx, kx = b4.shape
    per_kv_head = hx == Hkv and Hkv != H
    full = (b4.repeat_interleave(H // Hkv, dim=1) if per_kv_head else b4).expand(B, H, Lq, Lk)
    full = full.clone().requires_grad_()
    _, lse = naive_attention(rq.detach(), rk.detach(), rv.detach(), rmask, full, case.scale,
                             case.causal, case.softcap)
    # d lse / d S = P (rows without a visible key: no probabilities, 0).
    p, = torch.autograd.grad(lse, full, torch.where(torch.isfinite(lse), 1.0, 0.0))
    p = torch.nan_to_num(p)
    v = rv.detach().repeat_interleave(H // Hkv, dim=2)  # (B, Lk, H, D)
    dp = torch.einsum("bihd,bjhd->bhij", gout, v)
    delta = (p * dp).sum(-1, keepdim=True)
    x = p * (dp.abs() + delta.abs())
    x = x.view(B, Hkv, H // Hkv, Lq, Lk).sum(2) if per_kv_head else x
    for dim, size in enumerate((bx, hx, qx, kx)):
        if size == 1 and x.shape[dim] > 1:
            x = x.sum(dim, keepdim=True)
    return x.reshape(rbias.shape)


def run_or_decline(name, case, dtype, device, grads, tol, grad_tol, relative=False):
    """Run ``case`` on backend ``name`` (None: auto-dispatch). Returns ``"declined"`` (with
    non-empty reasons) or ``"ran"`` after checking the output and, with ``grads``, every
    gradient against the float64 reference; any other exception fails the test."""
    q, k, v, mask, bias = case.tensors(dtype=dtype, device=device, requires_grad=grads)
    args = (q, k, v, mask, bias, case.scale, case.causal, case.softcap)
    if name is None:
        out = flash_dmattn_func(*args)
    else:
        backend = registry.get_backend(name)
        inputs = AttentionInputs.from_args(*args)
        reasons = backend.not_supported_reasons(inputs)
        if reasons:
            assert all(isinstance(r, str) and r.strip() for r in reasons), reasons
            return "declined"
        out = backend.attention(inputs)
    leaves = [t for t in (q, k, v, bias) if t is not None]
    # The reference runs on CPU in float64 (tests/naive.py builds its masks there).
    ref_leaves = [t.detach().cpu().double().requires_grad_(grads) for t in leaves]
    rq, rk, rv = ref_leaves[:3]
    rbias = ref_leaves[3] if bias is not None else None
    rmask = None if mask is None else mask.cpu()
    ref, _ = naive_attention(rq, rk, rv, rmask, rbias, case.scale, case.causal, case.softcap)
    assert out.shape == q.shape and out.dtype == dtype
    assert_matches("out", out, ref, tol, relative)
    if grads:
        gout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(case.seed),
                           dtype=torch.float64)
        got = torch.autograd.grad(out, leaves, gout.to(device=device, dtype=out.dtype))
        want = torch.autograd.grad(ref, ref_leaves, gout)
        for label, a, b in zip(("dq", "dk", "dv"), got, want):
            assert_matches(label, a, b, grad_tol, relative)
        if bias is not None:
            scale = score_gradient_scale(case, rq, rk, rv, rmask, rbias, gout)
            assert_matches("dbias", got[3], want[3], grad_tol, relative, scale)
    return "ran"


# float32 on CPU: the tolerances of tests/test_triton_backend.py (2e-5, gradients 10x).
CPU_TOL, CPU_GRAD_TOL = 2e-5, 2e-4


@settings(max_examples=15, deadline=None)
@given(cases(max_len=70, head_dims=(8, 16, 24, 64)))
def test_cpu_backends_answer_or_decline(case):
    for name in ("torch-reference", "flex", None):
        for grads in (False, True):
            run_or_decline(name, case, torch.float32, "cpu", grads, CPU_TOL, CPU_GRAD_TOL)


@pytest.mark.skipif(not interpreting(), reason="the Triton kernels run on CPU only interpreted")
@settings(max_examples=6, deadline=None)
@given(cases(max_len=24, head_dims=(16,)))
def test_interpreted_triton_answers_or_declines(case):
    skip_unless_available("triton")
    for grads in (False, True):
        run_or_decline("triton", case, torch.float32, "cpu", grads, CPU_TOL, CPU_GRAD_TOL)


def random_gpu_cases(n, seed, head_dims):
    """``n`` random GPU-sized calls: odd lengths up to 300, ``head_dims``, GQA groups 1-4,
    every mask / bias broadcast, causal, softcap, ``-inf`` biases."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        b, hkv = rng.choice([1, 2]), rng.choice([1, 2])
        h = hkv * rng.choice([1, 2, 4])
        lq, lk = rng.randint(1, 300), rng.randint(1, 300)

        def aux():
            if rng.random() < 0.3:
                return None
            return (rng.choice([1, b]), rng.choice(sorted({1, hkv, h})), rng.choice([1, lq]),
                    rng.choice([1, lk]))

        out.append(Case(b, lq, lk, h, hkv, rng.choice(head_dims), aux(), aux(),
                        rng.random() < 0.5, rng.choice([0.0, 0.0, 5.0]),
                        empty_rows=rng.random() < 0.3, neg_inf_bias=rng.random() < 0.2,
                        seed=seed * 1000 + i))
    return out


# Per backend and dtype: how many random calls, of which head dims. Every distinct head-dim
# bucket, dtype and mask / bias presence is a cuda kernel module of its own (built on first
# use, tens of seconds each) and every distinct shape a flex compile of its own, so those two
# take fewer calls and head dims than triton.
GPU_RUNS = [
    pytest.param("cuda", torch.bfloat16, 24, (64, 128), id="cuda-bf16"),
    pytest.param("cuda", torch.float16, 8, (64,), id="cuda-fp16"),
    pytest.param("triton", torch.bfloat16, 24, (32, 64, 80, 96, 128), id="triton-bf16"),
    pytest.param("triton", torch.float16, 12, (64, 128), id="triton-fp16"),
    pytest.param("flex", torch.bfloat16, 10, (64, 128), id="flex-bf16"),
    pytest.param("flex", torch.float16, 6, (64,), id="flex-fp16"),
    pytest.param(None, torch.bfloat16, 16, (64, 128), id="auto-bf16"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name,dtype,calls,head_dims", GPU_RUNS)
def test_gpu_backends_answer_or_decline(name, dtype, calls, head_dims, request):
    if name is not None:
        skip_unless_available(name)
    # Recording the cuda modules the suite needs (--record-cuda-specs): a call that asks for a
    # module skips there; the other calls go on, so that every module of the run is listed.
    recording = request.config.getoption("--record-cuda-specs")
    recorded = False
    # The tolerances of tests/test_gpu.py: bf16 / fp16 output rounding, gradients 2x.
    tol = 1.5e-2 if dtype == torch.bfloat16 else 3e-3
    ran = 0
    for case in random_gpu_cases(calls, 33, head_dims):
        for grads in (False, True):
            try:
                ran += run_or_decline(name, case, dtype, "cuda", grads, tol, 2 * tol,
                                      relative=True) == "ran"
            except pytest.skip.Exception:
                if not recording:
                    raise
                recorded = True
    if recorded:
        pytest.skip("recorded the cuda modules of these calls")
    assert ran > 0
