"""The plain-PyTorch oracle: exact docs/contract.md §3 semantics, processed in query chunks.

Forward keeps one ``(B, H, chunk, Lk)`` score block alive at a time; backward recomputes the
probabilities chunk by chunk from the saved log-sum-exp (as FlashAttention does), so memory
stays O(chunk·Lk) in both directions instead of the O(Lq·Lk) that plain autograd would save.
GQA is computed by grouping query heads onto their kv head: K and V are never repeated.
Attention dropout regenerates each chunk's keep-mask from the call's rng tensor
(:mod:`flash_dmattn.dropout`) in both directions, as the kernels do.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from einops import rearrange
from torch import Tensor

from ..dropout import keep_mask, keep_scale
from ..ops import AttentionOp

# Elements of one fp32 score block; bounds the reference's working memory (~64 MiB a block).
CHUNK_ELEMENTS = 1 << 24

_NEG_INF = float("-inf")


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _group_heads(x: Tensor, num_kv_heads: int) -> Tensor:
    """(B, L, H, D) -> (B, Hkv, g, L, D) view: query head h = kv_head * g + member."""
    return rearrange(x, "b l (hkv g) d -> b hkv g l d", hkv=num_kv_heads)


def _group_aux(t: Optional[Tensor], num_heads: int, num_kv_heads: int) -> Optional[Tensor]:
    """A 4-D mask/bias ``(Bx, Hx, Qx, Kx)`` as a 5-D view aligned with :func:`_group_heads`."""
    if t is None:
        return None
    if t.shape[1] == num_heads:  # one per query head (also covers H == Hkv)
        return rearrange(t, "b (hkv g) q k -> b hkv g q k", hkv=num_kv_heads)
    return rearrange(t, "b h q k -> b h 1 q k")  # one per kv head, or one for all heads


def _chunk_rows(batch: int, heads: int, seqlen_k: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, batch * heads * seqlen_k))


class _Geometry:
    """Shapes and the per-chunk score computation shared by forward, backward and probs."""

    def __init__(self, q, k, mask, bias, scale, is_causal, softcap, cache_seqlens=None,
                 key_intervals=None, dropout_p=0.0, dropout_rng=None):
        self.B, self.Lq, self.H, self.D = q.shape
        self.Lk, self.Hkv = k.shape[1], k.shape[2]
        self.g = self.H // self.Hkv
        self.acc = _accumulation_dtype(q.dtype)
        self.scale, self.is_causal, self.softcap = scale, is_causal, softcap
        self.mask5 = _group_aux(mask, self.H, self.Hkv)
        self.bias5 = _group_aux(bias, self.H, self.Hkv)
        self.rows = _chunk_rows(self.B, self.H, self.Lk)
        # KV-cache decoding: per-batch used length, (B, 1, 1, 1, 1) to broadcast against the
        # grouped scores; clamped so out-of-range values (unchecked on GPU) stay defined.
        self.used = None
        if cache_seqlens is not None:
            n = cache_seqlens.to(torch.int64).clamp(0, self.Lk)
            self.used = n.view(self.B, 1, 1, 1, 1)
        # Key intervals: (2, Bx, Hx, Lk) bounds as two (Bx, Hkv|1, g|1, 1, Lk) views, compared
        # against one chunk of query positions at a time (never an (Lq, Lk) tensor).
        self.starts5 = self.ends5 = None
        if key_intervals is not None:
            self.starts5 = _group_aux(key_intervals[0].unsqueeze(2), self.H, self.Hkv)
            self.ends5 = _group_aux(key_intervals[1].unsqueeze(2), self.H, self.Hkv)
        self.dropout_p = dropout_p
        self.dropout_rng = dropout_rng if dropout_p > 0.0 else None

    def keep(self, i0: int, i1: int, device) -> Optional[Tensor]:
        """Bool ``(B, Hkv, g, rows, Lk)``: the dropout keep-mask of query rows i0..i1 (None
        without dropout). Query head ``kv * g + member`` as in :func:`_group_heads`."""
        if self.dropout_rng is None:
            return None
        ar = lambda *a: torch.arange(*a, device=device, dtype=torch.int64)  # noqa: E731
        b = ar(self.B).view(-1, 1, 1, 1, 1)
        h = ar(self.Hkv).view(1, -1, 1, 1, 1) * self.g + ar(self.g).view(1, 1, -1, 1, 1)
        i = ar(i0, i1).view(1, 1, 1, -1, 1)
        j = ar(self.Lk).view(1, 1, 1, 1, -1)
        return keep_mask(self.dropout_rng.to(device), self.dropout_p, b, self.H, h, i, j)

    def dropped(self, x: Tensor, keep: Optional[Tensor]) -> Tensor:
        """``x`` with dropped entries 0 and kept ones scaled by ``1 / (1 - p)``."""
        if keep is None:
            return x
        return torch.where(keep, x * keep_scale(self.dropout_p), torch.zeros_like(x))

    def chunks(self):
        for i0 in range(0, self.Lq, self.rows):
            yield i0, min(self.Lq, i0 + self.rows)

    @staticmethod
    def _rows_of(t5: Optional[Tensor], i0: int, i1: int) -> Optional[Tensor]:
        if t5 is None or t5.shape[3] == 1:
            return t5
        return t5[:, :, :, i0:i1]

    def scores(self, qc: Tensor, k4: Tensor, i0: int, i1: int) -> Tuple[Tensor, Optional[Tensor]]:
        """Masked scores ``(B, Hkv, g, rows, Lk)`` and ``tanh`` of the softcap (or None)."""
        B, Hkv, g, c = self.B, self.Hkv, self.g, i1 - i0
        # Fold the group into the rows so one matmul per kv head serves all its query heads.
        raw = torch.matmul(qc.reshape(B, Hkv, g * c, self.D), k4.transpose(-1, -2))
        raw = raw.view(B, Hkv, g, c, self.Lk) * self.scale
        tanh = None
        if self.softcap > 0.0:
            tanh = torch.tanh(raw / self.softcap)
            s = self.softcap * tanh
        else:
            s = raw
        bias_c = self._rows_of(self.bias5, i0, i1)
        if bias_c is not None:
            s = s + bias_c.to(self.acc)
        visible = self._rows_of(self.mask5, i0, i1)
        cols = torch.arange(self.Lk, device=qc.device).unsqueeze(0)
        if self.used is not None:
            # Per batch: keys past the used cache length are invisible, and the causal
            # diagonal is aligned with the used length. (B,1,1,1,Lk), or (B,1,1,rows,Lk) when
            # causal: never per head, and at most one chunk of rows.
            if self.is_causal:
                rows = torch.arange(i0, i1, device=qc.device).unsqueeze(1)
                # j <= i + n - Lq also implies j < n, since i < Lq.
                extra = cols <= rows + (self.used - self.Lq)
            else:
                extra = cols < self.used
            visible = extra if visible is None else visible & extra
        elif self.is_causal:
            rows = torch.arange(i0, i1, device=qc.device).unsqueeze(1)
            causal = cols <= rows + (self.Lk - self.Lq)
            visible = causal if visible is None else visible & causal
        if self.starts5 is not None:
            inside = self.interval_visible(i0, i1, qc.device)
            visible = inside if visible is None else visible & inside
        if visible is not None:
            s = s.masked_fill(~visible, _NEG_INF)
        return s, tanh

    def interval_visible(self, i0: int, i1: int, device) -> Tensor:
        """Bool ``(Bx|B, Hkv|1, g|1, rows, Lk)``: key intervals seen from query rows i0..i1.

        A query's position is its causal diagonal: ``i + Lk - Lq``, or ``i + n - Lq`` with a
        used KV-cache length ``n`` (the queries are the last ones of the used cache).
        """
        rows = torch.arange(i0, i1, device=device, dtype=torch.int64).view(-1, 1)
        if self.used is not None:
            pos = rows + (self.used - self.Lq)  # (B, 1, 1, rows, 1)
        else:
            pos = rows + (self.Lk - self.Lq)  # (rows, 1)
        return (self.starts5 <= pos) & (pos < self.ends5)

    @staticmethod
    def grouped_matmul(a5: Tensor, b4: Tensor) -> Tensor:
        """``a @ b`` for a ``(B, Hkv, g, c, X)`` and b ``(B, Hkv, X, Y)`` -> ``(B, Hkv, g, c, Y)``."""
        B, Hkv, g, c, x = a5.shape
        return torch.matmul(a5.reshape(B, Hkv, g * c, x), b4).view(B, Hkv, g, c, -1)

    @staticmethod
    def grouped_matmul_t(a5: Tensor, b5: Tensor) -> Tensor:
        """``sum_g a^T @ b`` for a ``(B,Hkv,g,c,X)``, b ``(B,Hkv,g,c,Y)`` -> ``(B,Hkv,X,Y)``."""
        B, Hkv, g, c, x = a5.shape
        return torch.matmul(
            a5.reshape(B, Hkv, g * c, x).transpose(-1, -2), b5.reshape(B, Hkv, g * c, -1)
        )


def _softmax_parts(s: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Unnormalised probabilities, their row sums, and the row lse (-inf for empty rows)."""
    m = s.amax(dim=-1, keepdim=True)
    m_safe = torch.where(m == _NEG_INF, torch.zeros_like(m), m)
    p = torch.exp(s - m_safe)
    denom = p.sum(dim=-1, keepdim=True)
    lse = torch.where(denom > 0, m_safe + torch.log(denom), torch.full_like(denom, _NEG_INF))
    return p, denom, lse


