"""The mistakes a new user makes first: each error names the argument, quotes the user's own
shapes, and for the common ones says what to write instead; the keyword form of create_mask."""
import inspect

import numpy as np
import pytest
import torch

from flash_dmattn import (
    create_mask,
    flash_dmattn_func,
    flash_dmattn_func_auto,
    flash_dmattn_varlen_func,
    reference_dmattn_func,
)

B, L, H, HKV, D = 2, 32, 4, 2, 16


def qkv(lq=L, lk=L, h=H, hkv=HKV):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, lq, h, D, generator=g), torch.randn(B, lk, hkv, D, generator=g),
            torch.randn(B, lk, hkv, D, generator=g))


# flash_dmattn_func_auto ----------------------------------------------------------------------
def test_auto_with_tensors_says_it_returns_a_function():
    q, k, v = qkv()
    with pytest.raises(TypeError) as info:
        flash_dmattn_func_auto(q, k, v, backend="nope")
    msg = str(info.value)
    assert "returns an attention function" in msg
    assert "flash_dmattn_func_auto(backend='triton')(query, key, value, ...)" in msg
    assert "tensor(2, 32, 4, 16)" in msg  # the call as the user wrote it


def test_auto_rejects_unknown_keywords_by_name():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'device'"):
        flash_dmattn_func_auto(device="cpu")
    with pytest.raises(TypeError, match=r"unexpected keyword arguments 'dtype', 'device'|"
                                        r"unexpected keyword arguments 'device', 'dtype'"):
        flash_dmattn_func_auto("torch-reference", device="cpu", dtype=torch.float32)


def test_auto_backend_argument():
    with pytest.raises(ValueError, match=r"unknown backend 'nope'; known backends: cuda, triton"):
        flash_dmattn_func_auto(backend="nope")
    with pytest.raises(TypeError, match=r"backend must be a backend name .* got int"):
        flash_dmattn_func_auto(3)
    with pytest.raises(TypeError, match="returns an attention function"):
        flash_dmattn_func_auto("flex", backend="flex")
    assert flash_dmattn_func_auto() is flash_dmattn_func
    assert flash_dmattn_func_auto(None) is flash_dmattn_func
    assert flash_dmattn_func_auto(backend=None) is flash_dmattn_func
    # The 1.2.x forms: positional and keyword names, and the function they return runs.
    q, k, v = qkv()
    for fn in (flash_dmattn_func_auto("torch-reference"),
               flash_dmattn_func_auto(backend="torch-reference")):
        torch.testing.assert_close(fn(q, k, v), reference_dmattn_func(q, k, v), rtol=0, atol=0)
    assert str(inspect.signature(flash_dmattn_func_auto)) == "(backend=None) -> Callable"


def test_attention_functions_reject_unknown_keywords_by_name():
    q, k, v = qkv()
    for fn in (flash_dmattn_func, reference_dmattn_func, flash_dmattn_func_auto(None)):
        with pytest.raises(TypeError, match="unexpected keyword argument 'causal'"):
            fn(q, k, v, causal=True)


# Shapes in errors: the user's own, and what to write instead --------------------------------
def test_padding_mask_as_attn_mask_quotes_its_shape_and_the_fix():
    q, k, v = qkv()
    padding = torch.ones(B, L, dtype=torch.bool)
    with pytest.raises(ValueError) as info:
        flash_dmattn_func(q, k, v, attn_mask=padding)
    msg = str(info.value)
    assert msg.startswith("attn_mask with shape (2, 32) does not broadcast")
    assert "(1, 1, 2, 32)" not in msg  # not the internal, left-padded view
    assert "attn_mask=mask[:, None, None, :] (shape (2, 1, 1, 32))" in msg
    # ... and the fix it names runs.
    out = flash_dmattn_func(q, k, v, attn_mask=padding[:, None, None, :])
    torch.testing.assert_close(out, flash_dmattn_func(q, k, v), rtol=0, atol=0)


