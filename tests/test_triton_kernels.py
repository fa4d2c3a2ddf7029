"""Triton kernels vs a float64 naive formula, on CPU through the Triton interpreter.

Shapes are tiny and the kernels run with 16x16 tiles under TRITON_INTERPRET=1, so ragged edges,
tile skipping and every broadcast path are exercised in a few minutes on two cores.
"""
import math

import pytest
import torch

from interpreter_only import require_triton_interpreter
from naive import assert_close

require_triton_interpreter()

from flash_dmattn.backends.triton import common  # noqa: E402
from flash_dmattn.backends.triton import forward as fwd_mod  # noqa: E402
from flash_dmattn.backends.triton.backward import attention_backward  # noqa: E402
from flash_dmattn.backends.triton.forward import attention_forward, fwd_blocks  # noqa: E402
from flash_dmattn.planning.tiles import build_tile_lists, classify_tiles  # noqa: E402

# Tolerances, relative to the largest magnitude of the reference tensor:
# * fp32 inputs: the kernels accumulate in fp32 (reordered sums, exp2 with folded log2(e)),
#   so errors are ~1e-6 relative; 2e-5 leaves margin for lengths ~65 and large dS sums.
# * fp16 inputs: P and dS are rounded to fp16 (11-bit mantissa, ~5e-4 relative) before their
#   dots and the results are stored in fp16, so a few 1e-3 relative is the expected floor.
# * bf16: 8-bit mantissa (~4e-3 relative per rounding), a few roundings compound.
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    # Kernel-written outputs start as NaN: anything the kernels forget to write shows up.
    monkeypatch.setattr(common, "DEBUG_POISON", True)


def naive_attention(q, k, v, mask, bias, scale, causal, softcap):
    """Dense float64 formula of the contract; differentiable in q, k, v and bias."""
    B, Lq, H, D = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    G = H // Hkv
    kk = k.repeat_interleave(G, dim=2)
    vv = v.repeat_interleave(G, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)

    def per_head(t):
        if t.size(1) not in (1, H):  # per-kv-head: query head h reads head h // G
            t = t.repeat_interleave(G, dim=1)
        return t.expand(B, H, Lq, Lk)

    if bias is not None:
        s = s + per_head(bias)
    vis = torch.ones(B, H, Lq, Lk, dtype=torch.bool)
    if mask is not None:
        vis = vis & per_head(mask)
    if causal:
        vis = vis & torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq)
    s = s.masked_fill(~vis, float("-inf"))
    row_live = (s > float("-inf")).any(-1, keepdim=True)
    # Empty rows get finite dummy scores so no NaN reaches autograd; they are zeroed after.
    s = torch.where(row_live, s, torch.zeros_like(s))
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = torch.exp(s - lse) * row_live
    out = torch.einsum("bhij,bjhd->bihd", p, vv)
    lse = torch.where(row_live, lse, torch.full_like(lse, float("-inf"))).squeeze(-1)
    return out, lse


def make_tensor(shape, dtype, kind="randn"):
    if kind == "mask":
        return torch.rand(shape) > 0.3
    return torch.randn(shape, dtype=torch.float32).to(dtype)


def resolve(shape_spec, B, H, Hkv, Lq, Lk):
    names = {"B": B, "H": H, "K": Hkv, "Q": Lq, "L": Lk, "1": 1}
    return tuple(names[c] for c in shape_spec)


