"""Every bad input of docs/contract.md §3.5 raises the specified type, naming the tensors and shapes."""
import pytest
import torch

from flash_dmattn import flash_dmattn_func, flash_dmattn_varlen_func

B, L, H, HKV, D = 2, 8, 4, 2, 16


def qkv(**over):
    t = dict(
        q=torch.randn(B, L, H, D), k=torch.randn(B, L, HKV, D), v=torch.randn(B, L, HKV, D)
    )
    t.update(over)
    return t["q"], t["k"], t["v"]


@pytest.mark.parametrize(
    "over, pattern",
    [
        (dict(q=torch.randn(L, H, D)), r"query must be 4-D.*\(8, 4, 16\)"),
        (dict(k=torch.randn(B, L, HKV, D, 1), v=torch.randn(B, L, HKV, D, 1)), r"key must be 4-D"),
        (dict(k=torch.randn(3, L, HKV, D), v=torch.randn(3, L, HKV, D)), r"batch size differs.*\(2, 8, 4, 16\).*\(3, 8, 2, 16\)"),
        (dict(k=torch.randn(B, L, HKV, 8), v=torch.randn(B, L, HKV, 8)), r"head_dim differs"),
        (dict(v=torch.randn(B, L + 1, HKV, D)), r"key and value must have the same shape.*\(2, 9, 2, 16\)"),
        (dict(k=torch.randn(B, L, 3, D), v=torch.randn(B, L, 3, D)), r"num_heads=4 .* multiple of num_kv_heads=3"),
        (dict(k=torch.randn(B, L, HKV, D, dtype=torch.float64)), r"share one dtype"),
        (dict(q=torch.randint(0, 3, (B, L, H, D))), r"dtype torch.int64"),
        (dict(k=torch.randn(B, L, HKV, D, device="meta")), r"one device"),
    ],
)
def test_bad_qkv_raise_value_error(over, pattern):
    with pytest.raises(ValueError, match=pattern):
        flash_dmattn_func(*qkv(**over))


@pytest.mark.parametrize(
    "kw, pattern",
    [
        (dict(attn_mask=torch.ones(B, 3, L, L, dtype=torch.bool)), r"attn_mask with shape \(2, 3, 8, 8\) does not broadcast.*\(2, 4, 8, 8\)"),
        (dict(attn_mask=torch.ones(B, 1, L + 1, L, dtype=torch.bool)), r"attn_mask with shape \(2, 1, 9, 8\)"),
        (dict(attn_bias=torch.ones(3, 1, 1, L)), r"attn_bias with shape \(3, 1, 1, 8\)"),
        (dict(attn_bias=torch.ones(1, 1, 1, 1, L)), r"attn_bias must have at most 4 dims"),
        (dict(attn_bias=torch.ones(1, 1, 1, L, dtype=torch.float16)), r"attn_bias has dtype torch.float16"),
        (dict(attn_bias=torch.ones(L, device="meta")), r"attn_bias is on meta"),
        (dict(softcap=-1.0), r"softcap"),
        (dict(softmax_scale=float("nan")), r"softmax_scale"),
    ],
)
def test_bad_mask_bias_raise_value_error(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        flash_dmattn_func(*qkv(), **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8])
def test_non_bool_mask_raises_type_error(dtype):
    with pytest.raises(TypeError, match=r"attn_mask must be a bool tensor.*\.bool\(\).*attn_bias"):
        flash_dmattn_func(*qkv(), attn_mask=torch.ones(B, 1, 1, L, dtype=dtype))


def test_bool_bias_raises_type_error():
    with pytest.raises(TypeError, match="attn_bias must be a floating tensor"):
        flash_dmattn_func(*qkv(), attn_bias=torch.ones(B, 1, 1, L, dtype=torch.bool))


def test_explicit_backend_that_cannot_run_raises_value_error():
    from flash_dmattn import flex_dmattn_func

    q, k, v = qkv()
    q.requires_grad_()
    with pytest.raises(ValueError, match=r"backend 'flex' cannot run these inputs .*query \(2, 8, 4, 16\).*no backward"):
        flex_dmattn_func(q, k, v)


def test_no_backend_raises_runtime_error_listing_all(monkeypatch):
    monkeypatch.setenv("FLASH_DMATTN_DISABLE", "triton,torch-reference")
    q, k, v = qkv()
    q.requires_grad_()
    with pytest.raises(RuntimeError) as info:
        flash_dmattn_func(q, k, v)
    msg = str(info.value)
    for needle in ("cuda: unavailable", "triton: unavailable: disabled",
                   "flex: FlexAttention has no backward", "torch-reference: unavailable: disabled"):
        assert needle in msg


def test_varlen_errors():
    q, k, v = torch.randn(10, H, D), torch.randn(10, HKV, D), torch.randn(10, HKV, D)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="3-D"):
        flash_dmattn_varlen_func(q[None], k, v, cu, cu, 6, 6)
    with pytest.raises(ValueError, match="n\\+1 offsets"):
        flash_dmattn_varlen_func(q, k, v, cu, cu[:2], 6, 6)
    with pytest.raises(ValueError, match=r"varlen attn_bias must have shape .*got \(3, 10\)"):
        flash_dmattn_varlen_func(q, k, v, cu, cu, 6, 6, attn_bias=torch.randn(3, 10))
    with pytest.raises(TypeError, match="bool"):
        flash_dmattn_varlen_func(q, k, v, cu, cu, 6, 6, attn_mask=torch.ones(10))
    with pytest.raises(ValueError, match="non-decreasing"):
        flash_dmattn_varlen_func(q, k, v, torch.tensor([0, 6, 4], dtype=torch.int32), cu, 6, 6)


def test_no_assert_in_library():
    import pathlib

    import flash_dmattn

    root = pathlib.Path(flash_dmattn.__file__).parent
    offenders = [
        str(p) for p in root.rglob("*.py") if any(l.strip().startswith("assert ") for l in p.read_text().splitlines())
    ]
    assert not offenders, f"user input must be validated with exceptions, not assert: {offenders}"
