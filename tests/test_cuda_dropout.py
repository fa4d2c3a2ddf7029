"""Attention dropout on the cuda backend: its sm_90 kernels draw the keep-mask of
:mod:`flash_dmattn.dropout` themselves (forward and backward, nothing of size (Lq, Lk)
stored), so :func:`flash_dmattn.testing.dropout_mask` rebuilds any call's mask and outputs and
every gradient are compared with the float64 formula on that mask (tests/test_dropout.py).

CPU: which calls the backend takes with dropout and which it declines (meta tensors, a
simulated Hopper), and the host side against a float64 stand-in for the compiled module that
draws the mask from the arguments the kernels get (the rng tensor, threshold, scale and the
batch / head offsets of a call that runs in chunks). GPU (marker ``gpu``): the kernels.
"""
import dataclasses

import pytest
import torch

from flash_dmattn import policy, testing
from flash_dmattn.__main__ import described_call
from flash_dmattn.backends.cuda import kernels
from flash_dmattn.backends.cuda.backend import CudaBackend
from flash_dmattn.dropout import keep_mask

from cuda_stand_in import DenseKernelModule
from interpreter_only import planner_device, skip_unless_available
from naive import assert_close
from test_dropout import (check_against_dense, check_graph_replays, check_varlen_per_sequence_masks,
                          dense_dropout_attention)

# ---------------------------------------------------------------------------------------------
# Which calls take dropout (CPU, meta tensors)
# ---------------------------------------------------------------------------------------------


def _reasons(p=0.1, capability=(9, 0), **call):
    with policy.simulated_capability(capability):
        inputs = described_call(capability=capability, **call)
        inputs = dataclasses.replace(inputs, dropout_p=p,
                                     dropout_rng=torch.empty(2, dtype=torch.int64, device="meta"))
        backend = CudaBackend()
        if call.get("varlen"):
            return backend.varlen_not_supported_reasons(inputs)
        return backend.not_supported_reasons(inputs)


@pytest.mark.parametrize("call", [
    dict(shape="B=2,H=8,Hkv=2,Lq=300,Lk=333,D=64", mask="B,Hkv,Lq,Lk", bias="B,H,Lq,Lk",
         causal=True, train=True, bias_grad=True),
    dict(shape="B=1,H=4,Hkv=4,Lq=1,Lk=4096,D=128", bias="B,H,1,Lk", train=True),  # decode shape
    dict(shape="B=2,H=4,Hkv=2,Lq=100,Lk=100,D=100", bias="1,1,Lq,Lk", bias_dtype="fp32",
         train=True, bias_grad=True),
    dict(shape="B=1,H=4,Hkv=2,Lq=200,Lk=200,D=128", mask="intervals", bias="B,Hkv,1,Lk",
         causal=True, train=True, bias_grad=True),
    dict(shape="B=1,H=4,Hkv=2,Lq=100,Lk=100,D=64", varlen=True, causal=True, train=True),
], ids=["dense", "decode-shape", "shared-bias", "intervals", "varlen"])
def test_hopper_takes_dropout(call):
    assert _reasons(**call) == []


def test_declines_dropout_where_no_kernel_has_it():
    base = "B=1,H=4,Hkv=2,Lq=100,Lk=100"
    assert any("dropout with head_dim 256 > 128" in r
               for r in _reasons(shape=f"{base},D=256", train=True))
    assert any("dropout with a KV cache" in r
               for r in _reasons(shape="B=1,H=4,Hkv=2,Lq=1,Lk=4096,D=64", cache_seqlens=True))
    assert any("sm_90 (Hopper)" in r
               for r in _reasons(shape=f"{base},D=64", capability=(8, 0), train=True))
    # Without dropout those calls have no dropout reason.
    assert not any("dropout" in r for r in _reasons(p=0.0, shape=f"{base},D=256", train=True))


# ---------------------------------------------------------------------------------------------
# The host side with a float64 stand-in for the compiled module (CPU)
# ---------------------------------------------------------------------------------------------

