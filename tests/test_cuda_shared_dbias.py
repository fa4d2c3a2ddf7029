"""dbias of per-query biases that several heads or batches share, e.g. ``(1, 1, Lq, Lk)`` or
``(Lq, Lk)`` (what flash-dmattn 1.2.x's CUDA kernel ran), and of per-query biases broadcast
over keys, on the cuda backend.

CPU: the host side (:func:`flash_dmattn.backends.cuda.kernels._shared_bias_backward`, chunks of
(batch, kv-head) pairs with the bias read through a broadcast view, dbias summed in fp32) with
a plain-PyTorch stand-in for the compiled module, against autograd of the float64 reference;
and that the cuda backend declines none of the random calls of issue 33's distribution.
GPU (marker ``gpu``): the compiled kernels on every bias broadcast shape.
"""
import pytest
import torch

from cuda_stand_in import DenseKernelModule
from interpreter_only import planner_device, skip_unless_available

from flash_dmattn.backends.cuda import kernels
from flash_dmattn.inputs import AttentionInputs

from naive import naive_attention


class ReferenceModule(DenseKernelModule):
    """The compiled module's backward for a full ``(B, H, Lq, Lk)`` bias (dbias mode 1),
    written in float64 PyTorch; records the bias shapes and modes it was called with."""

    def __init__(self):
        self.calls = []

    def bwd(self, dout, q, k, v, mask, bias, out, lse, scale, causal, softcap, need_dq,
            need_dkv, mode, *rest):
        self.calls.append((tuple(bias.shape), tuple(bias.stride()), mode))
        assert mode == kernels.DBIAS_FULL and bias.shape[:2] == q.shape[:1] + q.shape[2:3]
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        b = bias.detach().double().clone().requires_grad_()
        ref, _ = naive_attention(*leaves, mask, b, scale, causal, softcap)
        grads = torch.autograd.grad(ref, leaves + [b], dout.double())
        return tuple(g.to(q.dtype) for g in grads)


def _problem(B, Lq, Lk, H, Hkv, D, bias_shape, mask_shape=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Lq, H, D, generator=g)
    k = torch.randn(B, Lk, Hkv, D, generator=g)
    v = torch.randn(B, Lk, Hkv, D, generator=g)
    bias = torch.randn(*bias_shape, generator=g)
    mask = None if mask_shape is None else torch.rand(*mask_shape, generator=g) > 0.3
    # Masked calls are planned by the planner's Triton kernels: compiled on a GPU machine,
    # interpreted on CPU tensors elsewhere.
    dev = planner_device()
    return tuple(None if t is None else t.to(dev) for t in (q, k, v, mask, bias))


