"""Packed sequences with a key-interval mask on the kernel backends.

``flash_dmattn_varlen_func(..., attn_mask=KeyIntervals(...))`` runs on triton and cuda as one
batch-1 key-interval call over the packed tokens (flash_dmattn/planning/packed_intervals.py).
Here: the remap against per-sequence dense masks (plain PyTorch), the triton kernels under the
interpreter against the float64 reference run sequence by sequence on the same masks in dense
form (outputs and dq, dk, dv, dbias), the window promise, the declines, and (``gpu``) the
compiled triton and cuda kernels at bf16.
"""
import pytest
import torch

import flash_dmattn as fd
from flash_dmattn import KeyIntervals, flash_dmattn_varlen_func, registry
from flash_dmattn.inputs import VarlenInputs
from flash_dmattn.planning.packed_intervals import (
    pack_key_intervals,
    packed_interval_inputs,
    packed_window,
)
from flash_dmattn.utils.padding import cu_seqlens_from_lengths

from interpreter_only import interpreter_skip_reason, needs_triton, skip_unless_available

_INTERP_REASON = interpreter_skip_reason()
needs_interpreter = pytest.mark.skipif(_INTERP_REASON is not None,
                                       reason=_INTERP_REASON or "")

H, HKV = 4, 2
# Per sequence: Lq < Lk, length 1, Lq > Lk, an empty one, odd equal lengths, no keys.
LENS_Q = [3, 1, 7, 0, 5, 2]
LENS_K = [6, 1, 4, 3, 5, 0]


def _aux_shape(spec, total_k):
    return None if spec is None else {"1": (total_k,), "K": (HKV, total_k),
                                      "H": (H, total_k)}[spec]


def make_problem(lens_q, lens_k, D=16, bounds="K", bias="K", tail_q=0, tail_k=0, seed=0,
                 width=6, empty_first=False):
    """Packed q, k, v (rows past ``cu_seqlens[-1]`` when ``tail_*``), per-key bounds and bias,
    cu_seqlens; intervals at random positions of their own sequence, some empty."""
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q) + tail_q, sum(lens_k) + tail_k
    q = torch.randn(tq, H, D, generator=g)
    k = torch.randn(tk, HKV, D, generator=g)
    v = torch.randn(tk, HKV, D, generator=g)
    shape = _aux_shape(bounds, tk)
    start = torch.randint(-2, max(lens_k + [1]) + 1, shape, generator=g)
    end = start + torch.randint(-2, width, shape, generator=g)
    if empty_first:
        # No key of any sequence reaches its first two query positions' rows.
        start = start.clamp(min=max(lens_k + [1]))
    b = _aux_shape(bias, tk)
    bias_t = None if b is None else torch.randn(b, generator=g)
    return (q, k, v, start, end, bias_t, cu_seqlens_from_lengths(lens_q),
            cu_seqlens_from_lengths(lens_k))


def reference_dense(q, k, v, start, end, bias, cu_q, cu_k, causal, softcap=0.0):
    """The float64 reference, sequence by sequence, on each sequence's mask in dense form;
    rows past ``cu_q[-1]`` are 0."""
    parts = []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        lq = cq[i + 1] - cq[i]
        if lq == 0:
            continue
        dense = KeyIntervals(start[..., ks], end[..., ks]).to_dense(lq)
        b = None if bias is None else bias.reshape(-1, bias.shape[-1])[:, ks][None, :, None]
        parts.append(fd.reference_dmattn_func(q[None, qs], k[None, ks], v[None, ks], dense, b,
                                              is_causal=causal, softcap=softcap)[0])
    tail = q.shape[0] - cq[-1]
    if tail:
        parts.append(q.new_zeros(tail, q.shape[1], v.shape[-1]))
    return torch.cat(parts)