def _forward(q, k, v, mask, bias, scale, is_causal, softcap, cache_seqlens=None,
             key_intervals=None, dropout_p=0.0, dropout_rng=None, key_window=0):
    # key_window (a key-interval mask's window promise) only sizes the kernels' work lists;
    # the reference evaluates the intervals themselves.
    geo = _Geometry(q, k, mask, bias, scale, is_causal, softcap, cache_seqlens, key_intervals,
                    dropout_p, dropout_rng)
    B, Lq, H, D = q.shape
    out = torch.zeros(B, Lq, H, v.shape[-1], dtype=q.dtype, device=q.device)
    # Kept in the accumulation dtype so a float64 backward is exact; callers get float32.
    lse = torch.full((B, H, Lq), _NEG_INF, dtype=geo.acc, device=q.device)
    if geo.Lk == 0 or Lq == 0:
        return out, lse
    q5 = _group_heads(q, geo.Hkv)
    k4 = k.transpose(1, 2).to(geo.acc)
    v4 = v.transpose(1, 2).to(geo.acc)
    for i0, i1 in geo.chunks():
        s, _ = geo.scores(q5[:, :, :, i0:i1].to(geo.acc), k4, i0, i1)
        p, denom, lse_c = _softmax_parts(s)
        p = geo.dropped(p, geo.keep(i0, i1, q.device))
        o = geo.grouped_matmul(p, v4) / torch.where(denom > 0, denom, torch.ones_like(denom))
        out[:, i0:i1] = o.flatten(1, 2).transpose(1, 2).to(q.dtype)
        lse[:, :, i0:i1] = lse_c.squeeze(-1).flatten(1, 2)
    return out, lse