def test_padding_bias_and_per_batch_bias_hints():
    q, k, v = qkv(lq=24)
    with pytest.raises(ValueError, match=r"attn_bias with shape \(2, 32\) .*"
                                         r"attn_bias=bias\[:, None, None, :\]"):
        flash_dmattn_func(q, k, v, attn_bias=torch.zeros(B, L))
    # Batch 3: a (3, 24, 32) bias cannot be read as one per kv head.
    q, k, v = (torch.cat([t, t[:1]]) for t in (q, k, v))
    with pytest.raises(ValueError, match=r"attn_bias with shape \(3, 24, 32\) .*shared by the "
                                         r"heads: write attn_bias=bias\[:, None\] "
                                         r"\(shape \(3, 1, 24, 32\)\)"):
        flash_dmattn_func(q, k, v, attn_bias=torch.zeros(3, 24, L))


def test_heads_first_layout_is_named():
    g = torch.Generator().manual_seed(0)
    # (B, H, L, D) tensors: the mask fits the heads-first reading, not the call's.
    q = torch.randn(B, H, L, D, generator=g)
    k = v = torch.randn(B, H, L, D, generator=g)
    with pytest.raises(ValueError, match=r"attn_mask with shape \(2, 1, 32, 32\) .*look "
                                         r"heads-first.*query.transpose\(1, 2\)"):
        flash_dmattn_func(q, k, v, attn_mask=torch.ones(B, 1, L, L, dtype=torch.bool))
    # GQA heads-first with Lq != Lk: the head counts do not divide, the sequence lengths do.
    q = torch.randn(B, 8, 10, D, generator=g)
    k = v = torch.randn(B, 2, 12, D, generator=g)
    with pytest.raises(ValueError, match=r"num_heads=10 .* multiple of num_kv_heads=12.*"
                                         r"heads-first"):
        flash_dmattn_func(q, k, v)
    # A plain head-count mistake gets no layout hint.
    q, k, v = qkv(h=4, hkv=3)
    with pytest.raises(ValueError) as info:
        flash_dmattn_func(q, k, v)
    assert "heads-first" not in str(info.value)


def test_wrong_mask_shape_in_the_right_layout_gets_no_layout_hint():
    q, k, v = qkv()
    with pytest.raises(ValueError) as info:
        flash_dmattn_func(q, k, v, attn_mask=torch.ones(B, 3, L, L, dtype=torch.bool))
    assert "heads-first" not in str(info.value) and "padding" not in str(info.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_additive_float_mask_says_what_to_write(dtype):
    q, k, v = qkv()
    additive = torch.zeros(B, 1, L, L, dtype=dtype).masked_fill(torch.rand(B, 1, L, L) < 0.3, float("-inf"))
    with pytest.raises(TypeError) as info:
        flash_dmattn_func(q, k, v, attn_mask=additive)
    msg = str(info.value)
    assert f"got {dtype} with shape (2, 1, 32, 32)" in msg
    assert "attn_mask=(mask == 0)" in msg and "attn_bias=mask" in msg and "mask.bool()" in msg
    # The bool mask it suggests is the same attention as the additive mask as a bias.
    torch.testing.assert_close(
        flash_dmattn_func(q, k, v, attn_mask=additive == 0),
        flash_dmattn_func(q, k, v, attn_bias=additive.float()),
    )


def test_integer_mask_suggests_bool():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"got torch.int64 .*attn_mask=mask.bool\(\)"):
        flash_dmattn_func(q, k, v, attn_mask=torch.ones(B, 1, 1, L, dtype=torch.int64))