def run_case(B, H, Hkv, Lq, Lk, D, causal=False, mask=None, bias=None, softcap=0.0, dtype=torch.float32,
             scale=None, deterministic=False, bias_grad=True, q=None, k=None, v=None):
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    q = make_tensor((B, Lq, H, D), dtype) if q is None else q
    k = make_tensor((B, Lk, Hkv, D), dtype) if k is None else k
    v = make_tensor((B, Lk, Hkv, D), dtype) if v is None else v
    out, lse = attention_forward(q, k, v, mask, bias, scale, causal, softcap)
    dout = make_tensor(out.shape, dtype)
    want_db = bias is not None and bias_grad
    dq, dk, dv, db = attention_backward(dout, q, k, v, out, lse, mask, bias, scale, causal, softcap,
                                        deterministic, want_db)

    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    bd = bias.detach().double().requires_grad_() if bias is not None else None
    ro, rl = naive_attention(qd, kd, vd, mask, bd, scale, causal, softcap)
    ro.backward(dout.double())
    tol = TOL[dtype]
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close("out", out, ro.detach(), tol)
    assert_close("lse", lse, rl.detach(), tol)
    assert_close("dq", dq, qd.grad, tol)
    assert_close("dk", dk, kd.grad, tol)
    assert_close("dv", dv, vd.grad, tol)
    assert dq.dtype == dtype and dk.dtype == dtype and dv.dtype == dtype
    if want_db:
        assert db.dtype == bias.dtype
        assert_close("dbias", db, bd.grad, tol)
    else:
        assert db is None
    return out, lse, (dq, dk, dv, db)


# (Lq, Lk, H, Hkv, D, causal)
GEOMETRIES = [
    (1, 1, 2, 2, 16, False),
    (1, 17, 4, 2, 16, True),
    (17, 17, 2, 1, 40, True),
    (33, 63, 4, 2, 16, True),    # Lq < Lk, bottom-right causal
    (65, 33, 4, 1, 16, True),    # Lq > Lk: first rows causally empty
    (63, 65, 2, 2, 64, False),
    (17, 33, 4, 4, 40, False),
]


@pytest.mark.parametrize("geom", GEOMETRIES, ids=lambda g: "q{}k{}h{}kv{}d{}{}".format(*g[:5], "c" if g[5] else ""))
def test_geometries_plain(geom):
    Lq, Lk, H, Hkv, D, causal = geom
    run_case(2, H, Hkv, Lq, Lk, D, causal=causal)


# Shape specs: B/H/K(=Hkv)/Q/L(=Lk)/1 per dim.
# Broadcast problems of 2 x 3 tiles, both ragged; causal (bottom-right, Lq < Lk): query tile 0
# cannot see key tile 2 (skipped), query tile 1 sees part of it.
BCAST_DIMS = (2, 4, 2, 20, 36)  # B, H, Hkv, Lq, Lk
BCAST_SHAPES = ["BHQL", "BKQL", "BK1L", "11QL", "B11L", "1111", "BHQ1", "11Q1", "B1QL", "1H1L", "1KQL", "B111"]


