"""Triton varlen (packed sequences) kernels vs the float64 reference, through the interpreter.

The packed path reuses the dense kernels with ``VARLEN=True``: each program reads its sequence's
offsets from ``cu_seqlens`` and visits every key tile up to the causal limit, or with a per-key
mask only the live tiles listed per (sequence, mask head) (the tests at the end of this file).
Shapes are tiny (16x16 tiles under ``TRITON_INTERPRET=1``) but cover empty sequences, length
1, odd lengths, sequences longer than a tile, ``Lq != Lk`` with causal, GQA, every per-key
mask/bias shape and rows past ``cu_seqlens[-1]``. GPU sizes live in tests/test_gpu.py.
"""

import pytest
import torch

from interpreter_only import require_triton_interpreter
from naive import assert_close

require_triton_interpreter()

from flash_dmattn import flash_dmattn_varlen_func, registry  # noqa: E402
from flash_dmattn.backends.triton import common  # noqa: E402
from flash_dmattn.backends.triton import forward as fwd_mod  # noqa: E402
from flash_dmattn.backends.triton.backend import triton_varlen_op  # noqa: E402
from flash_dmattn.inputs import VarlenInputs  # noqa: E402
from flash_dmattn.reference import reference_varlen_attention  # noqa: E402
from flash_dmattn.utils.padding import cu_seqlens_from_lengths  # noqa: E402

# Relative to the reference's largest magnitude; see tests/test_triton_kernels.py for why.
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}

# Per sequence: empty q, empty k, Lq < Lk, Lq > Lk (longer than a tile), length 1, odd equal.
LENS_Q = [0, 3, 17, 33, 1, 5]
LENS_K = [4, 0, 20, 17, 1, 5]


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    # Kernel-written outputs start as NaN: anything the kernels forget to write shows up.
    monkeypatch.setattr(common, "DEBUG_POISON", True)


def aux_shape(spec, H, Hkv, total_k):
    """None, '1' -> (total_k,), 'K' -> (Hkv, total_k), 'H' -> (H, total_k)."""
    return None if spec is None else {"1": (total_k,), "K": (Hkv, total_k), "H": (H, total_k)}[spec]


def make_problem(lens_q, lens_k, H, Hkv, D, dtype=torch.float32, mask_spec=None, bias_spec=None,
                 tail_q=0, tail_k=0, seed=0):
    """Packed q, k, v (+ rows past cu_seqlens[-1]), per-key mask and bias, cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q) + tail_q, sum(lens_k) + tail_k
    q = torch.randn(tq, H, D, generator=g).to(dtype)
    k = torch.randn(tk, Hkv, D, generator=g).to(dtype)
    v = torch.randn(tk, Hkv, D, generator=g).to(dtype)
    ms, bs = aux_shape(mask_spec, H, Hkv, tk), aux_shape(bias_spec, H, Hkv, tk)
    mask = None if ms is None else torch.rand(ms, generator=g) > 0.25
    bias = None if bs is None else torch.randn(bs, generator=g).to(dtype)
    return q, k, v, mask, bias, cu_seqlens_from_lengths(lens_q), cu_seqlens_from_lengths(lens_k)


def run_varlen(q, k, v, mask, bias, cu_q, cu_k, max_q, max_k, causal=False, softcap=0.0,
               scale=None, deterministic=False):
    """Triton varlen fwd + bwd through the custom op: (out, lse, (dq, dk, dv, dbias), dout)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    b = None if bias is None else bias.detach().requires_grad_()
    inputs = VarlenInputs.from_args(*leaves, cu_q, cu_k, max_q, max_k, mask, b, scale, causal,
                                    softcap, deterministic)
    assert not registry.get_backend("triton").varlen_not_supported_reasons(inputs)
    out, lse = triton_varlen_op()(
        inputs.query, inputs.key, inputs.value, cu_q, cu_k, max_q, max_k, inputs.attn_mask,
        inputs.attn_bias, inputs.softmax_scale, causal, inputs.softcap, deterministic,
    )
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    wrt = leaves + ([b] if b is not None else [])
    grads = torch.autograd.grad(out, wrt, dout)
    return out.detach(), lse.detach(), tuple(grads) + ((None,) if b is None else ()), dout


