"""Decoding over a top-W key selection (flash_dmattn.topk_decode): the selection against the
dense top-k masks, and attention over the listed keys against the dense-mask decode.

The triton kernel (backends/triton/decode_selected.py) runs on CPU tensors under the
interpreter with 16-key tiles and a few splits; the gathered path runs everywhere. Both are
held to the reference backend called with the selection as a bool mask: the same visible keys,
with the bias added.
"""
import math

import pytest
import torch

from flash_dmattn import reference_dmattn_func
from flash_dmattn.topk_decode import selected_keys_attention, topk_key_index
from flash_dmattn.utils.mask import create_mask, topk_intervals

from interpreter_only import interpreter_skip_reason
from naive import assert_close

_NO_INTERPRETER = interpreter_skip_reason()
needs_interpreter = pytest.mark.skipif(_NO_INTERPRETER is not None, reason=str(_NO_INTERPRETER))


def index_mask(index, seqlen_k):
    """``(B, Hi, 1, Lk)`` bool: the keys ``index`` lists (entries < 0 or >= Lk: none)."""
    listed = (index >= 0) & (index < seqlen_k)
    mask = torch.zeros(*index.shape[:2], 1, seqlen_k + 1, dtype=torch.bool)
    mask.scatter_(-1, torch.where(listed, index, seqlen_k)[:, :, None].long(), True)
    return mask[..., :seqlen_k]