class DropoutStandIn(DenseKernelModule):
    """The compiled module's dense ``fwd`` / ``bwd`` in float64 PyTorch, with the dropout the
    kernels draw from their trailing arguments ``(drop_rng, drop_threshold, drop_scale,
    drop_b0, drop_h0, drop_heads)``; records those arguments."""

    def __init__(self):
        self.drops = []

    def _keep(self, drop, B, H, Lq, Lk):
        rng, threshold, scale, b0, h0, heads = drop
        rng = rng.cpu()
        self.drops.append((threshold, scale, b0, h0, heads))
        assert scale == pytest.approx(1.0 / (1.0 - threshold / 256), rel=0.02)
        heads = heads or H
        b = torch.arange(B).view(-1, 1, 1, 1) + b0
        h = torch.arange(H).view(1, -1, 1, 1) + h0
        i = torch.arange(Lq).view(1, 1, -1, 1)
        j = torch.arange(Lk).view(1, 1, 1, -1)
        # keep_mask's threshold is round(256 p): p = threshold / 256 gives it back.
        return keep_mask(rng, threshold / 256, b, heads, h, i, j), 1.0 - 1.0 / scale

    def fwd(self, q, k, v, mask, bias, _, scale, causal, softcap, *rest):
        drop = rest[-6:]
        assert drop[0] is not None
        B, Lq, H, _ = q.shape
        keep, p = self._keep(drop, B, H, Lq, k.shape[1])
        out = dense_dropout_attention(q.cpu(), k.cpu(), v.cpu(), keep, p, mask=mask, scale=scale,
                                      bias=None if bias is None else bias.cpu(),
                                      causal=causal, softcap=softcap)
        return out.to(q.device, q.dtype).contiguous(), q.new_zeros(B, H, Lq, dtype=torch.float32)

    def bwd(self, dout, q, k, v, mask, bias, out, lse, scale, causal, softcap, need_dq,
            need_dkv, mode, *rest):
        drop = rest[-6:]
        B, Lq, H, _ = q.shape
        Lk = k.shape[1]
        keep, p = self._keep(drop, B, H, Lq, Lk)
        leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
        full = bias.detach().cpu().double().expand(B, H, Lq, Lk).clone().requires_grad_()
        with torch.enable_grad():
            ref = dense_dropout_attention(*leaves, keep, p, mask=mask, bias=full, scale=scale,
                                          causal=causal, softcap=softcap)
            grads = torch.autograd.grad(ref, leaves + [full], dout.cpu().double())
        assert mode == kernels.DBIAS_FULL
        return tuple(g.to(q.device, q.dtype) for g in grads)


def test_chunked_backward_draws_the_whole_calls_mask(monkeypatch):
    """A bias shared by batches and heads runs the backward in (batch, kv head) chunks
    (kernels._shared_bias_backward): each chunk's kernels get the offsets of its batches and
    heads, so together they draw the call's own keep-mask."""
    B, Lq, Lk, H, Hkv, D, p = 2, 19, 23, 4, 2, 16, 0.3
    module = DropoutStandIn()
    monkeypatch.setattr(kernels, "kernel_module", lambda *a, **kw: module)
    # One (batch, kv head) pair a chunk: four chunks.
    monkeypatch.setattr(kernels, "SHARED_DBIAS_CHUNK_BYTES", (H // Hkv) * Lq * Lk * 6)
    g = torch.Generator().manual_seed(5)
    # Causal calls are planned by the planner's kernels: compiled on a GPU machine,
    # interpreted on CPU tensors elsewhere.
    dev = planner_device()
    q = torch.randn(B, Lq, H, D, generator=g).to(dev, torch.float16)
    k = torch.randn(B, Lk, Hkv, D, generator=g).to(dev, torch.float16)
    v = torch.randn(B, Lk, Hkv, D, generator=g).to(dev, torch.float16)
    bias = torch.randn(1, 1, Lq, Lk, generator=g).to(dev, torch.float16)
    rng = testing.dropout_rng(dev)
    out, lse = kernels.cuda_forward(q, k, v, None, bias, D ** -0.5, True, 0.0, dropout_p=p,
                                    dropout_rng=rng)
    dout = torch.randn(B, Lq, H, D, generator=g).to(dev, torch.float16)
    grads = kernels.cuda_backward(dout, q, k, v, None, bias, out, lse, D ** -0.5, True, 0.0,
                                  False, (True, True, True, True), dropout_p=p, dropout_rng=rng)
    # Forward: the whole call; backward: chunks at batches 0, 1 and query heads 0, 2 of 4.
    assert module.drops[0][2:] == (0, 0, 0)
    assert sorted(d[2:] for d in module.drops[1:]) == [(0, 0, 4), (0, 2, 4), (1, 0, 4),
                                                       (1, 2, 4)]
    keep = testing.dropout_mask(rng, B, H, Lq, Lk, p).cpu()
    ref_in = [t.cpu().double().requires_grad_() for t in (q, k, v, bias)]
    ref = dense_dropout_attention(*ref_in[:3], keep, p, bias=ref_in[3], scale=D ** -0.5,
                                  causal=True)
    assert_close("out", out.cpu(), ref.detach(), 4e-3)
    want = torch.autograd.grad(ref, ref_in, dout.cpu().double())
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), grads, want):
        assert_close(name, a.cpu(), b, 4e-3)