# Every argument's type error names the argument -----------------------------------------------
@pytest.mark.parametrize("kw, pattern", [
    (dict(softmax_scale="a"), r"softmax_scale must be a number or None, got str 'a'"),
    (dict(softmax_scale=[0.1]), r"softmax_scale must be a number or None, got list"),
    (dict(softmax_scale=True), r"softmax_scale must be a number or None, got bool"),
    (dict(softmax_scale=torch.ones(2)), r"softmax_scale must be a number or None, got a tensor "
                                        r"of shape \(2,\)"),
    (dict(softcap="1"), r"softcap must be a number or None, got str '1'"),
    (dict(is_causal=torch.ones(3)), r"is_causal must be a bool or None, got a tensor of shape "
                                    r"\(3,\)"),
    (dict(is_causal="yes"), r"is_causal must be a bool or None, got str 'yes'"),
    (dict(is_causal=2), r"is_causal must be a bool or None, got int 2"),
    (dict(deterministic=0.5), r"deterministic must be a bool or None, got float 0.5"),
    (dict(return_attn_probs="no"), r"return_attn_probs must be a bool or None, got str"),
    (dict(attn_mask=[[True]]), r"attn_mask must be a bool torch.Tensor, a KeyIntervals or None, "
                               r"got list"),
    (dict(attn_bias=np.zeros((1, L), dtype=np.float32)), r"attn_bias must be a torch.Tensor or "
                                                         r"None, got ndarray"),
    (dict(cache_seqlens=[L, L]), r"cache_seqlens must be a torch.Tensor"),
    (dict(block_table=[[0]]), r"block_table must be a torch.Tensor"),
])
def test_type_errors_name_the_argument(kw, pattern):
    with pytest.raises(TypeError, match=pattern):
        flash_dmattn_func(*qkv(), **kw)


def test_positional_tensor_in_a_flag_slot_names_the_slot():
    q, k, v = qkv()
    mask = torch.ones(B, 1, 1, L, dtype=torch.bool)
    # (q, k, v, mask, bias, softmax_scale, is_causal): a mask one slot too far is the scale.
    with pytest.raises(TypeError, match=r"softmax_scale must be a number or None, got a tensor of "
                                        r"shape \(2, 1, 1, 32\) and dtype torch.bool"):
        flash_dmattn_func(q, k, v, None, None, mask)


def test_accepted_scalar_spellings():
    q, k, v = qkv()
    want = flash_dmattn_func(q, k, v, softmax_scale=0.25, is_causal=True)
    for scale, causal in ((torch.tensor(0.25), 1), (np.float32(0.25), np.bool_(True)),
                          (0.25, torch.tensor(True))):
        torch.testing.assert_close(
            flash_dmattn_func(q, k, v, softmax_scale=scale, is_causal=causal), want, rtol=0, atol=0)
    torch.testing.assert_close(flash_dmattn_func(q, k, v, is_causal=0),
                               flash_dmattn_func(q, k, v), rtol=0, atol=0)


def test_varlen_type_errors_name_the_argument():
    q, k, v = torch.randn(10, H, D), torch.randn(10, HKV, D), torch.randn(10, HKV, D)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"max_seqlen_q must be an int, got str '6'"):
        flash_dmattn_varlen_func(q, k, v, cu, cu, "6", 6)
    with pytest.raises(TypeError, match=r"max_seqlen_k must be an int, got NoneType"):
        flash_dmattn_varlen_func(q, k, v, cu, cu, 6, None)
    with pytest.raises(ValueError, match=r"max_seqlen_q must be >= 0, got -1"):
        flash_dmattn_varlen_func(q, k, v, cu, cu, -1, 6)
    with pytest.raises(TypeError, match=r"is_causal must be a bool or None"):
        flash_dmattn_varlen_func(q, k, v, cu, cu, 6, 6, is_causal="causal")
    with pytest.raises(TypeError, match=r"softmax_scale must be a number or None"):
        flash_dmattn_varlen_func(q, k, v, cu, cu, 6, 6, softmax_scale="a")
    with pytest.raises(TypeError, match=r"cu_seqlens_k must be a 1-D int32 torch.Tensor of n\+1 "
                                        r"offsets, got list \[0, 4, 10\]"):
        flash_dmattn_varlen_func(q, k, v, cu, [0, 4, 10], 6, 6)
    out = flash_dmattn_varlen_func(q, k, v, cu, cu, torch.tensor(6), np.int64(6))
    torch.testing.assert_close(out, flash_dmattn_varlen_func(q, k, v, cu, cu, 6, 6), rtol=0, atol=0)


# create_mask: the keyword form for the common case -------------------------------------------
F32_MIN = torch.finfo(torch.float32).min


