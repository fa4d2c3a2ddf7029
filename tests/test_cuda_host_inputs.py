"""What the cuda backend's host side makes of inputs its kernels do not read as they are
(issue 33: cuda covers what flash-dmattn 1.2.x's CUDA kernel ran):

* a float32 bias beside fp16 / bf16 q, k, v (docs/contract.md §3.2) is converted to q's dtype
  for the kernels (:func:`flash_dmattn.backends.cuda.extension.kernel_bias`: broadcast dims
  stay broadcast, finite values beyond the dtype's range saturate, ``+-inf`` stays), and its
  gradient is summed in fp32 and comes back in float32 (§3.3);
* a head dim that is not a multiple of 8 is zero-padded to one
  (:func:`flash_dmattn.backends.cuda.kernels.pad_head_dim`), which is exact; KV-cache calls
  with such a head dim are declined (padding would copy the cache every step).

CPU: the conversion and padding helpers, the reasons (meta tensors with a simulated Hopper),
and ``cuda_forward`` / ``cuda_backward`` with a float64 PyTorch stand-in for the compiled module
against autograd of the float64 reference. GPU (marker ``gpu``): the compiled kernels on the
new cases, outputs and every gradient against the reference in float64.
"""
import subprocess
import sys

import pytest
import torch

from flash_dmattn import policy
from flash_dmattn.__main__ import described_call
from flash_dmattn.backends.cuda import kernels
from flash_dmattn.backends.cuda.backend import CudaBackend
from flash_dmattn.backends.cuda.extension import kernel_bias, reduce_key_partials

from cuda_stand_in import DenseKernelModule
from interpreter_only import planner_device, skip_unless_available
from naive import expand_heads, naive_attention
from tool_env import ROOT, tool_env


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------
# kernel_bias: a float32 bias as the kernels read it
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_kernel_bias_converts_and_saturates(dtype):
    big = torch.finfo(dtype).max
    f32 = torch.finfo(torch.float32)
    bias = torch.tensor([0.5, -3.25, 1e9, -1e9, f32.max, f32.min, float("inf"),
                         float("-inf"), float("nan"), 0.0]).view(1, 1, 1, 10)
    got = kernel_bias(bias, dtype)
    assert got.dtype == dtype and got.shape == bias.shape
    want = torch.where(bias.isinf(), bias, bias.clamp(-big, big)).to(dtype)
    assert torch.equal(got[..., :8], want[..., :8])
    assert got[..., 8].isnan().all() and got[..., 9] == 0
    # Values in range are the plain conversion; the big finite ones stay finite.
    assert torch.equal(got[..., :2], bias[..., :2].to(dtype))
    assert torch.isfinite(got[..., 2:6]).all()
    assert got[..., 6] == float("inf") and got[..., 7] == float("-inf")


def test_kernel_bias_keeps_broadcast_dims_and_its_input():
    base = torch.randn(2, 1, 1, 40)
    bias = base.expand(2, 4, 33, 40)  # a user's expanded bias (stride 0 over heads, queries)
    got = kernel_bias(bias, torch.bfloat16)
    assert got.shape == bias.shape and got.stride()[1:3] == (0, 0)
    assert got.untyped_storage().nbytes() == base.numel() * 2  # its own size, half the bytes
    assert torch.equal(got, bias.to(torch.bfloat16))
    assert base.dtype == torch.float32  # the caller's tensor is untouched
    same = torch.randn(1, 1, 4, 4, dtype=torch.float16)
    assert kernel_bias(same, torch.float16) is same and kernel_bias(None, torch.float16) is None


def test_reduce_key_partials_in_the_requested_dtype():
    partial = torch.randn(2, 4, 10, dtype=torch.float32)
    bias = torch.zeros(1, 2, 1, 10, dtype=torch.bfloat16)
    got = reduce_key_partials(partial, bias, torch.float32)
    assert got.dtype == torch.float32 and got.shape == bias.shape
    want = partial.view(2, 2, 2, 10).sum(2).sum(0, keepdim=True).unsqueeze(2)
    torch.testing.assert_close(got, want)
    assert reduce_key_partials(partial, bias).dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# Head-dim padding
# ---------------------------------------------------------------------------------------------