def reference(q, k, v, mask, bias, cu_q, cu_k, max_q, max_k, dout, causal=False, softcap=0.0,
              scale=None):
    """float64 per-sequence reference: (out, lse, (dq, dk, dv, dbias))."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    b = None if bias is None else bias.detach().double().requires_grad_()
    inputs = VarlenInputs.from_args(*leaves, cu_q, cu_k, max_q, max_k, mask, b, scale, causal,
                                    softcap)
    out, lse, _ = reference_varlen_attention(inputs)
    wrt = leaves + ([b] if b is not None else [])
    grads = torch.autograd.grad(out, wrt, dout.double(), allow_unused=True)
    # keys no sequence owns get no gradient from the reference: that gradient is 0
    grads = tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, wrt))
    return out.detach(), lse.detach(), grads + ((None,) if b is None else ())


def check(lens_q, lens_k, H, Hkv, D, dtype=torch.float32, mask_spec=None, bias_spec=None,
          causal=False, softcap=0.0, scale=None, tail_q=0, tail_k=0):
    q, k, v, mask, bias, cu_q, cu_k = make_problem(lens_q, lens_k, H, Hkv, D, dtype, mask_spec,
                                                   bias_spec, tail_q, tail_k)
    max_q, max_k = max(lens_q), max(lens_k)
    out, lse, grads, dout = run_varlen(q, k, v, mask, bias, cu_q, cu_k, max_q, max_k, causal,
                                       softcap, scale)
    r_out, r_lse, r_grads = reference(q, k, v, mask, bias, cu_q, cu_k, max_q, max_k, dout, causal,
                                      softcap, scale)
    tol = TOL[dtype]
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (H, q.shape[0])
    assert_close("out", out, r_out, tol)
    assert_close("lse", lse, r_lse, tol)
    for name, got, want, t in zip(("dq", "dk", "dv", "dbias"), grads, r_grads, (q, k, v, bias)):
        if t is None:
            assert got is None
            continue
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert_close(name, got, want, tol)
    return out, lse, grads


# (mask_spec, bias_spec, H, Hkv, causal, softcap, tail): every per-key shape of mask and bias,
# GQA (4/2), MQA (4/1) and MHA (2/2), causal with Lq != Lk, softcap, rows past cu_seqlens[-1].
CASES = [
    (None, None, 4, 2, True, 0.0, (2, 3)),
    ("1", "1", 4, 1, True, 0.0, (0, 0)),
    ("K", "K", 4, 2, False, 2.5, (0, 0)),
    ("H", "H", 4, 2, True, 0.0, (0, 2)),
    ("K", "1", 2, 2, False, 0.0, (1, 0)),
    ("1", "K", 4, 2, True, 0.0, (0, 0)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "m{}_b{}_h{}kv{}{}{}{}".format(
    c[0], c[1], c[2], c[3], "_causal" if c[4] else "", "_cap" if c[5] else "",
    "_tail" if any(c[6]) else ""))
def test_varlen_matches_reference(case):
    mask_spec, bias_spec, H, Hkv, causal, softcap, (tail_q, tail_k) = case
    check(LENS_Q, LENS_K, H, Hkv, 16, mask_spec=mask_spec, bias_spec=bias_spec, causal=causal,
          softcap=softcap, scale=0.3 if softcap else None, tail_q=tail_q, tail_k=tail_k)


def test_varlen_bf16_odd_head_dim():
    # bf16 (fp32 dots under the interpreter) and a head dim padded inside the kernel (40 -> 64)
    check([7, 18], [18, 7], 2, 1, 40, torch.bfloat16, mask_spec="1", bias_spec="H", causal=True)


def test_varlen_fully_masked_and_neg_inf_bias():
    lens = [5, 17, 4]
    H, Hkv, D = 2, 1, 16
    q, k, v, _, bias, cu_q, cu_k = make_problem(lens, lens, H, Hkv, D, bias_spec="H")
    mask = torch.ones(sum(lens), dtype=torch.bool)
    mask[5:22] = False  # sequence 1: every key masked
    bias[:, 0] = float("-inf")  # sequence 0: one key excluded by the bias
    bias[0, 22:] = float("-inf")  # sequence 2, head 0: every key -inf (head 1 finite)
    out, lse, grads, dout = run_varlen(q, k, v, mask, bias, cu_q, cu_k, 17, 17, causal=True)
    r_out, r_lse, r_grads = reference(q, k, v, mask, bias, cu_q, cu_k, 17, 17, dout, causal=True)
    assert torch.equal(out[5:22], torch.zeros_like(out[5:22]))
    assert torch.equal(out[22:, 0], torch.zeros_like(out[22:, 0]))
    assert torch.isneginf(lse[:, 5:22]).all() and torch.isneginf(lse[0, 22:]).all()
    assert_close("out", out, r_out, TOL[torch.float32])
    assert_close("lse", lse, r_lse, TOL[torch.float32])
    for name, got, want in zip(("dq", "dk", "dv", "dbias"), grads, r_grads):
        assert_close(name, got, want, TOL[torch.float32])
    dbias = grads[3]
    assert torch.equal(dbias[:, 5:22], torch.zeros_like(dbias[:, 5:22]))


def test_varlen_deterministic_bitwise():
    args = make_problem([9, 20], [20, 9], 4, 2, 16, mask_spec="K", bias_spec="1")
    q, k, v, mask, bias, cu_q, cu_k = args
    runs = [run_varlen(q, k, v, mask, bias, cu_q, cu_k, 20, 20, causal=True, deterministic=True)
            for _ in range(2)]
    for a, b in zip(runs[0][2], runs[1][2]):
        assert torch.equal(a, b)


def test_varlen_no_cross_sequence_leakage():
    lens = [6, 19, 3]
    q, k, v, mask, bias, cu_q, cu_k = make_problem(lens, lens, 2, 1, 16, mask_spec="1",
                                                   bias_spec="H")
    op = triton_varlen_op()

    def fwd(k, v, bias):
        return op(q, k, v, cu_q, cu_k, 19, 19, mask[None], bias, 0.25, True, 0.0)

    out1, lse1 = fwd(k, v, bias)
    k2, v2, b2 = k.clone(), v.clone(), bias.clone()
    k2[6:25] += 5.0
    v2[6:25] -= 3.0
    b2[:, 6:25] += 1.0
    out2, lse2 = fwd(k2, v2, b2)
    for rows in (slice(0, 6), slice(25, 28)):
        assert torch.equal(out1[rows], out2[rows])
        assert torch.equal(lse1[:, rows], lse2[:, rows])
    assert not torch.allclose(out1[6:25], out2[6:25])


def test_varlen_public_api_and_dispatch(monkeypatch):
    q, k, v, mask, bias, cu_q, cu_k = make_problem([3, 5], [4, 5], 2, 2, 16, mask_spec="1",
                                                   bias_spec="K")
    inputs = VarlenInputs.from_args(q, k, v, cu_q, cu_k, 5, 5, mask, bias, None, True)
    # On CPU the interpreter is a testing aid: auto-dispatch keeps preferring the reference.
    assert registry.select_backend(inputs).name == "torch-reference"
    want = flash_dmattn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, mask, bias, is_causal=True)
    monkeypatch.setenv("FLASH_DMATTN_BACKEND", "triton")
    assert registry.select_backend(inputs).name == "triton"
    got = flash_dmattn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, mask, bias, is_causal=True)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    reasons = registry.get_backend("triton").varlen_not_supported_reasons(
        VarlenInputs.from_args(q.double(), k.double(), v.double(), cu_q, cu_k, 5, 5,
                               return_attn_probs=True))
    assert any("dtype" in r for r in reasons) and any("return_attn_probs" in r for r in reasons)


def test_varlen_empty_batch_and_zero_max():
    q, k, v, _, _, cu_q, cu_k = make_problem([0, 0], [3, 0], 2, 1, 16)
    out, lse, grads, _ = run_varlen(q, k, v, None, None, cu_q, cu_k, 0, 3)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)
    assert torch.equal(grads[1], torch.zeros_like(k))


def test_varlen_torch_compile_fullgraph(monkeypatch):
    q, k, v, mask, bias, cu_q, cu_k = make_problem([3, 6], [6, 3], 2, 1, 16, mask_spec="1",
                                                   bias_spec="K")
    leaves = [t.requires_grad_() for t in (q, k, v, bias)]

    def f(q, k, v, bias):
        out = flash_dmattn_varlen_func(q, k, v, cu_q, cu_k, 6, 6, mask, bias, is_causal=True)
        return out.square().sum()

    monkeypatch.setenv("FLASH_DMATTN_BACKEND", "triton")
    eager = f(*leaves)
    eager_grads = torch.autograd.grad(eager, leaves)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves)
    grads = torch.autograd.grad(compiled, leaves)
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------------------
# Per-key masks walked as live key-tile lists (tiles.build_varlen_key_lists)
# ------------------------------------------------------------------------------------------

from flash_dmattn.planning.tiles import build_varlen_key_lists  # noqa: E402

BN = 16  # the interpreter's key tile (fwd_blocks / bwd_blocks)
# Length 1, odd, several tiles with a ragged end, exactly one tile (all masked: SEQ_DEAD),
# Lq < Lk and Lq > Lk (causal alignment per sequence).
TILE_LENS_Q = [1, 9, 40, 16, 20, 33]
TILE_LENS_K = [1, 7, 48, 16, 37, 20]
SEQ_DEAD = 3


def tile_kind(head, seq, tile):
    """'d' dead, 'f' every key live, 'p' some live: varies with head, sequence and tile."""
    return "d" if seq == SEQ_DEAD else "fdp"[(head + 2 * seq + tile) % 3]


def tile_mask(lens_k, hx, seed=0):
    """Bool ``(hx, total_k)`` per-key mask following :func:`tile_kind` per 16-key tile."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for h in range(hx):
        row = []
        for s, n in enumerate(lens_k):
            for t in range(-(-n // BN)):
                m = min(BN, n - t * BN)
                kind = tile_kind(h, s, t)
                if kind == "p":
                    keys = torch.rand(m, generator=g) < 0.4
                    keys[0] = True
                    if m > 1:
                        keys[-1] = False  # at least one masked key: really partial
                else:
                    keys = torch.full((m,), kind == "f")
                row.append(keys)
        rows.append(torch.cat(row) if row else torch.zeros(0, dtype=torch.bool))
    return torch.stack(rows)


def dead_keys(mask2d, lens_k):
    """Bool ``(hx, total_k)``: keys whose whole 16-key tile of their sequence is masked."""
    dead = torch.zeros_like(mask2d)
    start = 0
    for n in lens_k:
        for t in range(0, n, BN):
            sl = slice(start + t, start + min(t + BN, n))
            dead[:, sl] = ~mask2d[:, sl].any(1, keepdim=True)
        start += n
    return dead


def test_varlen_key_lists_match_bruteforce():
    g = torch.Generator().manual_seed(3)
    lens = [0, 1, 5, 16, 17, 33, 64, 3]
    cu = cu_seqlens_from_lengths(lens)
    for hx in (1, 3):
        mask = torch.rand(hx, sum(lens) + 2, generator=g) < 0.3  # 2 keys past cu[-1]
        mask[:, 22:38] = True  # a full tile (sequence 4, tile 0 starts at key 22)
        for bn in (4, 16):
            lists = build_varlen_key_lists(mask, cu, max(lens), 6, bn)
            assert lists.head_div == 6 // hx and lists.idx.shape[-1] == -(-max(lens) // bn)
            for h in range(hx):
                for s, n in enumerate(lens):
                    want, n_full = [], 0
                    for t in range(-(-n // bn)):
                        keys = mask[h, cu[s] + t * bn: cu[s] + min(t * bn + bn, n)]
                        if keys.any():
                            full = bool(keys.all()) and keys.numel() == bn
                            want.append(t * 2 + (0 if full else 1))
                            n_full += full
                    live, nf = lists.cnt[h, s].tolist()
                    assert (live, nf) == (len(want), n_full), (hx, bn, h, s)
                    assert lists.idx[h, s, :live].tolist() == want, (hx, bn, h, s)
    assert build_varlen_key_lists(mask, cu, max(lens), 6, 16).cnt[:, 4, 1].tolist() == [1] * 3


def run_tile_case(mask_spec, H, Hkv, causal, bias_spec):
    """Triton vs reference on :func:`tile_mask` with the inputs of dead tiles poisoned.

    K / V of keys whose tile is dead for every head of their kv group, and bias entries whose
    tile is dead for every head sharing them, are NaN in the Triton run (the reference gets
    the clean values): matching outputs and gradients prove those tiles were never loaded.
    """
    lens_q, lens_k = TILE_LENS_Q, TILE_LENS_K
    q, k, v, _, bias, cu_q, cu_k = make_problem(lens_q, lens_k, H, Hkv, 16, bias_spec=bias_spec,
                                                seed=5)
    hx = {"1": 1, "K": Hkv, "H": H}[mask_spec]
    mask2d = tile_mask(lens_k, hx)
    mask = mask2d[0] if mask_spec == "1" else mask2d
    max_q, max_k = max(lens_q), max(lens_k)
    dead_q = dead_keys(mask2d, lens_k).repeat_interleave(H // hx, 0)  # (H, total_k)

    def dead_for(n_heads):  # dead for every query head mapped to each of n_heads heads
        return dead_q.reshape(n_heads, H // n_heads, -1).all(1)

    kv_dead = dead_for(Hkv).T[:, :, None]  # (total_k, Hkv, 1)
    assert kv_dead.any()
    kp = k.masked_fill(kv_dead, float("nan"))
    vp = v.masked_fill(kv_dead, float("nan"))
    bp = None
    if bias is not None:  # bias (total_k,) or (Hb, total_k)
        b_dead = dead_for(1 if bias.dim() == 1 else bias.shape[0]).reshape(bias.shape)
        bp = bias.masked_fill(b_dead, float("nan"))
    out, lse, grads, dout = run_varlen(q, kp, vp, mask, bp, cu_q, cu_k, max_q, max_k, causal)
    r_out, r_lse, r_grads = reference(q, k, v, mask, bias, cu_q, cu_k, max_q, max_k, dout,
                                      causal)
    tol = TOL[torch.float32]
    assert_close("out", out, r_out, tol)  # also: no NaN anywhere
    assert_close("lse", lse, r_lse, tol)
    for name, got, want in zip(("dq", "dk", "dv", "dbias"), grads, r_grads):
        if want is None:
            assert got is None
            continue
        assert_close(name, got, want, tol)
    # The all-masked sequence: zero output / dq rows, lse -inf, zero dk / dv / dbias.
    qs = slice(sum(lens_q[:SEQ_DEAD]), sum(lens_q[:SEQ_DEAD + 1]))
    ks = slice(sum(lens_k[:SEQ_DEAD]), sum(lens_k[:SEQ_DEAD + 1]))
    assert torch.equal(out[qs], torch.zeros_like(out[qs])) and torch.isneginf(lse[:, qs]).all()
    assert torch.equal(grads[0][qs], torch.zeros_like(grads[0][qs]))
    for g_ in (grads[1], grads[2]):
        assert torch.equal(g_[ks], torch.zeros_like(g_[ks]))
    if grads[3] is not None:
        assert torch.equal(grads[3][..., ks], torch.zeros_like(grads[3][..., ks]))


# (mask_spec, H, Hkv, causal, bias_spec): every per-key mask shape, GQA / MQA / MHA, bias
# sharing the mask's heads or not.
TILE_CASES = [
    ("1", 4, 2, True, "1"),
    ("K", 4, 2, False, "K"),
    ("H", 4, 2, True, "H"),
    ("H", 2, 1, False, "K"),
    ("K", 2, 2, True, None),
]


@pytest.mark.parametrize("case", TILE_CASES, ids=lambda c: "m{}_h{}kv{}{}_b{}".format(
    c[0], c[1], c[2], "_causal" if c[3] else "", c[4]))
def test_varlen_key_tiles_dead_full_partial(case):
    # Dead, full and partial key tiles in one packed batch, per mask head; dead ones poisoned.
    run_tile_case(*case)