def test_create_mask_keyword_form_equals_the_positional_form():
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(B, HKV, 1, 40, generator=g)
    padding = torch.rand(B, 40, generator=g) > 0.2
    per_query = torch.randn(B, HKV, 12, 40, generator=g)
    causal = torch.ones(12, 40, dtype=torch.bool).tril(40 - 12)[None, None]
    cases = [
        (create_mask(bias, window_size=8), create_mask(bias, None, B, 1, 40, 8, F32_MIN)),
        (create_mask(bias, padding, window_size=8), create_mask(bias, padding, B, 1, 40, 8, F32_MIN)),
        (create_mask(per_query, causal, window_size=5),
         create_mask(per_query, causal, B, 12, 40, 5, F32_MIN)),
        (create_mask(bias[:1], padding, window_size=8),  # batch from the mask
         create_mask(bias[:1], padding, B, 1, 40, 8, F32_MIN)),
        (create_mask(bias, type="relu"), create_mask(bias, None, B, 1, 40, 1, F32_MIN, type="relu")),
        (create_mask(bias, window_size=8, block_size=4),
         create_mask(bias, None, B, 1, 40, 8, F32_MIN, block_size=4)),
    ]
    for got, want in cases:
        assert got.shape == want.shape and torch.equal(got, want)
    assert create_mask(bias, window_size=8).shape == (B, HKV, 1, 40)
    assert create_mask(bias, window_size=8).sum(-1).eq(8).all()


def test_create_mask_infers_a_kv_cache_step_from_a_short_padding_mask():
    g = torch.Generator().manual_seed(2)
    bias = torch.randn(1, 1, 1, 10, generator=g)
    new_tokens = torch.tensor([[True, False, True]])  # padding of the 3 new queries
    assert torch.equal(create_mask(bias, new_tokens, window_size=4),
                       create_mask(bias, new_tokens, 1, 3, 10, 4, F32_MIN))


def test_create_mask_default_min_dtype_is_the_bias_dtype_minimum():
    bias = torch.tensor([[[[1.0, torch.finfo(torch.bfloat16).min, 0.5, 2.0]]]], dtype=torch.bfloat16)
    got = create_mask(bias, window_size=3)
    assert got.tolist() == [[[[True, False, True, True]]]]  # the "masked" entry is never kept


def test_create_mask_argument_errors_name_the_argument():
    bias = torch.zeros(1, 2, 1, 8)
    with pytest.raises(TypeError, match=r"needs window_size.*create_mask\(bias, window_size=256\)"):
        create_mask(bias)
    with pytest.raises(TypeError, match="window_size must be an int, got float"):
        create_mask(bias, window_size=2.0)
    with pytest.raises(TypeError, match="min_dtype must be a float or None, got str"):
        create_mask(bias, window_size=2, min_dtype="min")
    with pytest.raises(TypeError, match="key_len must be an int, got str"):
        create_mask(bias, window_size=2, key_len="8")
    with pytest.raises(ValueError, match=r"attention_bias has shape \(1, 2, 1, 8\); its key dim"):
        create_mask(bias, window_size=2, key_len=9)
    with pytest.raises(TypeError, match="unexpected keyword argument 'window'"):
        create_mask(bias, window=2)
    with pytest.raises(ValueError, match=r"type must be one of \('topk', 'relu'\)"):
        create_mask(bias, window_size=2, type="top-k")


def test_causal_topk_mask_with_a_per_query_bias_names_create_mask():
    from flash_dmattn.utils.mask import causal_topk_mask

    per_query = torch.randn(1, 2, 8, 8)
    with pytest.raises(ValueError, match=r"got \(1, 2, 8, 8\); a per-query bias .*create_mask\("):
        causal_topk_mask(per_query, None, 4, F32_MIN)
    # The suggested call gives the causal top-k of each query's own bias row.
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    mask = create_mask(per_query, causal[None, None], window_size=4)
    assert mask.shape == (1, 2, 8, 8) and not (mask & ~causal).any()
    assert mask.sum(-1).tolist() == [[[min(i + 1, 4) for i in range(8)]] * 2]