def test_pad_head_dim_shapes_and_zeros():
    q, k = torch.randn(1, 5, 2, 20), torch.randn(1, 7, 1, 20)
    pq, pk = kernels.pad_head_dim(q, k)
    assert pq.shape == (1, 5, 2, 24) and pk.shape == (1, 7, 1, 24)
    assert torch.equal(pq[..., :20], q) and not pq[..., 20:].any()
    assert kernels.head_dim_padding(24) == 0 and kernels.head_dim_padding(1) == 7
    x = torch.randn(1, 3, 2, 64)
    assert kernels.pad_head_dim(x)[0] is x  # already a multiple of 8: no copy
    assert kernels.pad_head_dim(x, None)[1] is None
    out = kernels._unpad(pq, 20)
    assert out.shape == q.shape and out.is_contiguous() and torch.equal(out, q)


# ---------------------------------------------------------------------------------------------
# The reasons, on CPU with a simulated Hopper
# ---------------------------------------------------------------------------------------------

def _reasons(**call):
    with policy.simulated_capability((9, 0)):
        inputs = described_call(capability=(9, 0), **call)
        backend = CudaBackend()
        if call.get("varlen"):
            return backend.varlen_not_supported_reasons(inputs)
        return backend.not_supported_reasons(inputs)


@pytest.mark.parametrize("bias", ["B,H,Lq,Lk", "B,Hkv,1,Lk", "1,1,Lq,Lk", "Lq,Lk", "1,H,Lq,1"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_no_reason_for_a_float32_bias(bias, dtype):
    shape = "B=2,H=8,Hkv=2,Lq=300,Lk=333,D=64"
    assert _reasons(shape=shape, dtype=dtype, mask="B,Hkv,Lq,Lk", bias=bias, bias_dtype="fp32",
                    causal=True, train=True, bias_grad=True) == []


@pytest.mark.parametrize("d", [1, 20, 36, 100, 250, 256])
def test_no_reason_for_any_head_dim_up_to_256(d):
    shape = f"B=1,H=4,Hkv=2,Lq=100,Lk=100,D={d}"
    assert _reasons(shape=shape, mask="B,1,1,Lk", bias="B,Hkv,Lq,Lk", bias_dtype="fp32",
                    train=True, bias_grad=True) == []
    # Packed sequences and key intervals take them too.
    assert _reasons(shape=shape, bias="Hkv,1,1,Lk", bias_dtype="fp32", varlen=True,
                    train=True, bias_grad=True) == []
    if d <= 128:
        assert _reasons(shape=shape, mask="intervals", bias="B,Hkv,1,Lk",
                        bias_dtype="fp32", train=True, bias_grad=True) == []


def test_reasons_left_for_head_dims():
    big = _reasons(shape="B=1,H=4,Hkv=2,Lq=100,Lk=100,D=264")
    assert any("head_dim 264" in r for r in big)
    cache = _reasons(shape="B=1,H=4,Hkv=2,Lq=1,Lk=4096,D=100", cache_seqlens=True)
    assert any("not a multiple of 8 with a KV cache" in r for r in cache)
    assert _reasons(shape="B=1,H=4,Hkv=2,Lq=1,Lk=4096,D=96", cache_seqlens=True) == []


def test_issue33_distribution_is_covered():
    # tools/cuda_coverage.py --preset issue33: bf16 and fp16, head dims 64 / 128 / any
    # multiple of 8 up to 256, every mask and bias broadcast, half the biases float32, GQA,
    # causal, softcap, with and without gradients (target: at most 10 % declined).
    res = subprocess.run([sys.executable, "tools/cuda_coverage.py", "--preset", "issue33",
                          "--calls", "400"], capture_output=True, text=True, timeout=300,
                         cwd=ROOT, env=tool_env())
    assert res.returncode == 0, res.stderr[-2000:]
    assert "declines 0 of 400" in res.stdout, res.stdout


# ---------------------------------------------------------------------------------------------
# cuda_forward / cuda_backward with a float64 stand-in for the compiled module
# ---------------------------------------------------------------------------------------------

class StandIn(DenseKernelModule):
    """The compiled module's dense ``fwd`` and ``bwd`` written in float64 PyTorch; records the
    head dims and bias dtypes it was given (what the kernels would read)."""

    def __init__(self):
        self.seen = []

    def _note(self, q, bias):
        self.seen.append((q.shape[-1], None if bias is None else bias.dtype))

    def fwd(self, q, k, v, mask, bias, _, scale, causal, softcap, *rest):
        self._note(q, bias)
        out, lse = naive_attention(q, k, v, mask, bias, scale, causal, softcap)
        return out.to(q.dtype).contiguous(), lse.float()

    def bwd(self, dout, q, k, v, mask, bias, out, lse, scale, causal, softcap, need_dq,
            need_dkv, mode, *rest):
        self._note(q, bias)
        B, Lq, H, _ = q.shape
        Lk, Hkv = k.shape[1], k.shape[2]
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        full = None
        if bias is not None:
            b4 = bias.detach().double()
            full = expand_heads(b4, B, H, Hkv, Lq, Lk).clone().requires_grad_()
        with torch.enable_grad():  # also when autograd's backward calls it
            ref, _ = naive_attention(*leaves, mask, full, scale, causal, softcap)
            grads = torch.autograd.grad(ref, leaves + ([full] if full is not None else []),
                                        dout.double())
        dq, dk, dv = (g.to(q.dtype) for g in grads[:3])
        db = None
        if mode == kernels.DBIAS_FULL:
            db = grads[3].to(q.dtype)
        elif mode == kernels.DBIAS_KEYS:
            db = grads[3].sum(2).float()  # (B, H, Lk) per-(batch, head) key sums
        return dq, dk, dv, db


CPU_CASES = [
    # (head dim, bias shape, mask shape)
    (20, (2, 4, 33, 40), (2, 2, 33, 40)),     # full bias: dbias written whole
    (64, (2, 2, 1, 40), (2, 1, 1, 40)),       # per kv head and key: key sums
    (36, (1, 1, 33, 40), None),               # one position bias: the shared backward
    (64, (33, 40), (1, 1, 33, 40)),           # (Lq, Lk)
    (12, (1, 4, 33, 1), None),                # per query, broadcast over keys: dbias 0
]


@pytest.mark.parametrize("d,bias_shape,mask_shape", CPU_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_float32_bias_and_padded_head_dim_against_autograd(monkeypatch, d, bias_shape,
                                                           mask_shape, dtype):
    B, Lq, Lk, H, Hkv = 2, 33, 40, 4, 2
    g = torch.Generator().manual_seed(d)
    q = torch.randn(B, Lq, H, d, generator=g).to(dtype)
    k = torch.randn(B, Lk, Hkv, d, generator=g).to(dtype)
    v = torch.randn(B, Lk, Hkv, d, generator=g).to(dtype)
    bias = torch.randn(*bias_shape, generator=g) * 2  # float32
    bias4 = bias.view((1,) * (4 - bias.dim()) + tuple(bias.shape))
    mask = None if mask_shape is None else torch.rand(*mask_shape, generator=g) > 0.3
    # Masked calls are planned by the planner's Triton kernels: compiled on a GPU machine,
    # interpreted on CPU tensors elsewhere.
    dev = planner_device()
    q, k, v, bias4 = (t.to(dev) for t in (q, k, v, bias4))
    mask = None if mask is None else mask.to(dev)
    module = StandIn()
    monkeypatch.setattr(kernels, "kernel_module", lambda *a, **kw: module)
    scale, causal, softcap = d ** -0.5, True, 5.0

    out, lse = kernels.cuda_forward(q, k, v, mask, bias4, scale, causal, softcap)
    # What the kernels read: a head dim padded to a multiple of 8, the bias in q's dtype.
    assert module.seen == [(d + kernels.head_dim_padding(d), dtype)]
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()

    # The reference with the bias the kernels read (rounded to q's dtype): equal up to the
    # output's rounding, so the padding and the conversion are exact.
    read = bias4.to(dtype).double()
    leaves = [t.double().requires_grad_() for t in (q, k, v)] + [read.requires_grad_()]
    ref, ref_lse = naive_attention(*leaves[:3], mask, leaves[3], scale, causal, softcap)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert rel_err(out, ref) < tol
    torch.testing.assert_close(lse.double(), ref_lse.detach(), atol=1e-5, rtol=1e-5)

    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64).to(dev)
    want = torch.autograd.grad(ref, leaves, dout)
    module.seen.clear()
    got = kernels.cuda_backward(dout.to(dtype), q, k, v, mask, bias4, out, lse, scale, causal,
                                softcap, False, (True, True, True, True))
    assert module.seen and all(s == (d + kernels.head_dim_padding(d), dtype)
                               for s in module.seen)
    for name, a, b, like in zip(("dq", "dk", "dv", "dbias"), got, want, (q, k, v, bias4)):
        assert a.shape == like.shape and a.dtype == like.dtype, name
        if name == "dbias" and bias_shape[-1] == 1:
            assert torch.count_nonzero(a) == 0  # the exact gradient (autograd: rounding)
            continue
        assert rel_err(a, b) < 2 * tol, (name, rel_err(a, b))
    assert got[3].dtype == torch.float32


def test_float32_bias_through_the_op_returns_a_float32_gradient(monkeypatch):
    """The registered op pair with autograd (what the backend's attention runs): the caller's
    float32 bias of shape (Lq, Lk) gets a float32 gradient of that shape, and q / k / v of
    head dim 20 theirs."""
    from flash_dmattn.backends.cuda.backend import cuda_op

    module = StandIn()
    monkeypatch.setattr(kernels, "kernel_module", lambda *a, **kw: module)
    # A training forward asks for its backward's module too.
    monkeypatch.setattr(kernels, "kernel_modules", lambda *a, ops, **kw: dict.fromkeys(ops, module))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 17, 2, 20, generator=g).to(torch.bfloat16).requires_grad_()
               for _ in range(3))
    bias = torch.randn(17, 17, generator=g, requires_grad=True)
    out, _ = cuda_op()(q, k, v, None, bias.view(1, 1, 17, 17), 20 ** -0.5, True, 0.0, False)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert bias.grad.shape == bias.shape and bias.grad.dtype == torch.float32
    assert q.grad.shape == q.shape and k.grad.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# On the GPU: the compiled kernels