def check(lens_q, lens_k, causal, *, backend="triton", device="cpu", dtype=torch.float32,
          softcap=0.0, deterministic=False, window=None, intervals=None, monkeypatch=None,
          **problem):
    """Run ``backend`` on a packed problem and compare output and every gradient with the
    float64 reference on the dense masks."""
    q, k, v, start, end, bias, cu_q, cu_k = make_problem(lens_q, lens_k, **problem)
    if intervals is not None:
        start, end = intervals
    ki = KeyIntervals(start, end, window=window)
    monkeypatch.setenv("FLASH_DMATTN_BACKEND", backend)

    def leaf(t, dt):
        return None if t is None else t.to(device, dt).requires_grad_(True)

    leaves = tuple(leaf(t, dtype) for t in (q, k, v, bias))
    out = flash_dmattn_varlen_func(
        *leaves[:3], cu_q.to(device), cu_k.to(device), max(lens_q), max(lens_k),
        attn_mask=ki.to(device), attn_bias=leaves[3], is_causal=causal, softcap=softcap,
        deterministic=deterministic)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    live = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(out, live, g)

    def reference(dt):
        ref_leaves = tuple(leaf(t, dt) for t in (q, k, v, bias))
        ref = reference_dense(*ref_leaves[:3], start.to(device), end.to(device), ref_leaves[3],
                              cu_q, cu_k, causal, softcap)
        live = [t for t in ref_leaves if t is not None]
        return (ref, *torch.autograd.grad(ref, live, g.to(dt)))

    names = ("out", "dq", "dk", "dv", "dbias")
    want = reference(torch.float64)
    for name, a, r in zip(names, (out, *grads), want):
        assert a.shape == r.shape, name
        assert not torch.isnan(a).any(), name
        if dtype == torch.float32:
            torch.testing.assert_close(a.double(), r, atol=2e-4, rtol=2e-4, msg=name)
    if dtype != torch.float32:
        # Low precision: the kernel's error against float64 stays within a small multiple of
        # the error of the reference itself run at the same precision.
        for name, a, lo, r in zip(names, (out, *grads), reference(dtype), want):
            err = (a.double() - r).abs().max().item()
            base = (lo.double() - r).abs().max().item()
            assert err <= 3 * base + 1e-3 * r.abs().max().item() + 1e-5, (name, err, base)
    return out, cu_q


# ---------------------------------------------------------------------------------------
# The remap, in plain PyTorch
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", ["1", "K", "H"])
def test_packed_bounds_are_the_block_diagonal_of_the_sequences(causal, heads):
    """The packed call's mask (not causal) is exactly the per-sequence masks (causal or not)
    on the diagonal, nothing elsewhere; rows and keys past cu_seqlens[-1] see nothing."""
    _, _, _, start, end, _, cu_q, cu_k = make_problem(LENS_Q, LENS_K, bounds=heads,
                                                      tail_q=2, tail_k=3, seed=5)
    tq, tk = sum(LENS_Q) + 2, sum(LENS_K) + 3
    bounds = KeyIntervals(start, end).bounds[:, 0]
    packed = pack_key_intervals(bounds, cu_q, cu_k, tq, causal)
    assert packed.shape == (2, 1, bounds.shape[1], tk) and packed.dtype == torch.int32
    got = KeyIntervals.from_bounds(packed).to_dense(tq)[0]  # (Hx, tq, tk)
    want = torch.zeros_like(got)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(LENS_Q)):
        lq, lk = LENS_Q[i], LENS_K[i]
        ks = slice(ck[i], ck[i + 1])
        dense = KeyIntervals(start[..., ks], end[..., ks]).to_dense(lq)[0]
        if causal:
            pos = torch.arange(lq)[:, None] + lk - lq
            dense = dense & (torch.arange(lk)[None, :] <= pos)
        want[:, cq[i]:cq[i + 1], ks] = dense
    assert torch.equal(got, want)


def test_packed_bounds_without_sequences_or_keys():
    cu = torch.zeros(1, dtype=torch.int32)
    b = torch.zeros(2, 1, 4, dtype=torch.int32)
    assert torch.equal(pack_key_intervals(b, cu, cu, 3, True), torch.zeros(2, 1, 1, 4,
                                                                          dtype=torch.int32))
    cu2 = cu_seqlens_from_lengths([2, 1])
    empty = torch.zeros(2, 1, 0, dtype=torch.int32)
    assert pack_key_intervals(empty, cu2, torch.zeros(3, dtype=torch.int32), 3,
                              False).shape == (2, 1, 1, 0)