def _reduce_like(x: Tensor, target_shape) -> Tensor:
    """Sum ``x`` over every dim where ``target_shape`` has size 1 (keepdim)."""
    dims = [d for d, (n, t) in enumerate(zip(x.shape, target_shape)) if t == 1 and n != 1]
    return x.sum(dim=dims, keepdim=True) if dims else x


def _backward(ctx_flags, dout, q, k, v, mask, bias, out, lse, scale, is_causal, softcap,
              cache_seqlens=None, key_intervals=None, dropout_p=0.0, dropout_rng=None):
    need_dq, need_dk, need_dv, need_dbias = ctx_flags
    geo = _Geometry(q, k, mask, bias, scale, is_causal, softcap, cache_seqlens, key_intervals,
                    dropout_p, dropout_rng)
    acc = geo.acc
    B, Lq, H, D = q.shape
    dq = torch.zeros(B, Lq, H, D, dtype=acc, device=q.device) if need_dq else None
    dk4 = torch.zeros(B, geo.Hkv, geo.Lk, D, dtype=acc, device=q.device) if need_dk else None
    dv4 = torch.zeros(B, geo.Hkv, geo.Lk, D, dtype=acc, device=q.device) if need_dv else None
    dbias = torch.zeros(bias.shape, dtype=acc, device=q.device) if need_dbias else None
    if geo.Lk > 0 and Lq > 0:
        dbias5 = _group_aux(dbias, H, geo.Hkv)
        q5, do5, o5 = (_group_heads(t, geo.Hkv) for t in (q, dout, out))
        k4 = k.transpose(1, 2).to(acc)
        v4 = v.transpose(1, 2).to(acc)
        lse5 = lse.view(B, geo.Hkv, geo.g, Lq, 1)
        for i0, i1 in geo.chunks():
            qc = q5[:, :, :, i0:i1].to(acc)
            s, tanh = geo.scores(qc, k4, i0, i1)
            lse_c = lse5[:, :, :, i0:i1].to(acc)
            # Empty rows have lse = -inf and scores = -inf: subtracting 0 keeps p = 0, not NaN.
            p = torch.exp(s - torch.where(lse_c == _NEG_INF, torch.zeros_like(lse_c), lse_c))
            doc = do5[:, :, :, i0:i1].to(acc)
            keep = geo.keep(i0, i1, q.device)
            if need_dv:
                dv4 += geo.grouped_matmul_t(geo.dropped(p, keep), doc)
            if not (need_dq or need_dk or need_dbias):
                continue
            # With dropout, rowsum(dP * P) over the kept, scaled entries is still rowsum(dO * O).
            delta = (doc * o5[:, :, :, i0:i1].to(acc)).sum(dim=-1, keepdim=True)
            dp = geo.dropped(geo.grouped_matmul(doc, v4.transpose(-1, -2)), keep)
            ds = p * (dp - delta)
            if need_dbias:
                part = _reduce_like(ds, dbias5.shape)
                if dbias5.shape[3] == 1:
                    dbias5 += part
                else:
                    dbias5[:, :, :, i0:i1] = part
            if tanh is not None:
                ds = ds * (1.0 - tanh * tanh)
            if need_dq:
                dq5 = geo.grouped_matmul(ds, k4) * scale
                dq[:, i0:i1] = dq5.flatten(1, 2).transpose(1, 2)
            if need_dk:
                dk4 += geo.grouped_matmul_t(ds, qc) * scale
    return (
        dq if need_dq else None,
        dk4.transpose(1, 2) if need_dk else None,
        dv4.transpose(1, 2) if need_dv else None,
        dbias if need_dbias else None,
    )


