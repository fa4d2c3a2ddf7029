"""An independent, deliberately plain float64 implementation of docs/contract.md §3 for the tests.

Everything is materialised at full (B, H, Lq, Lk) size; it shares no code with the library.
"""
import torch
from einops import repeat


def expand_heads(t, batch, heads, kv_heads, lq, lk):
    """Broadcast a 4-D mask/bias (head dim 1, Hkv or H) to (B, H, Lq, Lk)."""
    if t.shape[1] == kv_heads and kv_heads != heads:
        t = repeat(t, "b hkv i j -> b (hkv g) i j", g=heads // kv_heads)
    return t.expand(batch, heads, lq, lk)


def naive_attention(q, k, v, mask=None, bias=None, scale=None, causal=False, softcap=0.0):
    """Returns (out (B, Lq, H, D), lse (B, H, Lq)), all in float64, differentiable."""
    q, k, v = q.double(), k.double(), v.double()
    B, Lq, H, D = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    scale = D ** -0.5 if scale is None else scale
    kk, vv = (repeat(t, "b j hkv d -> b j (hkv g) d", g=g) for t in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        b4 = bias.double()
        while b4.dim() < 4:
            b4 = b4.unsqueeze(0)
        s = s + expand_heads(b4, B, H, Hkv, Lq, Lk)
    visible = torch.ones(B, H, Lq, Lk, dtype=torch.bool, device=q.device)
    if mask is not None:
        m4 = mask
        while m4.dim() < 4:
            m4 = m4.unsqueeze(0)
        visible = visible & expand_heads(m4, B, H, Hkv, Lq, Lk)
    if causal:
        i = torch.arange(Lq, device=q.device).unsqueeze(1)
        j = torch.arange(Lk, device=q.device).unsqueeze(0)
        visible = visible & (j <= i + Lk - Lq)
    s = s.masked_fill(~visible, float("-inf"))
    empty = torch.isneginf(s).all(dim=-1, keepdim=True)
    safe = torch.where(empty, torch.zeros_like(s), s)
    p = torch.softmax(safe, dim=-1) * (~empty)
    lse = torch.where(empty.squeeze(-1), torch.full_like(empty.squeeze(-1), float("-inf"), dtype=s.dtype),
                      torch.logsumexp(safe, dim=-1))
    out = torch.einsum("bhij,bjhd->bihd", p, vv)
    return out, lse


def assert_close(name, got, want, tol):
    """Max-abs error of ``got`` within ``tol`` x the largest magnitude of ``want`` (at least 1),
    with identical NaN-free inf patterns (fully masked rows give lse = -inf exactly)."""
    assert got is not None, name
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert not torch.isnan(got).any(), f"{name} has NaN"
    got, want = got.double(), want.double()
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), f"{name}: inf pattern differs"
    assert torch.equal(got[~finite], want[~finite]), f"{name}: inf values differ"
    if finite.any():
        scale = want[finite].abs().max().clamp_min(1.0)
        err = (got[finite] - want[finite]).abs().max()
        assert err <= tol * scale, f"{name}: max err {err.item():.3g} > {tol} * {scale.item():.3g}"