def test_window_promise_only_for_one_sequence():
    assert packed_window(64, 1) == 64
    assert packed_window(64, 2) is None
    assert packed_window(None, 1) is None


def _packed_causal_topk(lens, window, seed):
    """Per sequence, the causal top-``window`` selection of a random per-key bias, as packed
    varlen bounds ``(Hkv, total)``."""
    from flash_dmattn.utils.mask import topk_intervals

    g = torch.Generator().manual_seed(seed)
    starts, ends = [], []
    for n in lens:
        ki = topk_intervals(torch.randn(1, HKV, 1, n, generator=g), window, is_causal=True)
        starts.append(ki.start[0])
        ends.append(ki.end[0])
    return torch.cat(starts, -1), torch.cat(ends, -1)


@needs_triton
def test_one_sequence_keeps_lists_within_the_window_capacity():
    """With one sequence the packed call keeps the window promise: planned with it (lists
    sized for W + rows - 1 keys a tile, no wait for the device) the lists equal those planned
    without it, causality folded in."""
    from flash_dmattn.planning.key_lists import plan_intervals_reference

    L, W = 90, 5
    start, end = _packed_causal_topk([L], W, seed=2)
    cu = cu_seqlens_from_lengths([L])
    packed = pack_key_intervals(torch.stack([start, end]), cu, cu, L, True)
    ref = plan_intervals_reference(packed, L, L, False, 16, 16, False)
    from flash_dmattn.planning.key_lists import plan_intervals

    for seg in (None, 32):
        plan = plan_intervals(packed, L, L, False, 16, 16, seg is not None, window=W,
                              segment_rows=seg)
        assert not plan.hides_nothing
        assert torch.equal(plan.tile_len, ref.tile_len)
        assert torch.equal(plan.tile_full, ref.tile_full)
        for r in range(plan.rows):
            for t in range(plan.n_tiles):
                a, n = int(plan.tile_start[r, t]), int(plan.tile_len[r, t])
                b = int(ref.tile_start[r, t])
                assert torch.equal(plan.keys[a:a + n], ref.keys[b:b + n])


# ---------------------------------------------------------------------------------------
# Dispatch and declines (no kernel runs)
# ---------------------------------------------------------------------------------------
def _inputs(grad=False, **kw):
    q, k, v, start, end, bias, cu_q, cu_k = make_problem(LENS_Q, LENS_K, bounds=kw.pop(
        "bounds", "K"))
    q.requires_grad_(grad)
    return VarlenInputs.from_args(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K),
                                  attn_mask=KeyIntervals(start, end, window=kw.pop("window",
                                                                                    None)),
                                  attn_bias=bias, **kw)


def test_packed_inputs_are_a_batch_of_one_without_causality():
    inputs = _inputs(is_causal=True, window=8)
    packed = packed_interval_inputs(inputs)
    assert packed.query.shape == (1,) + tuple(inputs.query.shape)
    assert packed.key.shape == (1,) + tuple(inputs.key.shape)
    assert packed.attn_bias.shape == (1, HKV, 1, inputs.key.shape[0])
    assert packed.key_intervals.shape == (2, 1, HKV, inputs.key.shape[0])
    assert not packed.is_causal and packed.attn_mask is None
    assert packed.key_window is None  # several sequences: the promise does not hold
    shapes = packed_interval_inputs(inputs, remap=False)
    assert shapes.key_intervals.shape == packed.key_intervals.shape


@needs_triton
def test_triton_declines_dropout_and_probs_only():
    backend = next(b for b in registry.registered_backends() if b.name == "triton")
    reasons = backend.varlen_not_supported_reasons(_inputs(dropout_p=0.1))
    assert any("dropout" in r for r in reasons)
    reasons = backend.varlen_not_supported_reasons(_inputs(return_attn_probs=True))
    assert any("return_attn_probs" in r for r in reasons)
    if _INTERP_REASON is None:
        assert backend.varlen_not_supported_reasons(_inputs(is_causal=True)) == []