# ---------------------------------------------------------------------------------------------

def _gpu_problem(B, Lq, Lk, H, Hkv, D, dtype, mask_kind, seed=0):
    from test_gpu import make_problem

    return make_problem(B, Lq, Lk, H, Hkv, D, dtype, mask_kind, None, seed=seed)[:4]


@pytest.mark.gpu
@pytest.mark.parametrize("bias_shape", [
    ("B", "H", "Lq", "Lk"), ("B", "Hkv", 1, "Lk"), (1, 1, "Lq", "Lk"), ("B", "Hkv", "Lq", "Lk"),
    ("Lq", "Lk"), (1, "H", "Lq", 1),
], ids=str)
@pytest.mark.parametrize("mask_kind", [None, "topk", "padding"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_float32_bias_every_broadcast(bias_shape, mask_kind, dtype):
    from test_cuda_backend import run_and_compare

    B, Lq, Lk, H, Hkv, D = 2, 300, 333, 8, 2, 64
    q, k, v, mask = _gpu_problem(B, Lq, Lk, H, Hkv, D, dtype, mask_kind, seed=4)
    dims = {"B": B, "Lq": Lq, "Lk": Lk, "H": H, "Hkv": Hkv}
    shape = tuple(dims.get(x, x) for x in bias_shape)
    g = torch.Generator(device="cuda").manual_seed(8)
    bias = torch.randn(*shape, device="cuda", generator=g)  # float32
    over_keys = shape[-1] == 1
    run_and_compare((q, k, v, mask, bias), causal=True, softcap=0.0, bias_grad=not over_keys)
    if over_keys:
        _check_zero_dbias(q, k, v, mask, bias)


def _check_zero_dbias(q, k, v, mask, bias):
    from flash_dmattn import registry
    from flash_dmattn.inputs import AttentionInputs

    leaves = [t.detach().requires_grad_() for t in (q, k, v, bias)]
    inputs = AttentionInputs.from_args(*leaves[:3], mask, leaves[3], None, True)
    out = registry.get_backend("cuda").attention(inputs)
    dbias, = torch.autograd.grad(out, leaves[3], torch.randn_like(out))
    assert dbias.shape == bias.shape and dbias.dtype == torch.float32
    assert torch.count_nonzero(dbias) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_float32_additive_mask_with_float32_min_and_inf(dtype):
    # An additive padding mask built in float32 (torch.finfo(torch.float32).min, beyond fp16's
    # range) and -inf entries: saturated, not turned into NaN or -inf rows.
    from test_cuda_backend import run_and_compare

    q, k, v, _ = _gpu_problem(2, 200, 256, 4, 2, 128, dtype, None, seed=6)
    bias = torch.zeros(2, 1, 200, 256, device="cuda")
    bias[0, ..., 180:] = torch.finfo(torch.float32).min
    bias[1, ..., ::5] = float("-inf")
    bias[1, ..., 7, :] = float("-inf")  # a whole row: output 0, gradients 0
    bias += torch.randn(2, 1, 200, 256, device="cuda", generator=torch.Generator(
        device="cuda").manual_seed(1)).clamp(-3, 3)
    run_and_compare((q, k, v, None, bias), causal=False)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [20, 36, 100, 250])
@pytest.mark.parametrize("mask_kind,bias_kind", [(None, None), ("topk", "per_key32"),
                                                 ("block_sparse", "full")])
def test_cuda_head_dims_not_multiple_of_8(d, mask_kind, bias_kind):
    from test_cuda_backend import run_and_compare

    B, Lq, Lk, H, Hkv = 2, 257, 190, 4, 2
    q, k, v, mask = _gpu_problem(B, Lq, Lk, H, Hkv, d, torch.bfloat16, mask_kind, seed=d)
    g = torch.Generator(device="cuda").manual_seed(d)
    bias = None
    if bias_kind == "per_key32":
        bias = torch.randn(B, Hkv, 1, Lk, device="cuda", generator=g)
    elif bias_kind == "full":
        bias = torch.randn(B, H, Lq, Lk, device="cuda", generator=g).to(torch.bfloat16)
    run_and_compare((q, k, v, mask, bias), causal=True, softcap=20.0 if d == 36 else 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 100])