def test_decode_shaped_call_with_dropout_runs_the_dense_kernel(monkeypatch):
    # Few query rows per kv head run the split-KV decode kernel, which has no dropout: with
    # dropout (and no KV cache) the dense forward runs (the stand-in has no decode).
    module = DropoutStandIn()
    monkeypatch.setattr(kernels, "kernel_module", lambda *a, **kw: module)
    q = torch.randn(1, 1, 4, 64).to(torch.bfloat16)
    k = torch.randn(1, 300, 4, 64).to(torch.bfloat16)
    rng = testing.dropout_rng("cpu")
    out, _ = kernels.cuda_forward(q, k, k, None, None, 0.125, False, 0.0, dropout_p=0.2,
                                  dropout_rng=rng)
    assert out.shape == q.shape and module.drops


# ---------------------------------------------------------------------------------------------
# The kernels (GPU)
# ---------------------------------------------------------------------------------------------

TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _cuda_fn():
    from flash_dmattn import flash_dmattn_func_auto

    return flash_dmattn_func_auto("cuda")


def _hopper():
    skip_unless_available("cuda")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the cuda kernels with dropout are built for sm_90")


def _problem(B, Lq, Lk, H, Hkv, D, dtype, mask_kind, bias_kind, seed=0):
    from test_gpu import make_problem

    q, k, v, mask, bias = make_problem(B, Lq, Lk, H, Hkv, D, dtype, mask_kind, bias_kind,
                                       seed=seed)[:5]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    if bias is not None:
        bias.requires_grad_()
    return q, k, v, mask, bias


def _run(q, k, v, p, seed, **kw):
    """The cuda call after ``torch.manual_seed(seed)`` and its keep-mask."""
    B, Lq, H, _ = q.shape
    torch.manual_seed(seed)
    rng = testing.dropout_rng(q.device)
    torch.manual_seed(seed)
    out = _cuda_fn()(q, k, v, dropout_p=p, **kw)
    return out, testing.dropout_mask(rng, B, H, Lq, k.shape[1], p)


# (B, Lq, Lk, H, Hkv, D, causal, mask kind, bias kind, dtype)
GPU_CASES = [
    (2, 129, 200, 4, 2, 64, False, None, None, torch.float16),
    (1, 300, 333, 4, 1, 128, True, None, "per_key", torch.float16),      # causal, Lq != Lk
    (2, 257, 190, 8, 2, 128, True, None, "full", torch.float16),         # Lq > Lk, full dbias
    (2, 150, 211, 4, 2, 64, False, "topk", "per_key", torch.float16),    # empty rows
    (1, 200, 300, 4, 4, 128, True, "block_sparse", None, torch.bfloat16),
    (2, 77, 99, 6, 3, 72, False, "padding", "full", torch.bfloat16),     # padded head dim
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "b{}q{}k{}h{}kv{}d{}".format(*c[:6]))
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_matches_dense_formula_on_the_calls_mask(case, p, deterministic):
    _hopper()
    B, Lq, Lk, H, Hkv, D, causal, mask_kind, bias_kind, dtype = case
    q, k, v, mask, bias = _problem(B, Lq, Lk, H, Hkv, D, dtype, mask_kind, bias_kind)
    out, keep = _run(q, k, v, p, 21, attn_mask=mask, attn_bias=bias, is_causal=causal,
                     deterministic=deterministic)
    if mask_kind == "topk":  # rows 0..4 see no key: zero output, no NaN
        assert torch.count_nonzero(out[:, :5]) == 0
    check_against_dense(out, keep, p, (q, k, v, bias), TOL[dtype],
                        mask=None if mask is None else mask.cpu(), causal=causal)


@pytest.mark.gpu
def test_cuda_keep_mask_is_the_calls_mask():
    """With q = 0 every visible probability is 1 / Lk and with V = I the output row is the
    kept probabilities themselves: the kernel's keep-mask, read off bit for bit."""
    _hopper()
    B, L, H, p = 2, 128, 4, 0.5
    q = torch.zeros(B, L, H, L, device="cuda", dtype=torch.float16)
    k = torch.randn(B, L, H, L, device="cuda", dtype=torch.float16)
    v = torch.eye(L, device="cuda", dtype=torch.float16).view(1, L, 1, L).expand(B, L, H, L)
    out, keep = _run(q, k, v.contiguous(), p, 5)
    assert torch.equal(out.permute(0, 2, 1, 3) > 0, keep)
    kept = out.permute(0, 2, 1, 3)[keep].float()
    torch.testing.assert_close(kept, torch.full_like(kept, 1.0 / (L * (1 - p))), rtol=1e-3,
                               atol=0)