@pytest.mark.parametrize("spec", BCAST_SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_mask_broadcast(spec, causal):
    B, H, Hkv, Lq, Lk = BCAST_DIMS
    mask = make_tensor(resolve(spec, B, H, Hkv, Lq, Lk), None, "mask")
    run_case(B, H, Hkv, Lq, Lk, 16, causal=causal, mask=mask)


@pytest.mark.parametrize("spec", BCAST_SHAPES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_bias_broadcast(spec, deterministic):
    B, H, Hkv, Lq, Lk = BCAST_DIMS
    bias = make_tensor(resolve(spec, B, H, Hkv, Lq, Lk), torch.float32)
    run_case(B, H, Hkv, Lq, Lk, 16, causal=not deterministic, bias=bias, deterministic=deterministic)


@pytest.mark.parametrize("spec", ["BHQL", "1KQL", "11QL", "B1QL", "BK1L", "1111"])
def test_bias_broadcast_mha(spec):
    # Hkv == H: head broadcast of 1 reduces across all (kv) heads, a different kernel plan.
    B, H, Lq, Lk = 2, 2, 20, 33
    bias = make_tensor(resolve(spec, B, H, H, Lq, Lk), torch.float32)
    mask = make_tensor((B, 1, Lq, Lk), None, "mask")
    run_case(B, H, H, Lq, Lk, 16, mask=mask, bias=bias, deterministic=spec.startswith("1"))


@pytest.mark.parametrize("mask_spec,bias_spec", [("BKQL", "1H1L"), ("B11L", "BKQ1"), ("BHQL", "11QL")])
def test_mask_and_bias_softcap(mask_spec, bias_spec):
    B, H, Hkv, Lq, Lk = 2, 4, 2, 30, 45
    mask = make_tensor(resolve(mask_spec, B, H, Hkv, Lq, Lk), None, "mask")
    bias = make_tensor(resolve(bias_spec, B, H, Hkv, Lq, Lk), torch.float32)
    run_case(B, H, Hkv, Lq, Lk, 40, causal=True, mask=mask, bias=bias, softcap=3.0, scale=0.5)


def test_expanded_bias_with_grad():
    # A bias needing grad may arrive with stride-0 dims of full size (not narrowed): its grad is
    # per expanded element, read through stride 0.
    B, H, Lq, Lk = 2, 2, 17, 20
    base = make_tensor((1, H, Lq, Lk), torch.float32)
    bias = base.expand(B, H, Lq, Lk)
    run_case(B, H, H, Lq, Lk, 16, bias=bias)


def test_strided_inputs():
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 19, 23, 16
    qkv = make_tensor((B, Lq, 3, H, D), torch.float32)
    kv = make_tensor((B, Hkv, Lk, 2, D), torch.float32).permute(0, 2, 1, 3, 4)  # (B, Lk, Hkv, 2, D)
    mask = (torch.rand(B, H, Lk, 2 * Lq) > 0.2).transpose(-1, -2)[:, :, ::2, :]  # strided, transposed
    bias = make_tensor((B, 1, Lk, Lq), torch.float32).transpose(-1, -2)
    run_case(B, H, Hkv, Lq, Lk, D, causal=True, mask=mask, bias=bias,
             q=qkv[:, :, 0], k=kv[..., 0, :], v=kv[..., 1, :])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [16, 40, 64])
def test_low_precision(dtype, D):
    B, H, Hkv, Lq, Lk = 1, 4, 2, 33, 47
    mask = make_tensor((B, Hkv, Lq, Lk), None, "mask")
    bias = make_tensor((1, H, 1, Lk), dtype)
    run_case(B, H, Hkv, Lq, Lk, D, causal=True, mask=mask, bias=bias, dtype=dtype)


def test_fp32_bias_with_fp16_inputs():
    B, H, Lq, Lk = 1, 2, 20, 20
    bias = make_tensor((B, H, Lq, Lk), torch.float32)
    run_case(B, H, H, Lq, Lk, 16, bias=bias, dtype=torch.float16)


def test_zero_scale_and_softcap():
    run_case(1, 2, 1, 17, 21, 16, causal=True, scale=0.0, softcap=1.0,
             bias=make_tensor((1, 2, 17, 21), torch.float32))


def test_empty_rows_no_nan():
    """Fully masked rows, -inf bias entries and whole -inf bias rows: 0 out, -inf lse, 0 grads."""
    B, H, Hkv, Lq, Lk = 2, 4, 2, 33, 40
    mask = make_tensor((B, H, Lq, Lk), None, "mask")
    mask[0, 1, 5] = False
    mask[1, :, 20:] = False  # a whole query tile plus rows past it
    bias = make_tensor((B, H, Lq, Lk), torch.float32)
    bias[0, 0, 3] = float("-inf")
    bias[1, 2, 7, ::3] = float("-inf")
    bias[0, 3, 9, :] = float("-inf")
    out, lse, grads = run_case(B, H, Hkv, Lq, Lk, 16, causal=True, mask=mask, bias=bias)
    for b, h, i in [(0, 1, 5), (0, 0, 3), (0, 3, 9), (1, 0, 25), (1, 3, 32)]:
        assert torch.all(out[b, i, h] == 0)
        assert lse[b, h, i] == float("-inf")
    dq, dk, dv, db = grads
    assert torch.all(dq[0, 5, 1] == 0) and torch.all(dq[1, 20:] == 0)
    assert torch.all(db[1, :, 20:] == 0) and torch.all(db[0, 3, 9] == 0)
    for t in grads:
        assert torch.isfinite(t).all()


def test_causally_empty_rows():
    # Lq > Lk: rows i < Lq - Lk see no key.
    out, lse, grads = run_case(1, 2, 2, 40, 9, 16, causal=True,
                               bias=make_tensor((1, 2, 40, 9), torch.float32))
    assert torch.all(out[:, :31] == 0) and torch.all(lse[:, :, :31] == float("-inf"))
    assert all(torch.isfinite(t).all() for t in grads)


def test_all_masked():
    mask = torch.zeros(1, 1, 1, 1, dtype=torch.bool)
    out, lse, grads = run_case(2, 2, 1, 17, 19, 16, mask=mask, bias=make_tensor((2, 1, 17, 19), torch.float32))
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    assert all(torch.all(t == 0) for t in grads)


def _mixed_tile_mask(B, H, Lq, Lk, bm, bn):
    """Mask whose bm x bn tiles cycle through dead, full and partial."""
    nq, nk = -(-Lq // bm), -(-Lk // bn)
    kind = torch.arange(nq * nk).reshape(nq, nk) % 3  # 0 dead, 1 full, 2 partial
    elem = kind.repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:Lq, :Lk]
    rnd = torch.rand(B, H, Lq, Lk) > 0.5
    return torch.where(elem == 0, False, torch.where(elem == 1, True, rnd))


def test_mixed_dead_full_partial_tiles():
    B, H, Hkv, Lq, Lk = 2, 2, 1, 64, 57
    bm, bn = fwd_blocks(16)
    mask = _mixed_tile_mask(B, H, Lq, Lk, bm, bn)
    live, full = classify_tiles(mask, Lq, Lk, False, bm, bn, torch.device("cpu"))
    partial = live & ~full
    assert (~live).any() and full.any() and partial.any()
    bias = make_tensor((B, H, Lq, Lk), torch.float32)
    run_case(B, H, Hkv, Lq, Lk, 16, mask=mask, bias=bias)
    run_case(B, H, Hkv, Lq, Lk, 16, mask=mask, bias=bias, causal=True, deterministic=True)


def test_tile_lists_broadcast_and_order():
    Lq, Lk, bm, bn = 40, 50, 16, 16
    mask = torch.zeros(1, 1, 1, Lk, dtype=torch.bool)
    mask[..., 17:20] = True   # tile 1, partial
    mask[..., 32:48] = True   # tile 2, full
    t = build_tile_lists(mask, Lq, Lk, 4, False, bm, bn, torch.device("cpu"), need_fwd=True, need_bwd=True)
    # A per-key mask shares one forward list across query tiles.
    # Counts are (live, full); full tiles are listed first.
    assert t.fwd_idx.shape == (1, 1, 1, 4) and t.fwd_cnt.tolist() == [[[[2, 1]]]]
    assert t.fwd_idx[0, 0, 0, :2].tolist() == [2 * 2 + 0, 1 * 2 + 1]
    assert t.bwd_cnt.tolist() == [[[[0, 0], [3, 0], [3, 3], [0, 0]]]]
    assert t.bwd_idx[0, 0, 1, :3].tolist() == [1, 3, 5]  # every query tile, partial
    assert t.bwd_idx[0, 0, 2, :3].tolist() == [0, 2, 4]  # every query tile, full
    # A ragged last key tile is partial even where the mask is all True.
    r = build_tile_lists(torch.ones(1, 1, 1, Lk, dtype=torch.bool), Lq, Lk, 4, False, bm, bn,
                         torch.device("cpu"), need_fwd=True, need_bwd=True)
    assert r.fwd_cnt.tolist() == [[[[4, 3]]]]
    assert r.fwd_idx[0, 0, 0].tolist() == [0, 2, 4, 3 * 2 + 1]
    assert r.bwd_cnt[0, 0, :, 1].tolist() == [3, 3, 3, 0]
    assert t.fwd_strides()[:3] == (0, 0, 0)
    # Causal forces per-query-tile lists; tiles above the diagonal disappear.
    tc = build_tile_lists(None, 32, 32, 4, True, bm, bn, torch.device("cpu"), need_fwd=True, need_bwd=True)
    assert tc.fwd_cnt[..., 0].flatten().tolist() == [1, 2]
    assert tc.fwd_cnt[..., 1].flatten().tolist() == [0, 1]
    assert tc.fwd_idx[0, 0, 1, :2].tolist() == [0, 3]  # off-diagonal full, diagonal partial
    assert build_tile_lists(None, 32, 32, 4, False, bm, bn, torch.device("cpu")) is None


# 11QL: programs serialise the (batch, kv head) pairs sharing a bias slice (read-add-write);
# BHQ1: per-key-tile partial row sums reduced with torch.
@pytest.mark.parametrize("bias_spec", ["11QL", "BHQ1"])
def test_deterministic_bitwise(bias_spec):
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 29, 35, 16
    q = make_tensor((B, Lq, H, D), torch.float32)
    k = make_tensor((B, Lk, Hkv, D), torch.float32)
    v = make_tensor((B, Lk, Hkv, D), torch.float32)
    mask = make_tensor((B, 1, Lq, Lk), None, "mask")
    bias = make_tensor(resolve(bias_spec, B, H, Hkv, Lq, Lk), torch.float32)
    out, lse = attention_forward(q, k, v, mask, bias, 0.3, True, 0.0)
    dout = make_tensor(out.shape, torch.float32)
    r1 = attention_backward(dout, q, k, v, out, lse, mask, bias, 0.3, True, 0.0, True, True)
    r2 = attention_backward(dout, q, k, v, out, lse, mask, bias, 0.3, True, 0.0, True, True)
    for a, b in zip(r1, r2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("needs_dq,needs_dkv,bias_grad", [(True, False, False), (False, True, True),
                                                          (False, False, True), (True, False, True)])
def test_partial_gradients(needs_dq, needs_dkv, bias_grad):
    B, H, Hkv, Lq, Lk, D = 1, 4, 2, 21, 26, 16
    q = make_tensor((B, Lq, H, D), torch.float32)
    k = make_tensor((B, Lk, Hkv, D), torch.float32)
    v = make_tensor((B, Lk, Hkv, D), torch.float32)
    bias = make_tensor((1, Hkv, Lq, Lk), torch.float32)
    out, lse = attention_forward(q, k, v, None, bias, 0.25, True, 0.0)
    dout = make_tensor(out.shape, torch.float32)
    full = attention_backward(dout, q, k, v, out, lse, None, bias, 0.25, True, 0.0, True, True)
    part = attention_backward(dout, q, k, v, out, lse, None, bias, 0.25, True, 0.0, False, bias_grad,
                              needs_dq=needs_dq, needs_dkv=needs_dkv)
    wanted = (needs_dq, needs_dkv, needs_dkv, bias_grad)
    for w, a, b in zip(wanted, full, part):
        if w:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        else:
            assert b is None


# ------------------------------------------------------------------------------------------
# Gather mode (per-query masks: the kernels walk each query tile's union of live keys)
# ------------------------------------------------------------------------------------------

def _topk_mask(B, Hm, Lq, Lk, keep, causal):
    """Per-query top-`keep` of a per-key score among the (causally) visible keys: consecutive
    queries keep nearly the same keys, the case gather mode exists for."""
    score = torch.randn(B, Hm, 1, Lk).expand(B, Hm, Lq, Lk).clone()
    if causal:
        vis = torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq)
        score = score.masked_fill(~vis, float("-inf"))
    top = score.topk(min(keep, Lk), dim=-1).indices
    mask = torch.zeros(B, Hm, Lq, Lk, dtype=torch.bool).scatter_(-1, top, True)
    if causal:
        mask &= vis
    return mask


@pytest.fixture
def gather_always(monkeypatch):
    """Gather mode on, and the plan's partly written outputs poisoned: a kernel reading an
    idx entry, gbits word or gbias value past a tile's count meets a key far out of range, set
    bits or NaN."""
    from flash_dmattn.planning import gather_build

    def poisoned(shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        return t.fill_(float("nan") if dtype.is_floating_point else
                       (1 << 30) if dtype == torch.int32 else -1)

    monkeypatch.setattr(gather_build, "_empty", poisoned)
    monkeypatch.setattr("flash_dmattn.planning.gather._FORCED_POLICY", "always")


@pytest.fixture
def gather_auto_poisoned(gather_always, monkeypatch):
    monkeypatch.setattr("flash_dmattn.planning.gather._FORCED_POLICY", None)


# (B, H, Hkv, Lq, Lk, mask heads, causal, bias spec or None)
GATHER_CASES = [
    (2, 4, 2, 40, 70, "K", True, "BK1L"),    # GQA, per-kv-head mask + per-key bias, Lq < Lk
    (1, 2, 2, 33, 33, "1", False, None),     # mask broadcast over heads, ragged last tile
    (2, 4, 1, 50, 37, "H", True, "1H1L"),    # Lq > Lk: first rows causally empty
    (1, 4, 2, 17, 65, "K", False, "BKQ1"),   # bias broadcast over keys
    # Gathered per-key bias with more bias heads than mask heads, and fewer:
    (2, 4, 2, 33, 70, "K", True, "1H1L"),
    (1, 4, 2, 40, 49, "H", False, "BK1L"),
    # Unions past 64 and 128 keys: a tile's mask bits span several gbits words.
    (1, 2, 1, 24, 200, "K", False, "BK1L"),
    (1, 2, 2, 70, 230, "K", True, None),
]


@pytest.mark.parametrize("case", GATHER_CASES, ids=lambda c: f"q{c[3]}k{c[4]}m{c[5]}{'c' if c[6] else ''}")
def test_gather_mode_matches_naive(case, gather_always):
    B, H, Hkv, Lq, Lk, mh, causal, bias_spec = case
    Hm = {"K": Hkv, "H": H, "1": 1}[mh]
    mask = _topk_mask(B, Hm, Lq, Lk, keep=11, causal=causal)
    bias = make_tensor(resolve(bias_spec, B, H, Hkv, Lq, Lk), torch.float32) if bias_spec else None
    run_case(B, H, Hkv, Lq, Lk, 16, causal=causal, mask=mask, bias=bias)


@pytest.mark.parametrize("Lq,Lk", [(40, 70), (70, 40), (33, 33)])
def test_gather_mode_causal_call_hides_what_the_mask_keeps(Lq, Lk, gather_always):
    # A mask that keeps keys past the causal limit: the causal call must still hide them
    # (the gathered kernels take causality from the planner's bits alone).
    mask = _topk_mask(1, 2, Lq, Lk, keep=13, causal=False)
    run_case(1, 4, 2, Lq, Lk, 16, causal=True, mask=mask,
             bias=make_tensor((1, 2, 1, Lk), torch.float32))


def test_gather_mode_empty_rows_and_neg_inf_bias(gather_always):
    B, H, Hkv, Lq, Lk = 1, 2, 1, 35, 48
    mask = _topk_mask(B, Hkv, Lq, Lk, keep=7, causal=False)
    mask[0, 0, 3] = False
    mask[0, 0, 16:32] = False  # a whole query tile: empty union
    bias = make_tensor((B, Hkv, 1, Lk), torch.float32)
    bias[..., ::4] = float("-inf")
    out, lse, grads = run_case(B, H, Hkv, Lq, Lk, 16, mask=mask, bias=bias, softcap=2.0)
    assert torch.all(out[0, 16:32] == 0) and torch.all(lse[0, :, 16:32] == float("-inf"))
    assert torch.all(grads[0][0, 16:32] == 0)
    assert all(torch.isfinite(t).all() for t in grads)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gather_mode_low_precision(dtype, gather_always):
    mask = _topk_mask(1, 2, 37, 45, keep=9, causal=True)
    run_case(1, 4, 2, 37, 45, 40, causal=True, mask=mask,
             bias=make_tensor((1, 2, 1, 45), dtype), dtype=dtype)


def test_gather_plan_auto_prefers_gather_only_when_it_saves_work():
    from flash_dmattn.planning.gather import plan_key_gather

    Lq = Lk = 128
    sparse = _topk_mask(1, 2, Lq, Lk, keep=20, causal=True)
    g = plan_key_gather(sparse, None, Lq, Lk, 4, True, 16, 16, policy="auto")
    assert g is not None
    assert g.idx.shape == (1, 2, Lq // 16, Lk) and g.gbits.shape == (1, 2, Lq, Lk // 64)
    assert int(g.cnt.max()) < Lk // 2
    dense = torch.rand(1, 2, Lq, Lk) > 0.5
    assert plan_key_gather(dense, None, Lq, Lk, 4, True, 16, 16, policy="auto") is None
    # Ineligible: a per-key mask (tile skipping already handles it), a full (Lq, Lk) bias.
    assert plan_key_gather(sparse[:, :, :1], None, Lq, Lk, 4, True, 16, 16, "always") is None
    full_bias = torch.randn(1, 2, Lq, Lk)
    assert plan_key_gather(sparse, full_bias, Lq, Lk, 4, True, 16, 16, "always") is None
    assert plan_key_gather(sparse, None, Lq, Lk, 4, True, 16, 16, "never") is None


def test_lagged_gather_plan_follows_the_previous_call_of_its_shape(monkeypatch):
    # The kernels' own planning decides "auto" from the previous call of the same shapes (no
    # host wait); the first call of a shape decides from its own totals.
    from flash_dmattn.planning import gather_verdicts
    from flash_dmattn.planning.gather import plan_key_gather

    monkeypatch.setattr(gather_verdicts, "LAGGED_SAMPLE_EVERY", 1)  # every call counts its tiles

    Lq = Lk = 128
    sparse = _topk_mask(1, 2, Lq, Lk, keep=20, causal=True)
    dense = torch.rand(1, 2, Lq, Lk) > 0.5
    plan = lambda m: plan_key_gather(m, None, Lq, Lk, 4, True, 16, 16, policy="auto",
                                     lagged=True)
    assert plan(dense) is None             # its own totals
    assert plan(sparse) is None            # the dense call's totals
    g = plan(sparse)                       # the first sparse call's totals
    assert g is not None and torch.equal(g.cnt, plan_key_gather(
        sparse, None, Lq, Lk, 4, True, 16, 16, policy="always").cnt)
    assert plan(dense) is not None         # the sparse call's: gathered, still exact
    assert plan(dense) is None
    # Another shape keeps its own history.
    assert plan_key_gather(sparse[..., :64, :], None, 64, Lk, 4, True, 16, 16,
                           policy="auto", lagged=True) is not None


def test_lagged_gather_plans_count_tiles_every_few_calls(monkeypatch):
    # Alike lagged calls count their tiles every LAGGED_SAMPLE_EVERY-th call and follow the
    # last count in between; a call decided on tile lists that does not count builds nothing.
    from flash_dmattn.planning import gather, gather_verdicts

    monkeypatch.setattr(gather_verdicts, "LAGGED_SAMPLE_EVERY", 3)
    Lq = Lk = 128
    sparse = _topk_mask(1, 2, Lq, Lk, keep=20, causal=True)
    dense = torch.rand(1, 2, Lq, Lk) > 0.5
    counted = []
    real = gather.compact_keys
    monkeypatch.setattr(gather, "compact_keys",
                        lambda *a: counted.append(a[-1]) or real(*a))
    plan = lambda m: gather.plan_key_gather(m, None, Lq, Lk, 4, True, 16, 16, policy="auto",
                                            lagged=True)
    got = [plan(m) is not None for m in (dense, sparse, sparse, sparse, sparse, sparse)]
    # Counts at calls 0 (its own: tiles) and 3 (sparse): calls 1-3 follow call 0, 4-5 call 3.
    assert got == [False, False, False, False, True, True]
    assert counted == [True, True, False, False]  # calls 1-2 built nothing, 4-5 no count
    g = plan(sparse)
    assert g is not None and torch.equal(g.cnt, gather.plan_key_gather(
        sparse, None, Lq, Lk, 4, True, 16, 16, policy="always").cnt)


def test_lagged_verdict_does_not_wait_for_totals_still_on_their_way():
    # A lagged plan whose previous totals have not reached the host takes the previous call's
    # own verdict instead of waiting (waiting drained the device's queue); a call that was
    # planned from its own totals (no verdict to fall back on) is waited for.
    from flash_dmattn.planning.gather_verdicts import TotalsToHost

    class InFlight:
        waited = False

        def query(self):
            return False

        def synchronize(self):
            InFlight.waited = True

    totals = torch.tensor([10, 2], dtype=torch.int32)  # 2 gathered of 10 live tiles: gather
    for planned_with, want, waits in ((False, False, False), (True, True, False),
                                      (None, True, True)):
        on_host = TotalsToHost(totals, planned_with)
        on_host.event = InFlight()
        InFlight.waited = False
        assert on_host.gathers(False, wait=False) is want, planned_with
        assert InFlight.waited is waits, planned_with
    on_host = TotalsToHost(totals, False)
    on_host.event = InFlight()
    assert on_host.gathers(False) is True  # waiting (the default) reads the totals


def test_lagged_gather_decision_keeps_outputs_exact(gather_auto_poisoned):
    # A plan decided from another call's totals (gathered for a dense mask, tiles for a
    # sparse one) still computes this call's attention.
    B, H, Hkv, Lq, Lk = 1, 2, 1, 70, 70
    sparse = _topk_mask(B, Hkv, Lq, Lk, keep=5, causal=True)
    dense = torch.rand(B, Hkv, Lq, Lk) > 0.3
    for mask in (sparse, dense, sparse, dense):
        run_case(B, H, Hkv, Lq, Lk, 16, causal=True, mask=mask)


def test_gather_mode_through_public_api(gather_always):
    """The autograd path (forward lists and the dQ kernel) in gather mode, against the reference."""
    import flash_dmattn

    B, H, Hkv, L, D = 1, 4, 2, 48, 16
    q, k, v = (torch.randn(B, L, h, D, requires_grad=True) for h in (H, Hkv, Hkv))
    mask = _topk_mask(B, Hkv, L, L, keep=8, causal=True)
    bias = torch.randn(B, Hkv, 1, L, requires_grad=True)
    outs, grads = [], []
    for backend in ("triton", "torch-reference"):
        fn = flash_dmattn.flash_dmattn_func_auto(backend)
        o = fn(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True)
        outs.append(o)
        grads.append(torch.autograd.grad(o.square().sum(), (q, k, v, bias)))
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=2e-5)
    for a, b in zip(grads[0], grads[1]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


def test_gather_policy_defaults_and_test_hook(monkeypatch):
    from flash_dmattn.planning import gather
    from flash_dmattn.planning.gather import DEFAULT_POLICY, gather_policy

    assert gather_policy("forward") == DEFAULT_POLICY["forward"] == "auto"
    assert gather_policy("dq") == DEFAULT_POLICY["dq"] == "auto"
    monkeypatch.setattr(gather, "_FORCED_POLICY", "always")
    assert gather_policy("forward") == gather_policy("dq") == "always"