def test_cuda_decode_float32_bias(d):
    # One query against a long key range: the split-KV decode forward, float32 per-key bias.
    from test_cuda_backend import run_and_compare

    q, k, v, _ = _gpu_problem(2, 1, 4096, 8, 2, d, torch.bfloat16, None, seed=9)
    bias = torch.randn(2, 2, 1, 4096, device="cuda")
    run_and_compare((q, k, v, None, bias), causal=True)


def _grads_against_reference(out, ref, got_leaves, ref_leaves, tol):
    """Output and every gradient against the float64 reference (dtypes and shapes of the
    caller's tensors)."""
    assert not out.isnan().any()
    assert rel_err(out, ref) < tol, rel_err(out, ref)
    gout = torch.randn_like(ref)
    got = torch.autograd.grad(out, got_leaves, gout.to(out.dtype))
    want = torch.autograd.grad(ref, ref_leaves, gout)
    for name, a, b, like in zip(("dq", "dk", "dv", "dbias"), got, want, got_leaves):
        assert a.shape == like.shape and a.dtype == like.dtype, name
        assert not a.isnan().any(), name
        assert rel_err(a, b) < 2 * tol, (name, rel_err(a, b))


@pytest.mark.gpu
def test_cuda_varlen_float32_bias_and_head_dim_36():
    from flash_dmattn import registry
    from flash_dmattn.inputs import VarlenInputs
    from flash_dmattn.reference import reference_attention
    from flash_dmattn.utils.padding import cu_seqlens_from_lengths

    skip_unless_available("cuda")
    g = torch.Generator().manual_seed(2)
    h, hkv, d = 4, 2, 36
    lens = [5, 130, 64, 301]
    cu = cu_seqlens_from_lengths(torch.tensor(lens)).cuda()
    total = sum(lens)
    q, k, v = (torch.randn(total, n, d, generator=g).to("cuda", torch.bfloat16).requires_grad_()
               for n in (h, hkv, hkv))
    bias = torch.randn(hkv, total, generator=g).cuda().requires_grad_()  # float32, per key
    inputs = VarlenInputs.from_args(q, k, v, cu, cu, max(lens), max(lens), attn_bias=bias,
                                    is_causal=True)
    backend = registry.get_backend("cuda")
    assert backend.varlen_not_supported_reasons(inputs) == []
    out = backend.varlen_attention(inputs)
    # The reference: one dense float64 call per sequence.
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    outs = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        o, _ = reference_attention(leaves[0][None, s:e], leaves[1][None, s:e],
                                   leaves[2][None, s:e], None, leaves[3][None, :, None, s:e],
                                   d ** -0.5, True)
        outs.append(o[0])
    _grads_against_reference(out, torch.cat(outs), [q, k, v, bias], leaves, 1.5e-2)