@pytest.mark.parametrize("bias_shape,mask_shape", [
    ((1, 1, 33, 40), None),            # one position bias for every batch and head
    ((2, 1, 33, 40), (2, 2, 33, 40)),  # per batch, shared by the heads; per-kv-head mask
    ((1, 2, 33, 40), (1, 1, 1, 40)),   # per kv head
    ((1, 4, 33, 40), None),            # per query head, shared by the batches
    ((2, 2, 33, 40), (2, 4, 33, 40)),  # per (batch, kv head)
])
@pytest.mark.parametrize("chunk_pairs", [1, 3, 100])
def test_shared_bias_backward_matches_autograd(monkeypatch, bias_shape, mask_shape, chunk_pairs):
    B, Lq, Lk, H, Hkv, D = 2, 33, 40, 4, 2, 16
    q, k, v, mask, bias = _problem(B, Lq, Lk, H, Hkv, D, bias_shape, mask_shape)
    group = H // Hkv
    # Chunks of `chunk_pairs` (batch, kv head) pairs: 1 = one pair a call, 3 = ragged chunks.
    monkeypatch.setattr(kernels, "SHARED_DBIAS_CHUNK_BYTES",
                        chunk_pairs * group * Lq * Lk * (q.element_size() + 4))
    module = ReferenceModule()
    monkeypatch.setattr(kernels, "kernel_module", lambda *a, **kw: module)
    scale, causal, softcap = D ** -0.5, True, 5.0
    leaves = [t.double().requires_grad_() for t in (q, k, v, bias)]
    ref, lse = naive_attention(*leaves[:3], mask, leaves[3], scale, causal, softcap)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1),
                       dtype=torch.float64).to(q.device)
    want = torch.autograd.grad(ref, leaves, dout)
    assert kernels.dbias_mode(bias, B, H, Lq, Lk) == kernels.DBIAS_SHARED
    got = kernels.cuda_backward(dout.float(), q, k, v, mask, bias, ref.detach().float(),
                                lse.detach().float(), scale, causal, softcap, False,
                                (True, True, True, True))
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), got, want):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=name)
    # Every (batch, kv head) pair once, at most `chunk_pairs` a call, the bias read through a
    # broadcast view of the chunk's (nb, nh, Lq, Lk) shape: no per-head copy of it.
    assert sum(shape[0] * shape[1] // group for shape, _, _ in module.calls) == B * Hkv
    for shape, stride, _ in module.calls:
        assert shape[2:] == (Lq, Lk) and shape[1] % group == 0
        assert shape[0] * shape[1] // group <= chunk_pairs
        for dim in (0, 1):
            if bias_shape[dim] == 1 or (dim == 1 and bias_shape[1] < shape[1]):
                assert stride[dim] == 0 or shape[dim] == 1, (shape, stride)


def test_per_query_bias_broadcast_over_keys_has_zero_gradient(monkeypatch):
    # A (.., Lq, 1) bias adds one constant to every key of a row: softmax is unchanged, so its
    # gradient is 0 (autograd agrees to rounding); the kernels run without any dbias output.
    B, Lq, Lk, H, Hkv, D = 1, 20, 30, 2, 1, 16
    q, k, v, _, bias = _problem(B, Lq, Lk, H, Hkv, D, (1, 2, 20, 1))
    assert kernels.dbias_mode(bias, B, H, Lq, Lk) == kernels.DBIAS_ZERO
    modes = []

    class NoDbias(ReferenceModule):
        def bwd(self, dout, q, k, v, mask, bias, out, lse, scale, causal, softcap, need_dq,
                need_dkv, mode, *rest):
            modes.append(mode)
            leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
            ref, _ = naive_attention(*leaves, mask, bias.double(), scale, causal, softcap)
            return tuple(g.to(q.dtype) for g in torch.autograd.grad(ref, leaves, dout.double())) + (None,)

    monkeypatch.setattr(kernels, "kernel_module", lambda *a, **kw: NoDbias())
    leaves = [t.double().requires_grad_() for t in (q, k, v, bias)]
    ref, lse = naive_attention(*leaves[:3], None, leaves[3], D ** -0.5, False, 0.0)
    dout = torch.randn(ref.shape, dtype=torch.float64).to(q.device)
    want = torch.autograd.grad(ref, leaves, dout)
    got = kernels.cuda_backward(dout.float(), q, k, v, None, bias, ref.detach().float(),
                                lse.detach().float(), D ** -0.5, False, 0.0, False,
                                (True, True, True, True))
    assert modes == [0]
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=name)