@pytest.mark.gpu
def test_cuda_same_seed_is_bitwise_and_calls_differ():
    _hopper()
    q, k, v, mask, bias = _problem(2, 190, 190, 4, 2, 128, torch.bfloat16, "topk", "per_key")
    runs = []
    for seed in (3, 3, 4):
        out, _ = _run(q, k, v, 0.3, seed, attn_mask=mask, attn_bias=bias, is_causal=True,
                      deterministic=True)
        runs.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v, bias))))
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    assert not torch.equal(runs[0][0], runs[2][0])


@pytest.mark.gpu
@pytest.mark.parametrize("causal_selection", [False, True])
def test_cuda_key_intervals_draw_the_calls_mask(causal_selection):
    """A top-W key-interval mask (gathered keys by index: the mask is drawn at each listed
    key's position in the sequence)."""
    _hopper()
    from flash_dmattn import KeyIntervals  # noqa: F401  (the mask type topk_intervals returns)
    from flash_dmattn.utils.mask import topk_intervals

    B, L, H, Hkv, D, W, p = 1, 700, 4, 2, 128, 200, 0.25
    q, k, v, _, _ = _problem(B, L, L, H, Hkv, D, torch.float16, None, None, seed=2)
    score = torch.randn(B, Hkv, 1, L, device="cuda")
    bias = torch.randn(B, Hkv, 1, L, device="cuda", dtype=torch.float16).requires_grad_()
    ki = topk_intervals(score, W, is_causal=causal_selection)
    out, keep = _run(q, k, v, p, 9, attn_mask=ki, attn_bias=bias, is_causal=True)
    check_against_dense(out, keep, p, (q, k, v, bias), TOL[torch.float16],
                        mask=ki.to_dense(L).cpu(), causal=True)


@pytest.mark.gpu
def test_cuda_gathered_forward_draws_the_calls_mask(monkeypatch):
    """The forward over gathered key lists (forced for a per-query mask) draws each listed
    key at its position; the backward walks key tiles."""
    _hopper()
    from flash_dmattn.planning import gather

    monkeypatch.setattr(gather, "_FORCED_POLICY", "always")
    q, k, v, mask, bias = _problem(1, 260, 300, 4, 2, 128, torch.float16, "topk", None, seed=4)
    out, keep = _run(q, k, v, 0.4, 13, attn_mask=mask, is_causal=True)
    check_against_dense(out, keep, 0.4, (q, k, v, None), TOL[torch.float16], mask=mask.cpu(),
                        causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_varlen_draws_each_sequences_mask(head_dim):
    """Packed sequences: sequence s draws batch entry s's keep-mask (rows and keys from the
    sequence's start), forward and backward, several query and key tiles per sequence."""
    _hopper()
    check_varlen_per_sequence_masks("cuda", "cuda", torch.float16, TOL[torch.float16],
                                    lens_q=(5, 0, 190, 1, 300), lens_k=(7, 3, 210, 1, 333),
                                    head_dim=head_dim)


@pytest.mark.gpu
def test_cuda_dropout_in_a_cuda_graph(monkeypatch):
    """The public call captured in a CUDA graph: every replay draws new numbers from the
    device's generator (the draw is a captured kernel), and its output is the formula on the
    mask of what that replay drew."""
    _hopper()
    import flash_dmattn.inputs as inputs_module

    drawn = []
    real_draw = inputs_module.draw_rng

    def recording_draw(device):
        rng = real_draw(device)
        drawn.append(rng)
        return rng

    monkeypatch.setattr(inputs_module, "draw_rng", recording_draw)
    B, L, H, Hkv, D, p = 1, 256, 4, 2, 64, 0.2
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(B, L, H, D, device="cuda", generator=g).half()
    k = torch.randn(B, L, Hkv, D, device="cuda", generator=g).half()
    v = torch.randn(B, L, Hkv, D, device="cuda", generator=g).half()
    fn = _cuda_fn()
    for _ in range(3):  # build, plan and warm up outside the capture
        fn(q, k, v, dropout_p=p, is_causal=True)
    torch.cuda.synchronize()
    drawn.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(q, k, v, dropout_p=p, is_causal=True)
    assert len(drawn) == 1
    check_graph_replays(graph, drawn[0], out, q, k, v, p)