def _backward_op(dout, q, k, v, mask, bias, out, lse, scale, is_causal, softcap, _det, needs,
                 cache_seqlens=None, key_intervals=None, dropout_p=0.0, dropout_rng=None,
                 key_window=0):
    # The reference is deterministic whatever was asked.
    return _backward(
        needs, dout, q, k, v, mask, bias, out, lse, scale, is_causal, softcap, cache_seqlens,
        key_intervals, dropout_p, dropout_rng,
    )


# Opaque to torch.compile (see flash_dmattn.ops); lse stays in the accumulation dtype between
# forward and backward so a float64 backward is exact.
_REFERENCE_OP = AttentionOp("reference", _forward, _backward_op, lse_dtype=_accumulation_dtype)


def reference_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    attn_bias: Optional[Tensor] = None,
    softmax_scale: float = 1.0,
    is_causal: bool = False,
    softcap: float = 0.0,
    cache_seqlens: Optional[Tensor] = None,
    key_intervals: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    dropout_rng: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Attention with mask, bias, GQA, causal and softcap; returns ``(out, lse)``.

    Arguments are already validated (see :class:`flash_dmattn.inputs.AttentionInputs`): q
    ``(B, Lq, H, D)``, k/v ``(B, Lk, Hkv, D)``, mask/bias 4-D ``(1|B, 1|Hkv|H, 1|Lq, 1|Lk)``.
    Equivalent plain PyTorch (materialising everything, which this function does not)::

        k, v = (einops.repeat(t, "b j hkv d -> b j (hkv g) d", g=H // Hkv) for t in (k, v))
        s = scale * einsum("bihd,bjhd->bhij", q, k)
        if softcap: s = softcap * tanh(s / softcap)
        s = s + bias                          # broadcast
        visible = mask & (j <= i + Lk - Lq)   # causal part only if is_causal
        s = s.masked_fill(~visible, -inf)
        lse = s.logsumexp(-1)
        p = (s - lse).exp().nan_to_num(0)     # empty rows -> 0
        out = einsum("bhij,bjhd->bihd", p, v)

    ``cache_seqlens`` (int32 ``(B,)``, KV-cache decoding) adds, with ``n = cache_seqlens[b]``,
    ``visible &= j < n`` and aligns the causal diagonal with it: ``j <= i + n - Lq``.

    ``key_intervals`` (int32 ``(2, Bx, Hx, Lk)``, the bounds of a
    :class:`~flash_dmattn.masks.KeyIntervals`) adds ``visible &= start[j] <= p < end[j]`` with
    the query position ``p = i + Lk - Lq`` (``i + n - Lq`` with ``cache_seqlens``: the causal
    diagonal), evaluated one chunk of query rows at a time.

    ``dropout_p`` > 0 with ``dropout_rng`` (see :mod:`flash_dmattn.dropout`) multiplies ``p``
    by the call's keep-mask and ``1 / (1 - dropout_p)`` before the product with ``v``.
    """
    return _REFERENCE_OP(
        query, key, value, attn_mask, attn_bias, softmax_scale, is_causal, softcap,
        cache_seqlens=cache_seqlens, key_intervals=key_intervals, dropout_p=dropout_p,
        dropout_rng=dropout_rng,
    )


def gather_kv_pages(pool: Tensor, block_table: Tensor) -> Tensor:
    """Contiguous ``(B, P * page_size, Hkv, D)`` keys (or values) from a paged-KV pool.

    ``pool (num_pages, page_size, Hkv, D)``, ``block_table`` int ``(B, P)`` of physical page ids.
    Differentiable: the gradient w.r.t. ``pool`` is scatter-added back through the page ids
    (``index_select``'s backward), so a page listed twice receives both contributions. Memory is
    O(B * Lk * Hkv * D), acceptable for the oracle. Equivalent plain PyTorch::

        pool[block_table.long()].reshape(B, P * page_size, Hkv, D)
    """
    batch, pages = block_table.shape
    flat = pool.index_select(0, block_table.reshape(-1).to(torch.int64))
    return flat.view(batch, pages * pool.shape[1], *pool.shape[2:])


def reference_probs(
    query, key, attn_mask, attn_bias, softmax_scale, is_causal, softcap, cache_seqlens=None,
    key_intervals=None,
) -> Tensor:
    """The normalised attention probabilities ``(B, H, Lq, Lk)`` (a testing aid; no gradient)."""
    with torch.no_grad():
        geo = _Geometry(
            query, key, attn_mask, attn_bias, softmax_scale, is_causal, softcap, cache_seqlens,
            key_intervals,
        )
        B, Lq, H, _ = query.shape
        probs = torch.zeros(B, H, Lq, geo.Lk, dtype=geo.acc, device=query.device)
        if geo.Lk == 0 or Lq == 0:
            return probs
        q5 = _group_heads(query, geo.Hkv)
        k4 = key.transpose(1, 2).to(geo.acc)
        for i0, i1 in geo.chunks():
            s, _ = geo.scores(q5[:, :, :, i0:i1].to(geo.acc), k4, i0, i1)
            p, denom, _ = _softmax_parts(s)
            p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
            probs[:, :, i0:i1] = p.flatten(1, 2)
        return probs