def test_cuda_varlen_reasons_come_from_the_packed_call():
    """The cuda backend's reasons for a varlen key-interval call are those of the packed
    key-interval call (checked here without a GPU: no kernel is built or launched)."""
    cuda = next(b for b in registry.registered_backends() if b.name == "cuda")
    reasons = cuda.varlen_not_supported_reasons(_inputs(grad=True, bounds="H", dropout_p=0.1,
                                                        deterministic=True))
    text = "; ".join(reasons)
    assert "no cuda kernel yet" not in text
    assert "per query head" in text and "deterministic" in text and "dropout" in text
    if not torch.cuda.is_available():
        assert "needs CUDA" in text
    # A float32 bias beside half-precision q/k/v is taken (converted to q's dtype for the
    # kernels, its gradient returned in float32: tests/test_cuda_host_inputs.py).
    q, k, v, start, end, bias, cu_q, cu_k = make_problem(LENS_Q, LENS_K)
    inputs = VarlenInputs.from_args(q.half(), k.half(), v.half(), cu_q, cu_k, max(LENS_Q),
                                    max(LENS_K), attn_mask=KeyIntervals(start, end),
                                    attn_bias=bias)
    assert not any("bias" in r for r in cuda.varlen_not_supported_reasons(inputs))


# ---------------------------------------------------------------------------------------
# triton under the interpreter: outputs and gradients against the dense reference
# ---------------------------------------------------------------------------------------
CPU_CASES = [
    # (bounds heads, bias heads, causal, softcap)
    ("K", "K", True, 0.0),
    ("K", "K", False, 0.0),
    ("1", "1", True, 0.0),
    ("H", "H", False, 3.0),       # bounds and bias per query head
    ("1", None, True, 0.0),       # no bias
    ("H", "1", True, 0.0),
]


@needs_interpreter
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_triton_matches_dense_reference(case, monkeypatch, poison):
    bounds, bias, causal, softcap = case
    check(LENS_Q, LENS_K, causal, bounds=bounds, bias=bias, softcap=softcap, tail_q=2, tail_k=1,
          monkeypatch=monkeypatch)


@needs_interpreter
def test_triton_rows_that_see_nothing_give_zero(monkeypatch, poison):
    """Every interval starts past the sequence's queries: every row is 0, never NaN, and
    every gradient is 0."""
    out, _ = check([4, 1, 6], [5, 2, 6], True, empty_first=True, monkeypatch=monkeypatch)
    assert (out == 0).all()


@needs_interpreter
def test_triton_some_rows_masked_deterministic(monkeypatch, poison):
    """Short intervals leave some rows with no key (0, not NaN); deterministic=True."""
    out, _ = check([9, 2, 13], [11, 2, 7], False, width=2, deterministic=True, seed=3,
                      monkeypatch=monkeypatch)
    assert (out == 0).all(dim=(1, 2)).any()


@needs_interpreter
def test_triton_edges(monkeypatch, poison):
    """No keys at all, no queries at all, and masks that hide nothing (the packed call then
    runs on the dense kernels; with is_causal the folded causal limit hides something)."""
    monkeypatch.setenv("FLASH_DMATTN_BACKEND", "triton")
    q = torch.randn(5, H, 16, requires_grad=True)
    k = torch.randn(0, HKV, 16, requires_grad=True)
    none = torch.zeros(0, dtype=torch.int32)
    out = flash_dmattn_varlen_func(q, k, k, cu_seqlens_from_lengths([2, 3]),
                                   cu_seqlens_from_lengths([0, 0]), 3, 0,
                                   attn_mask=KeyIntervals(none, none))
    (dq,) = torch.autograd.grad(out.sum(), (q,))
    assert (out == 0).all() and (dq == 0).all()
    q = torch.randn(0, H, 16, requires_grad=True)
    k = torch.randn(6, HKV, 16, requires_grad=True)
    out = flash_dmattn_varlen_func(q, k, k, cu_seqlens_from_lengths([0, 0]),
                                   cu_seqlens_from_lengths([2, 4]), 0, 4,
                                   attn_mask=KeyIntervals(torch.zeros(6, dtype=torch.int32),
                                                          torch.full((6,), 9)))
    (dk,) = torch.autograd.grad(out.sum(), (k,))
    assert out.shape == (0, H, 16) and (dk == 0).all()
    for causal in (False, True):
        everything = (torch.full((7,), -100), torch.full((7,), 100))
        check([7], [7], causal, intervals=everything, monkeypatch=monkeypatch, bounds="1")