def test_issue_distribution_is_fully_covered():
    # tools/cuda_coverage.py: issue 33's random bf16 calls (D 64 / 128, every mask and bias
    # broadcast shape, GQA, causal, softcap, gradients of q, k, v and the bias) on sm_90.
    import subprocess
    import sys

    from tool_env import ROOT, tool_env

    res = subprocess.run([sys.executable, "tools/cuda_coverage.py", "--calls", "300"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=tool_env())
    assert res.returncode == 0, res.stderr[-2000:]
    assert "declines 0 of 300" in res.stdout, res.stdout


# ---------------------------------------------------------------------------------------------
# On the GPU: the compiled kernels
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("bias_shape", [
    (1, 1, "Lq", "Lk"), (2, 1, "Lq", "Lk"), (1, "Hkv", "Lq", "Lk"), (1, "H", "Lq", "Lk"),
    (2, "Hkv", "Lq", "Lk"), ("Lq", "Lk"), (2, "H", "Lq", 1), (1, 1, "Lq", 1),
], ids=str)
@pytest.mark.parametrize("mask_kind", [None, "topk", "padding"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_dbias_of_every_bias_broadcast(bias_shape, mask_kind, dtype):
    from test_cuda_backend import run_and_compare
    from test_gpu import make_problem

    B, Lq, Lk, H, Hkv, D = 2, 333, 290, 8, 2, 64
    q, k, v, mask, _ = make_problem(B, Lq, Lk, H, Hkv, D, dtype, mask_kind, None, seed=5)
    dims = {"Lq": Lq, "Lk": Lk, "H": H, "Hkv": Hkv}
    shape = tuple(dims.get(d, d) for d in bias_shape)
    g = torch.Generator(device="cuda").manual_seed(7)
    bias = torch.randn(*shape, device="cuda", dtype=dtype, generator=g)
    if shape[-1] != 1:
        run_and_compare((q, k, v, mask, bias), causal=True, softcap=0.0)
        return
    # Broadcast over keys: the exact gradient is 0 (no relative error to take); the other
    # gradients against the reference, then dbias exactly 0.
    run_and_compare((q, k, v, mask, bias), causal=True, softcap=0.0, bias_grad=False)
    from flash_dmattn import registry

    leaves = [t.detach().requires_grad_() for t in (q, k, v, bias)]
    inputs = AttentionInputs.from_args(*leaves[:3], mask, leaves[3], None, True)
    out = registry.get_backend("cuda").attention(inputs)
    dbias, = torch.autograd.grad(out, leaves[3], torch.randn_like(out))
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype
    assert torch.count_nonzero(dbias) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("d", [32, 128, 256])
def test_cuda_position_bias_dbias_like_flash_dmattn_1_2(d):
    # Code written for flash-dmattn 1.2.x: one (1, 1, L, L) bias (its backward_equivalence
    # benchmark's first case) with gradients of q, k, v and the bias, causal, GQA.
    from test_cuda_backend import run_and_compare
    from test_gpu import make_problem

    q, k, v, _, _ = make_problem(2, 128, 128, 4, 2, d, torch.bfloat16, None, None, seed=2)
    bias = torch.randn(1, 1, 128, 128, device="cuda", dtype=torch.bfloat16)
    run_and_compare((q, k, v, None, bias), causal=True)


@pytest.mark.gpu
def test_cuda_shared_dbias_in_small_chunks(monkeypatch):
    # One (batch, kv head) pair a chunk: the chunk loop and the fp32 sums, on the kernels.
    from test_cuda_backend import run_and_compare
    from test_gpu import make_problem

    monkeypatch.setattr(kernels, "SHARED_DBIAS_CHUNK_BYTES", 1)
    q, k, v, mask, _ = make_problem(2, 200, 300, 6, 3, 128, torch.bfloat16, "topk", None)
    bias = torch.randn(1, 3, 200, 300, device="cuda", dtype=torch.bfloat16)
    run_and_compare((q, k, v, mask, bias), causal=False, softcap=20.0)


@pytest.mark.gpu
def test_cuda_auto_dispatch_runs_shared_bias_training_on_cuda():
    from flash_dmattn import registry

    skip_unless_available("cuda")
    q = torch.randn(1, 256, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(1, 1, 256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    inputs = AttentionInputs.from_args(q, q.detach(), q.detach(), None, bias)
    assert registry.get_backend("cuda").not_supported_reasons(inputs) == []
