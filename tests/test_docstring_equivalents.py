"""The "Equivalent plain PyTorch" blocks of the user-facing docstrings run as written and give
what the documented function gives (on CPU, in float64, or float32 for a block that computes
its scores in float32): a reader who copies one gets the library's semantics, GQA grouping
and selection included."""
import inspect
import textwrap

import einops
import pytest
import torch
import torch.nn.functional as F

from flash_dmattn import flash_dma_attention
from flash_dmattn.modules import DynamicMaskAttention
from flash_dmattn.utils.dynamic import apply_dynamic_mask_attention, dynamic_mask_bias


def plain_block(obj) -> str:
    """The code block that follows "Equivalent plain PyTorch" in ``obj``'s docstring."""
    doc = inspect.getdoc(obj)
    start = doc.index("::", doc.index("Equivalent plain PyTorch")) + 2
    lines = []
    for line in doc[start:].splitlines()[1:]:
        if line.strip() and not line.startswith("    "):
            break
        lines.append(line)
    return textwrap.dedent("\n".join(lines)).strip()


def run_block(obj, result, **names):
    """Runs the block as the body of a function of ``names``; returns ``result``
    (a name the block assigns) or, for a block that ends in ``return``, what it returns."""
    body = textwrap.indent(plain_block(obj), "    ")
    tail = f"\n    return {result}" if result else ""
    scope = dict(torch=torch, F=F, einops=einops)
    exec(f"def block({', '.join(names)}):\n{body}{tail}\n", scope)
    return scope["block"](**names)


def dma_inputs(seed, q_shape, kv_shape, kv_heads, head_dim):
    """Float64 query, key, value of the given shapes, ``dt_proj`` and a negative ``A``."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float64)
               for shape in (q_shape, kv_shape, kv_shape))
    dt_proj = torch.randn(kv_heads, kv_heads * head_dim, generator=gen, dtype=torch.float64) / 8
    return q, k, v, dt_proj, -torch.rand(kv_heads, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("window, causal", [(8, True), (8, False), (100, True)])
def test_flash_dma_attention(window, causal):
    B, Lq, Lk, H, Hkv, D = 2, 37, 53, 4, 2, 16
    q, k, v, dt_proj, a_coef = dma_inputs(window + causal, (B, Lq, H, D), (B, Lk, Hkv, D), Hkv, D)
    want = flash_dma_attention(q, k, v, dt_proj, a_coef, keep_window_size=window, causal=causal)
    got = run_block(flash_dma_attention, "out", query=q, key=k, value=v, dt_proj=dt_proj,
                    a_coef=a_coef, keep_window_size=window, causal=causal,
                    softmax_scale=D ** -0.5, keep=1.0, dropout_p=0.0)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("window, causal, padded", [(8, True, False), (8, False, True),
                                                    (8, True, True), (100, False, False)])
def test_apply_dynamic_mask_attention(window, causal, padded):
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 37, 53, 16
    q, k, v, dt_proj, A = dma_inputs(window + 2 * causal + padded, (B, H, Lq, D),
                                     (B, Hkv, Lk, D), Hkv, D)
    mask = None
    if padded:
        mask = torch.ones(B, 1, 1, Lk, dtype=torch.bool)
        mask[1, ..., :3] = False
    want = apply_dynamic_mask_attention(q, k, v, dt_proj, A, mask, window, causal)
    got = run_block(apply_dynamic_mask_attention, "out", query=q, key=k, value=v,
                    dt_proj=dt_proj, A=A, causal_mask=mask, keep_window_size=window,
                    is_causal=causal, dynamic_mask_bias=dynamic_mask_bias, B=B, H=H, Hkv=Hkv,
                    Lq=Lq, Lk=Lk, D=D, keep=1.0, dropout_p=0.0)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("window, causal, padded", [(8, True, False), (8, False, True),
                                                    (100, True, True)])
def test_dynamic_mask_attention_layer(window, causal, padded):
    torch.manual_seed(window + 2 * causal + padded)
    B, L, hidden, H, Hkv = 2, 45, 64, 4, 2
    layer = DynamicMaskAttention(hidden_size=hidden, num_heads=H, num_kv_heads=Hkv,
                                 window_size=window, is_causal=causal).double().eval()
    x = torch.randn(B, L, hidden, dtype=torch.float64)
    padding = None
    if padded:
        padding = torch.ones(B, L, dtype=torch.bool)
        padding[1, :5] = False
    with torch.no_grad():
        want = layer(x, attention_mask=padding)
        got = run_block(DynamicMaskAttention, None, self=layer, x=x, attention_mask=padding,
                        position_embeddings=None, is_causal=causal, window_size=window, B=B,
                        L=L, H=H, Hkv=Hkv, D=hidden // H)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("window", [1, 5, 12])
def test_topk_key_index(window):
    # With window_size >= L the function keeps slot j for key j (documented apart); below it,
    # the block gives the same positions in the same order.
    from flash_dmattn.topk_decode import topk_key_index

    gen = torch.Generator().manual_seed(window)
    B, H, L = 3, 2, 13
    bias = torch.randn(B, H, 1, L, generator=gen)
    bias[0, 0, 0, 4] = bias[0, 0, 0, 7]  # a tie: the lower position first
    min_dtype = torch.finfo(bias.dtype).min
    bias[1, 1, 0, 2:5] = min_dtype
    padding = torch.rand(B, L, generator=gen) > 0.2
    cache_seqlens = torch.tensor([13, 9, 3])
    want = topk_key_index(bias, window, cache_seqlens=cache_seqlens, padding_mask=padding)
    got = run_block(topk_key_index, "index", bias=bias, window_size=window, min_dtype=min_dtype,
                    padding_mask=padding, cache_seqlens=cache_seqlens, j=torch.arange(L))
    assert torch.equal(got, want)


@pytest.mark.parametrize("causal, softcap, heads_of_aux", [(True, 0.0, 4), (False, 5.0, 1),
                                                          (True, 5.0, 1)])
def test_flash_dmattn_func(causal, softcap, heads_of_aux):
    # The main block: GQA, a mask and a bias per query head or shared by all, causal with
    # Lq != Lk (bottom-right aligned), soft cap, and rows that see no key (0). Float32: the
    # block computes scores in float32, as the kernels do for 16-bit inputs.
    from flash_dmattn import flash_dmattn_func

    gen = torch.Generator().manual_seed(int(causal) + int(softcap) + heads_of_aux)
    B, Lq, Lk, H, Hkv, D = 2, 29, 41, 4, 2, 16
    q = torch.randn(B, Lq, H, D, generator=gen, dtype=torch.float32)
    k = torch.randn(B, Lk, Hkv, D, generator=gen, dtype=torch.float32)
    v = torch.randn(B, Lk, Hkv, D, generator=gen, dtype=torch.float32)
    mask = torch.rand(B, heads_of_aux, Lq, Lk, generator=gen) > 0.4
    mask[:, :, 3] = False
    bias = torch.randn(B, heads_of_aux, Lq, Lk, generator=gen, dtype=torch.float32)
    scale = D ** -0.5
    want = flash_dmattn_func(q, k, v, attn_mask=mask, attn_bias=bias, softmax_scale=scale,
                             is_causal=causal, softcap=softcap)
    got = run_block(flash_dmattn_func, "out", q=q, k=k, v=v, H=H, Hkv=Hkv, Lq=Lq, Lk=Lk,
                    softmax_scale=scale, softcap=softcap, attn_bias=bias, attn_mask=mask,
                    is_causal=causal)
    torch.testing.assert_close(got, want)