@needs_interpreter
def test_triton_compiled(monkeypatch):
    """torch.compile traces the remap and the packed call's custom ops."""
    monkeypatch.setenv("FLASH_DMATTN_BACKEND", "triton")
    q, k, v, start, end, bias, cu_q, cu_k = make_problem(LENS_Q, LENS_K, seed=4)
    leaves = [t.requires_grad_(True) for t in (q, k, v, bias)]
    args = (cu_q, cu_k, max(LENS_Q), max(LENS_K))
    kw = dict(attn_mask=KeyIntervals(start, end), is_causal=True)
    compiled = torch.compile(flash_dmattn_varlen_func, backend="aot_eager")
    out = compiled(*leaves[:3], *args, attn_bias=leaves[3], **kw)
    got = (out, *torch.autograd.grad(out.sum(), leaves))
    monkeypatch.setenv("FLASH_DMATTN_BACKEND", "torch-reference")
    ref = flash_dmattn_varlen_func(*leaves[:3], *args, attn_bias=leaves[3], **kw)
    want = (ref, *torch.autograd.grad(ref.sum(), leaves))
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r, atol=2e-4, rtol=2e-4)


@needs_interpreter
@pytest.mark.parametrize("lens_q,lens_k", [([40], [40]), ([2] * 8 + [1, 3], [12] * 8 + [7, 9])],
                         ids=["one", "many"])
def test_triton_window_promise(lens_q, lens_k, monkeypatch, poison):
    """A ``topk_intervals`` selection per sequence with its window: one sequence keeps the
    promise; in many short sequences a tile of 16 queries meets up to W + 1 keys of each of
    8 sequences, past the W + 15 a window-sized list holds, so the packed call plans without
    the promise."""
    W = 4
    start, end = _packed_causal_topk(lens_k, W, seed=len(lens_k))
    check(lens_q, lens_k, True, window=W, intervals=(start, end), monkeypatch=monkeypatch)


# ---------------------------------------------------------------------------------------
# GPU: compiled triton and the cuda Hopper kernels, bf16
# ---------------------------------------------------------------------------------------
GPU_LENS_Q = [1, 300, 777, 0, 129, 1000]
GPU_LENS_K = [5, 300, 1200, 64, 100, 1000]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias", ["K", None])
def test_gpu_matches_dense_reference(backend, causal, bias, monkeypatch):
    skip_unless_available(backend)
    if backend == "cuda" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the cuda key-interval kernels are built for sm_90")
    check(GPU_LENS_Q, GPU_LENS_K, causal, backend=backend, device="cuda",
          dtype=torch.bfloat16, D=128, bias=bias, width=400, tail_q=3, tail_k=5,
          monkeypatch=monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("lens", [[3000], [1000, 1, 700, 1300]])
def test_gpu_topk_selection_with_window(backend, lens, monkeypatch):
    skip_unless_available(backend)
    if backend == "cuda" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the cuda key-interval kernels are built for sm_90")
    if backend == "cuda":
        from flash_dmattn.backends.cuda import intervals

        monkeypatch.setattr(intervals, "ITEM_SEGMENT_ROWS", 256)  # several segment items
    W = 256
    start, end = _packed_causal_topk(lens, W, seed=len(lens))
    check(lens, lens, True, backend=backend, device="cuda", dtype=torch.bfloat16, D=128,
          window=W, intervals=(start, end), monkeypatch=monkeypatch)