def tied_bias(B, H, L, seed=0):
    """Few distinct values (many ties), a -0.0 / +0.0 pair, masked and NaN entries."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.randint(0, 4, (B, H, 1, L), generator=g).float()
    bias[..., 1] = -0.0
    bias[..., 2] = 0.0
    bias[..., 3] = torch.finfo(torch.float32).min
    bias[0, 0, 0, 5] = float("nan")
    bias[0, 0, 0, 6] = float("-inf")
    return bias


# ---------------------------------------------------------------------------------------------
# The selection
@pytest.mark.parametrize("window", [1, 5, 40, 64])
def test_topk_key_index_is_the_last_row_of_the_dense_selection(window):
    B, H, L = 3, 2, 40
    bias = tied_bias(B, H, L)
    padding = torch.rand(B, L, generator=torch.Generator().manual_seed(1)) > 0.2
    cache = torch.tensor([40, 17, 0], dtype=torch.int32)
    index = topk_key_index(bias, window, cache_seqlens=cache, padding_mask=padding)
    assert index.dtype == torch.int64 and tuple(index.shape) == (B, H, min(window, L))
    got = index_mask(index, L)[:, :, 0]
    for b in range(B):
        n = int(cache[b])
        want = torch.zeros(H, L, dtype=torch.bool)
        if n:
            dense = create_mask(bias[b:b + 1, ..., :n], padding[b:b + 1, :n], window_size=window)
            want[:, :n] = dense[0, :, -1]
            # ... and the last query of the causal interval form, over the used keys
            iv = topk_intervals(bias[b:b + 1, ..., :n], window, padding_mask=padding[b:b + 1, :n])
            assert torch.equal(iv.to_dense(n)[0, :, -1], want[:, :n])
        assert torch.equal(got[b], want), (b, got[b], want)
        for h in range(H):
            row = index[b, h]
            used = row[row >= 0]
            if window >= L:  # slot j holds key j
                assert torch.equal(used, torch.nonzero(row >= 0).flatten())
                continue
            # listed keys first, best first (ties by position), empty ones (-1) after them
            assert (row[len(used):] == -1).all()
            keys = [(-bias[b, h, 0, j].item(), j) for j in used.tolist()]
            assert keys == sorted(keys)


def test_topk_key_index_without_cache_or_padding_and_errors():
    bias = tied_bias(2, 3, 30)
    index = topk_key_index(bias, 7, min_dtype=0.5)  # min_dtype: keys <= 0.5 never selected
    want = create_mask(bias, window_size=7, min_dtype=0.5)[:, :, -1]
    assert torch.equal(index_mask(index, 30)[:, :, 0], want)
    with pytest.raises(ValueError, match="per-key"):
        topk_key_index(bias.expand(2, 3, 4, 30), 7)
    with pytest.raises(TypeError, match="window_size"):
        topk_key_index(bias, True)
    with pytest.raises(ValueError, match="cache_seqlens"):
        topk_key_index(bias, 7, cache_seqlens=torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="batch"):
        topk_key_index(bias, 7, cache_seqlens=torch.tensor([1, 2, 3]))


# ---------------------------------------------------------------------------------------------
# Attention over the listed keys
def make(B, Lq, H, Hkv, Lk, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*s, generator=g).to(dtype)
                 for s in ((B, Lq, H, D), (B, Lk, Hkv, D), (B, Lk, Hkv, D)))


def dense(q, k, v, index, bias, causal=False, softcap=None, cache=None, floor=None):
    """The dense-mask call the selected one must equal (float64 reference backend)."""
    mask = index_mask(index, k.shape[1])
    if floor is not None:
        if bias.shape[1] > mask.shape[1]:  # the kv head's list serves its query heads
            mask = mask.repeat_interleave(bias.shape[1] // mask.shape[1], 1)
        mask = mask & torch.isfinite(bias) & (bias > floor)
    b64 = None if bias is None else bias.double()
    return reference_dmattn_func(q.double(), k.double(), v.double(), attn_mask=mask, attn_bias=b64,
                                 is_causal=causal, softcap=softcap, cache_seqlens=cache)


PATHS = [pytest.param("triton", marks=needs_interpreter), "gathered"]


def selected(path, monkeypatch, *args, **kwargs):
    """``selected_keys_attention`` on one path: the triton kernel (forced, as on CPU it runs
    only then), or the gathered dense call (another backend forced)."""
    from flash_dmattn import topk_decode

    monkeypatch.setenv("FLASH_DMATTN_BACKEND", "torch-reference" if path == "gathered" else "triton")
    if path == "triton":
        assert topk_decode._triton_runs(args[0], args[1], args[2], args[3],
                                        kwargs.get("attn_bias"), args[0].shape[2], args[1].shape[2])
    return selected_keys_attention(*args, **kwargs)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("H,Hkv,window", [(4, 2, 40), (4, 1, 1), (2, 2, 64)])
def test_selected_decode_matches_dense(poison, monkeypatch, path, H, Hkv, window):
    # Ties, padding-like masked keys, per-batch used lengths (one empty cache), a per-kv-head
    # DMA bias; 40 slots run as 3 splits under the interpreter (combine), 64 >= Lk lists all.
    B, Lk, D = 3, 50, 16
    q, k, v = make(B, 1, H, Hkv, Lk, D)
    bias = tied_bias(B, Hkv, Lk).nan_to_num(nan=1.0, neginf=-1e30)
    cache = torch.tensor([50, 21, 0], dtype=torch.int32)
    index = topk_key_index(bias, window, cache_seqlens=cache)
    out = selected(path, monkeypatch, q, k, v, index, attn_bias=bias, cache_seqlens=cache)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close("out", out, dense(q, k, v, index, bias, cache=cache), 2e-5)
    assert (out[2] == 0).all()  # no used key: zero rows


@pytest.mark.parametrize("path", PATHS)
def test_selected_decode_causal_queries_per_head_bias_softcap(poison, monkeypatch, path):
    # Two queries (a speculative step): causality by each listed key's position; a bias per
    # query head and query; softcap; unsorted lists with empty slots in the middle.
    B, Lq, H, Hkv, Lk, D = 2, 2, 4, 2, 37, 24
    q, k, v = make(B, Lq, H, Hkv, Lk, D, seed=3)
    k = torch.cat([k, torch.ones_like(k)], -1)[..., :D]  # rows with a stride of their own
    bias = torch.randn(B, H, Lq, Lk, generator=torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(5)
    index = torch.stack([torch.randperm(Lk, generator=g)[:20] for _ in range(B * Hkv)])
    index = index.view(B, Hkv, 20).to(torch.int32)
    index[:, :, 3] = -1
    index[0, 1, 7] = Lk + 4  # past the cache: empty
    index[1, 0, :] = torch.arange(Lk - 20, Lk)  # the newest keys, whose visibility causality cuts
    cache = torch.tensor([37, 30], dtype=torch.int32)
    out = selected(path, monkeypatch, q, k, v, index, attn_bias=bias, is_causal=True, softcap=5.0,
                   cache_seqlens=cache)
    assert_close("out", out, dense(q, k, v, index, bias, True, 5.0, cache), 2e-5)


@pytest.mark.parametrize("path", PATHS)
def test_selected_decode_reads_an_additive_mask_as_bias(poison, monkeypatch, path):
    # A transformers additive mask (bias where kept, dtype-min / -inf / +inf / NaN elsewhere)
    # read with bias_floor: those slots are hidden as the dense path hides them; a kv head
    # whose every listed entry is masked gives zero rows. bf16, per query head mask (the group
    # shares the list, as Doge's repeated rows do).
    B, H, Hkv, Lk, D = 2, 4, 2, 33, 16
    dtype = torch.bfloat16
    q, k, v = make(B, 1, H, Hkv, Lk, D, dtype, seed=6)
    lo = torch.finfo(dtype).min
    m = torch.randn(B, Hkv, 1, Lk, generator=torch.Generator().manual_seed(7)).to(dtype)
    m[..., ::3] = lo
    m[0, 0, 0, 4], m[0, 0, 0, 5], m[0, 0, 0, 7] = float("inf"), float("nan"), float("-inf")
    m[1, 1] = lo
    index = torch.topk(m[:, :, 0].float().nan_to_num(nan=-3e38), 12, dim=-1).indices
    m_heads = m.repeat_interleave(H // Hkv, 1)
    out = selected(path, monkeypatch, q, k, v, index, attn_bias=m_heads, bias_floor=lo / 2)
    want = dense(q, k, v, index, m_heads.float(), floor=lo / 2)
    assert_close("out", out.float(), want, 3e-2)
    assert (out[1, :, 2:] == 0).all()


def test_selected_decode_per_query_head_lists_and_gradients():
    # One list per query head (G > 1): the gathered path, which also carries gradients to q,
    # k, v and the bias, equal to the dense call's.
    B, H, Hkv, Lk, D = 2, 4, 2, 29, 16
    q, k, v = make(B, 1, H, Hkv, Lk, D, seed=8)
    bias = torch.randn(B, Hkv, 1, Lk, generator=torch.Generator().manual_seed(9))
    index = topk_key_index(torch.randn(B, H, 1, Lk), 9)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    out = selected_keys_attention(*leaves[:3], index, attn_bias=leaves[3])
    g = torch.Generator().manual_seed(10)
    dout = torch.randn(out.shape, generator=g)
    (out * dout).sum().backward()
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    mask = index_mask(index, Lk)  # (B, H, 1, Lk): per query head
    ref = reference_dmattn_func(*ref_leaves[:3], attn_mask=mask, attn_bias=ref_leaves[3])
    (ref * dout).sum().backward()
    assert_close("out", out, ref, 1e-5)
    for name, a, b in zip("qkvb", leaves, ref_leaves):
        assert_close(f"d{name}", a.grad, b.grad, 1e-5)


def test_selected_decode_argument_errors():
    q, k, v = make(2, 1, 4, 2, 10, 8)
    index = torch.zeros(2, 2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="int32 or int64"):
        selected_keys_attention(q, k, v, index.float())
    with pytest.raises(ValueError, match="key_index must have shape"):
        selected_keys_attention(q, k, v, index[:, :, None])
    with pytest.raises(ValueError, match="bias_floor needs attn_bias"):
        selected_keys_attention(q, k, v, index, bias_floor=-1.0)
    with pytest.raises(ValueError, match="does not broadcast"):
        selected_keys_attention(q, k, v, index, attn_bias=torch.zeros(2, 3, 1, 10))


@needs_interpreter
@pytest.mark.parametrize("num_splits", [1, 2, 7])
def test_kernel_splits_and_lse(poison, num_splits):
    # The launcher with explicit split counts (7 over 40 slots: whole 16-slot tiles, 3 splits;
    # empty lists of one batch): out and lse equal the dense decode kernel's with the mask.
    from flash_dmattn.backends.triton.decode import decode_forward
    from flash_dmattn.backends.triton.decode_selected import selected_decode_forward

    B, H, Hkv, Lk, D = 2, 4, 2, 60, 16
    q, k, v = make(B, 1, H, Hkv, Lk, D, seed=11)
    bias = torch.randn(B, Hkv, 1, Lk, generator=torch.Generator().manual_seed(12))
    index = topk_key_index(bias, 40)
    index[1] = -1
    scale = 1 / math.sqrt(D)
    out, lse = selected_decode_forward(q, k, v, index, bias, scale, False, 0.0,
                                       num_splits=num_splits)
    want_out, want_lse = decode_forward(q, k, v, index_mask(index, Lk), bias, scale, False, 0.0)
    assert_close("out", out, want_out, 2e-5)
    assert_close("lse", lse, want_lse, 2e-5)
    assert (out[1] == 0).all() and torch.isinf(lse[1]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("Lk,window", [(1088, 256), (8192, 2048)])
def test_gpu_selected_decode_matches_dense_decode(Lk, window):
    from flash_dmattn import triton_dmattn_func

    torch.manual_seed(0)
    B, H, Hkv, D, dt = 4, 16, 4, 128, torch.bfloat16
    q = torch.randn(B, 1, H, D, device="cuda", dtype=dt)
    k = torch.randn(B, Lk, Hkv, D, device="cuda", dtype=dt)
    v = torch.randn(B, Lk, Hkv, D, device="cuda", dtype=dt)
    bias = torch.randn(B, Hkv, 1, Lk, device="cuda", dtype=dt)
    cache = torch.tensor([Lk, Lk - 100, 7, 0], device="cuda", dtype=torch.int32)
    index = topk_key_index(bias, window, cache_seqlens=cache)
    out = selected_keys_attention(q, k, v, index, attn_bias=bias, cache_seqlens=cache)
    mask = index_mask(index.cpu(), Lk).cuda()
    want = triton_dmattn_func(q, k, v, attn_mask=mask, attn_bias=bias, cache_seqlens=cache)
    assert_close("out", out.float(), want.float(), 2e-2)