@pytest.mark.gpu
def test_cuda_key_intervals_float32_bias():
    from flash_dmattn import registry
    from flash_dmattn.inputs import AttentionInputs
    from flash_dmattn.reference import reference_attention
    from flash_dmattn.utils.mask import topk_intervals

    skip_unless_available("cuda")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the cuda key-interval kernels are built for sm_90 only")
    g = torch.Generator(device="cuda").manual_seed(5)
    B, L, H, Hkv, D = 1, 1024, 4, 2, 72
    q, k, v = (torch.randn(B, L, n, D, device="cuda", generator=g).to(torch.bfloat16)
               .requires_grad_() for n in (H, Hkv, Hkv))
    bias = torch.randn(B, Hkv, 1, L, device="cuda", generator=g).requires_grad_()  # float32
    mask = topk_intervals(bias.detach(), window_size=256)
    inputs = AttentionInputs.from_args(q, k, v, mask, bias, None, True)
    backend = registry.get_backend("cuda")
    assert backend.not_supported_reasons(inputs) == []
    out = backend.attention(inputs)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    ref, _ = reference_attention(*leaves[:3], mask.to_dense(L), leaves[3], D ** -0.5, True)
    _grads_against_reference(out, ref, [q, k, v, bias], leaves, 1.5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("bias_heads", ["Hkv", 1])
def test_cuda_runs_flash_dmattn_1_2_training_code_unchanged(bias_dtype, bias_heads):
    """Code written for flash-dmattn 1.2.x's flash_dmattn_func: a bias ``(B, Hkv or 1, Lq,
    Lk)`` made by expanding a per-key state over the queries (stride 0), a non-leaf whose
    gradient is kept with retain_grad, a top-k bool mask, gradients of q, k, v and the bias,
    keyword arguments as 1.2.x spelt them; on the cuda backend."""
    from flash_dmattn import flash_dmattn_func_auto

    skip_unless_available("cuda")
    func = flash_dmattn_func_auto(backend="cuda")
    g = torch.Generator(device="cuda").manual_seed(11)
    B, L, H, Hkv, D, W = 2, 512, 8, 2, 128, 128
    q = torch.randn(B, L, H, D, device="cuda", generator=g, dtype=torch.bfloat16,
                    requires_grad=True)
    k = torch.randn(B, L, Hkv, D, device="cuda", generator=g, dtype=torch.bfloat16,
                    requires_grad=True)
    v = torch.randn(B, L, Hkv, D, device="cuda", generator=g, dtype=torch.bfloat16,
                    requires_grad=True)
    hb = Hkv if bias_heads == "Hkv" else 1
    zoh = torch.rand(B, hb, L, device="cuda", generator=g, dtype=bias_dtype,
                     requires_grad=True)
    attn_bias = zoh[:, :, None, :].expand(-1, -1, L, -1)
    attn_bias.retain_grad()
    idx = attn_bias.detach().topk(W, dim=-1).indices
    attn_mask = torch.zeros(B, hb, L, L, device="cuda", dtype=torch.bool).scatter_(-1, idx, True)
    out = func(query=q, key=k, value=v, attn_mask=attn_mask, attn_bias=attn_bias,
               softmax_scale=D ** -0.5, is_causal=True, softcap=0.0, deterministic=False,
               return_attn_probs=False)
    out.sum().backward()
    from flash_dmattn.reference import reference_attention

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_bias = attn_bias.detach().double().requires_grad_()
    ref, _ = reference_attention(*leaves, attn_mask, ref_bias, D ** -0.5, True)
    assert rel_err(out, ref) < 1.5e-2
    ref.sum().backward()
    for name, a, b in (("dq", q.grad, leaves[0].grad), ("dk", k.grad, leaves[1].grad),
                       ("dv", v.grad, leaves[2].grad), ("dbias", attn_bias.grad, ref_bias.grad)):
        assert a.shape == b.shape, name
        assert rel_err(a, b) < 3e-2, (name, rel_err(a, b))
    assert attn_bias.grad.dtype == bias_dtype and zoh.grad.dtype == bias_dtype
