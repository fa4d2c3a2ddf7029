"""Build boolean attention masks (True = attend) from attention biases.

Dynamic Mask Attention keeps, for every query, only the keys with the largest bias
(``type="topk"``) or only the keys with a positive bias (``type="relu"``). The helpers
here turn a float bias into that bool mask without materialising anything larger than
the inputs' broadcast shape, so a per-key bias stays per-key.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["create_mask", "causal_topk_mask", "topk_intervals"]

# Upper bound on the number of elements of any float/int temporary built per chunk of
# query rows. Module level so tests can shrink it to exercise the chunked path.
_CHUNK_ELEMENTS = 1 << 24

_MASK_TYPES = ("topk", "relu")


def _check_int(name: str, value, minimum: int) -> int:
    # bool is a subclass of int; accepting True as "1" would hide caller bugs.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_dims(name: str, shape: torch.Size, batch_size: int, query_len: int, key_len: int) -> None:
    expected = (batch_size, None, query_len, key_len)
    labels = ("batch", "heads", "query", "key")
    for dim, (size, want, label) in enumerate(zip(shape, expected, labels)):
        if want is not None and size not in (1, want):
            raise ValueError(
                f"{name} has shape {tuple(shape)}; its {label} dim ({dim}) must be 1 or {want} "
                f"to broadcast to (batch={batch_size}, heads, query={query_len}, key={key_len})"
            )


def _normalize_mask(
    attention_mask: Optional[torch.Tensor],
    batch_size: int,
    query_len: int,
    key_len: int,
    device: torch.device,
) -> Optional[torch.Tensor]:
    """Return the candidate mask as a 4-D bool tensor (or None)."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor or None, got {type(attention_mask).__name__}")
    if attention_mask.dtype != torch.bool:
        raise TypeError(
            f"attention_mask must be a bool tensor (True = attend), got dtype {attention_mask.dtype}; "
            "convert it with `.bool()` (or `mask == 0` for an additive float mask)"
        )
    if attention_mask.device != device:
        raise ValueError(
            f"attention_mask is on {attention_mask.device} but attention_bias is on {device}"
        )
    if attention_mask.dim() == 2:
        mask_batch, length = attention_mask.shape
        if mask_batch not in (1, batch_size):
            raise ValueError(
                f"2-D attention_mask has shape {tuple(attention_mask.shape)}; expected (batch_size={batch_size}, L)"
            )
        if length == key_len:
            return attention_mask.view(mask_batch, 1, 1, key_len)
        if length == query_len and query_len < key_len:
            # The leading key_len - query_len keys are cached keys from earlier steps;
            # padding was already applied to them when they were queries.
            cache = attention_mask.new_ones(mask_batch, key_len - query_len)
            return torch.cat([cache, attention_mask], dim=-1).view(mask_batch, 1, 1, key_len)
        raise ValueError(
            f"2-D attention_mask has length {length}; expected key_len={key_len} "
            f"or query_len={query_len} (< key_len)"
        )
    if attention_mask.dim() == 4:
        _check_dims("attention_mask", attention_mask.shape, batch_size, query_len, key_len)
        return attention_mask
    raise ValueError(
        f"attention_mask must be 2-D (batch, L) or 4-D (batch, heads, query, key), "
        f"got shape {tuple(attention_mask.shape)}"
    )


def _select_rows(
    bias: torch.Tensor,
    mask: Optional[torch.Tensor],
    window_size: int,
    min_dtype: float,
    mask_type: str,
) -> torch.Tensor:
    """Apply the selection rule to every row (last dim) of ``bias`` / ``mask``."""
    # Comparing with `>` (not `!=`) also rejects -inf and NaN in one op.
    valid = bias > min_dtype
    if mask is not None:
        valid = valid & mask
    if mask_type == "relu":
        return valid & (bias > 0)
    key_len = valid.shape[-1]
    if key_len <= window_size:
        return valid
    score = torch.where(valid, bias, torch.tensor(float("-inf"), dtype=bias.dtype, device=bias.device))
    # The k-th largest value is well defined even with ties; topk's index order for ties
    # is not, so indices are chosen explicitly below.
    kth = score.topk(window_size, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    greater = score > kth
    # When a row has fewer than window_size valid keys kth is -inf, every valid key is
    # strictly greater, and the invalid ones are excluded from `ties` by `& valid`.
    ties = (score == kth) & valid
    room = window_size - greater.sum(dim=-1, keepdim=True, dtype=torch.int32)
    keep_ties = ties & (ties.cumsum(dim=-1, dtype=torch.int32) <= room)
    return greater | keep_ties


def _block_smooth(keep: torch.Tensor, block_size: int) -> torch.Tensor:
    key_len = keep.shape[-1]
    num_blocks = -(-key_len // block_size)
    padded = F.pad(keep, (0, num_blocks * block_size - key_len))
    counts = padded.reshape(*keep.shape[:-1], num_blocks, block_size).sum(dim=-1, dtype=torch.int32)
    # Each block is judged against its own length so a short last block is not biased
    # towards being dropped by the phantom padding.
    lengths = torch.full((num_blocks,), block_size, dtype=torch.int32, device=keep.device)
    lengths[-1] = key_len - (num_blocks - 1) * block_size
    block_keep = 2 * counts > lengths
    expanded = block_keep.unsqueeze(-1).expand(*block_keep.shape, block_size)
    return expanded.reshape(*keep.shape[:-1], num_blocks * block_size)[..., :key_len]


def create_mask(
    attention_bias: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    batch_size: Optional[int] = None,
    query_len: Optional[int] = None,
    key_len: Optional[int] = None,
    window_size: Optional[int] = None,
    min_dtype: Optional[float] = None,
    block_size: Optional[int] = None,
    type: str = "topk",
) -> torch.Tensor:
    """Turn an additive attention bias into a bool attention mask (True = attend).

    The common case needs only the bias and the window::

        mask = create_mask(bias, window_size=256)                  # top-256 keys per query
        mask = create_mask(bias, padding_mask, window_size=256)    # among unpadded keys

    The 1.2.x positional form ``create_mask(bias, mask, B, Lq, Lk, window_size, min_dtype)``
    gives the same result.

    Args:
        attention_bias: float tensor, 4-D, broadcastable to ``(B, H or Hkv, Lq, Lk)``;
            typically ``(B, Hkv, 1, Lk)`` (per key) or ``(B, Hkv, Lq, Lk)``. It is
            detached: no gradient flows through the mask.
        attention_mask: ``None``; a bool ``(B, L)`` padding mask (``L == key_len``, or
            ``L == query_len < key_len`` in which case the leading ``key_len - query_len``
            cache keys are treated as allowed); or a bool 4-D mask broadcastable with the
            bias. Only keys it allows are candidates.
        batch_size, query_len, key_len: the logical ``B``, ``Lq``, ``Lk``. Each defaults to
            what the bias and the mask imply: the larger of their batch dims; the bias's or
            the 4-D mask's query dim (else a padding mask's length when it is shorter than
            the keys, a KV-cache step; else 1); the bias's key dim (else the mask's).
        window_size: with ``type="topk"`` (required there), the number of keys kept per
            query when ``key_len > window_size``. Unused by ``type="relu"``.
        min_dtype: bias value meaning "masked"; default ``torch.finfo(bias.dtype).min``.
            Entries whose bias is ``<= min_dtype``, ``-inf`` or NaN are never kept.
        block_size: if ``> 1``, smooth the result along keys: each run of ``block_size``
            keys (the last one may be shorter) is kept whole when more than half of its
            own length was kept, and dropped whole otherwise. Smoothing never turns on a
            key that ``attention_mask`` disallows or whose bias is ``min_dtype``.
        type: ``"topk"`` (the ``window_size`` largest biases per row; ties go to the lower
            key index) or ``"relu"`` (entries with bias ``> 0``).

    Returns:
        A bool tensor whose shape is the broadcast shape of ``attention_bias`` and the
        4-D form of ``attention_mask`` (with the key dim equal to ``key_len``). A per-key
        bias with no mask or a padding mask gives a per-key ``(..., 1, Lk)`` result.

    Equivalent plain PyTorch (ignoring chunking, with ``mask`` the 4-D bool form of
    ``attention_mask`` or ``True``)::

        valid = (attention_bias > min_dtype) & mask
        if type == "relu":
            keep = valid & (attention_bias > 0)
        elif key_len > window_size:
            score = attention_bias.masked_fill(~valid, float("-inf"))
            # stable descending sort: equal scores keep ascending key order
            order = score.sort(dim=-1, descending=True, stable=True).indices
            top = torch.zeros_like(valid).scatter(-1, order[..., :window_size], True)
            keep = top & valid
        else:
            keep = valid
        if block_size is not None and block_size > 1:
            for start in range(0, key_len, block_size):
                blk = keep[..., start:start + block_size]
                blk[...] = (2 * blk.sum(-1, keepdim=True) > blk.shape[-1])
            keep &= valid
    """
    if not isinstance(type, str) or type not in _MASK_TYPES:
        raise ValueError(f"type must be one of {_MASK_TYPES}, got {type!r}")
    if window_size is None and type == "topk":
        raise TypeError(
            "create_mask with type='topk' needs window_size, the number of keys each query "
            "keeps: e.g. create_mask(bias, window_size=256)"
        )
    if window_size is not None:
        _check_int("window_size", window_size, 1)
    if block_size is not None:
        _check_int("block_size", block_size, 1)
    if not isinstance(attention_bias, torch.Tensor):
        raise TypeError(f"attention_bias must be a torch.Tensor, got {_type_name(attention_bias)}")
    if not attention_bias.is_floating_point():
        raise TypeError(f"attention_bias must be a floating-point tensor, got dtype {attention_bias.dtype}")
    if attention_bias.dim() != 4:
        raise ValueError(
            f"attention_bias must be 4-D (batch, heads, query, key), got shape {tuple(attention_bias.shape)}"
        )
    batch_size, query_len, key_len = _infer_lengths(
        attention_bias, attention_mask, batch_size, query_len, key_len
    )
    _check_int("batch_size", batch_size, 0)
    _check_int("query_len", query_len, 0)
    _check_int("key_len", key_len, 0)
    _check_dims("attention_bias", attention_bias.shape, batch_size, query_len, key_len)
    min_dtype = resolve_min_dtype(min_dtype, attention_bias.dtype)

    bias = attention_bias.detach()
    mask = _normalize_mask(attention_mask, batch_size, query_len, key_len, bias.device)
    # A size-1 key dim is a (degenerate) broadcast; selection needs one entry per key.
    bias = bias.expand(*bias.shape[:-1], key_len)
    if mask is not None:
        mask = mask.expand(*mask.shape[:-1], key_len)
        try:
            lead = torch.broadcast_shapes(bias.shape[:-1], mask.shape[:-1])
        except RuntimeError as exc:
            raise ValueError(
                f"attention_bias shape {tuple(attention_bias.shape)} and attention_mask shape "
                f"{tuple(mask.shape)} do not broadcast together"
            ) from exc
    else:
        lead = bias.shape[:-1]
    out_shape = torch.Size((*lead, key_len))
    smooth = block_size is not None and block_size > 1

    def rows(lo: int, hi: int) -> torch.Tensor:
        b = bias if bias.shape[2] == 1 else bias[:, :, lo:hi]
        m = None if mask is None else (mask if mask.shape[2] == 1 else mask[:, :, lo:hi])
        keep = _select_rows(b, m, window_size, min_dtype, type)
        if not smooth:
            return keep
        # Smoothing fills blocks, but never turns on a key that was never a candidate
        # (padding, min_dtype): attending to those would change the model, not the sparsity.
        allowed = b > min_dtype if m is None else (b > min_dtype) & m
        return _block_smooth(keep, block_size) & allowed

    num_rows = out_shape[2]
    per_row = out_shape[0] * out_shape[1] * key_len
    chunk = max(1, _CHUNK_ELEMENTS // max(per_row, 1))
    if num_rows <= chunk:
        result = rows(0, num_rows)
        # _select_rows broadcasts to exactly out_shape; the expand only fixes up
        # zero-size corner cases and is a no-op view otherwise.
        return result.expand(out_shape).contiguous()
    result = torch.empty(out_shape, dtype=torch.bool, device=bias.device)
    for lo in range(0, num_rows, chunk):
        hi = min(lo + chunk, num_rows)
        result[:, :, lo:hi] = rows(lo, hi)
    return result


def causal_topk_mask(
    attention_bias: torch.Tensor,
    padding_mask: Optional[torch.Tensor],
    window_size: int,
    min_dtype: float,
) -> torch.Tensor:
    """The causal top-``window_size`` mask of a per-key bias, without a per-row top-k.

    Same result as ``create_mask(bias, causal & padding, B, L, L, window_size, min_dtype)``
    for ``attention_bias`` of shape ``(B, H, 1, L)`` (one value per key, e.g. the DMA bias) and
    ``padding_mask`` None or bool ``(B, L)``: query ``i`` keeps the ``window_size`` keys
    ``j <= i`` with the largest bias (ties to the lower index; padding and ``min_dtype``
    entries never). Returns bool ``(B, H, L, L)``.

    With a per-key bias every query ranks the keys the same way, so query ``i`` keeps key
    ``j`` iff ``j <= i`` and ``j``'s global rank is among the ``window_size`` best ranks of the
    prefix ``0..i``. One sort per (batch, head) gives the ranks, and a running
    ``window_size``-th smallest rank per prefix gives each row's threshold: the work is
    ``O(L * window_size)`` per (batch, head) plus the final comparison, instead of a top-k
    over every ``(L, L)`` row. Equivalent plain PyTorch::

        i = torch.arange(L)
        causal = i[None, :] <= i[:, None]
        return create_mask(bias, causal[None, None] & padding[:, None, None, :], B, L, L,
                           window_size, min_dtype)
    """
    _check_int("window_size", window_size, 1)
    if not isinstance(attention_bias, torch.Tensor) or not attention_bias.is_floating_point():
        raise TypeError("attention_bias must be a floating-point tensor")
    if attention_bias.dim() != 4 or attention_bias.shape[2] != 1:
        hint = ""
        if attention_bias.dim() == 4:
            hint = (
                "; a per-query bias ranks the keys differently for each query: write "
                "create_mask(bias, causal_mask, window_size=...) for its top-k mask"
            )
        raise ValueError(
            f"attention_bias must be per key, (batch, heads, 1, L); got "
            f"{tuple(attention_bias.shape)}{hint}"
        )
    bias = attention_bias.detach()[:, :, 0]  # (B, H, L)
    batch, heads, length = bias.shape
    device = bias.device
    valid = bias > min_dtype  # also rejects -inf and NaN
    if padding_mask is not None:
        if padding_mask.dtype != torch.bool or tuple(padding_mask.shape) != (batch, length):
            raise ValueError(
                f"padding_mask must be bool (batch, L) = {(batch, length)}, got "
                f"{padding_mask.dtype} {tuple(padding_mask.shape)}"
            )
        valid = valid & padding_mask[:, None, :]
    ar = torch.arange(length, device=device)
    causal = ar[None, :] <= ar[:, None]
    if length <= window_size:
        return causal[None, None] & valid[:, :, None, :]

    score = torch.where(valid, bias, torch.tensor(float("-inf"), dtype=bias.dtype, device=device))
    # Stable descending sort: equal biases keep ascending key order (ties to the lower index).
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    rank = torch.empty((batch, heads, length), dtype=torch.int32, device=device)
    rank.scatter_(-1, order, ar.to(torch.int32).expand(batch, heads, length).contiguous())
    none = torch.tensor(length, dtype=torch.int32, device=device)  # worse than every valid rank
    rank = torch.where(valid, rank, none)

    # threshold[i]: the window_size-th smallest rank among keys 0..i (`none` if fewer are valid).
    w = window_size
    rows = max(1, min(256, _CHUNK_ELEMENTS // max(batch * heads * (w + 256), 1)))
    best = none.expand(batch, heads, w)  # the w smallest ranks of the prefix so far
    threshold = torch.empty((batch, heads, length), dtype=torch.int32, device=device)
    tri = ar[:rows, None] >= ar[None, :rows]  # row r of a chunk sees its keys 0..r
    for lo in range(0, length, rows):
        new = rank[:, :, lo:lo + rows]
        n = new.shape[-1]
        fresh = torch.where(tri[:n, :n], new[:, :, None, :], none)  # (B, H, n, n)
        cand = torch.cat([best[:, :, None, :].expand(batch, heads, n, w), fresh], dim=-1)
        threshold[:, :, lo:lo + n] = cand.kthvalue(w, dim=-1).values
        best = torch.cat([best, new], dim=-1).topk(w, dim=-1, largest=False).values

    keep = rank[:, :, None, :] <= threshold[:, :, :, None]
    keep &= causal
    keep &= valid[:, :, None, :]
    return keep


def _infer_lengths(bias: torch.Tensor, mask, batch_size, query_len, key_len):
    """``(batch_size, query_len, key_len)`` with each ``None`` replaced by what the bias and
    the mask imply (see :func:`create_mask`); given values are returned as they are."""
    mask_shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else None
    padding = mask_shape is not None and len(mask_shape) == 2
    four_d = mask_shape is not None and len(mask_shape) == 4
    if batch_size is None:
        batch_size = max(bias.shape[0], mask_shape[0] if mask_shape else 1)
    if key_len is None:
        if bias.shape[3] > 1 or mask_shape is None or len(mask_shape) not in (2, 4):
            key_len = bias.shape[3]
        else:
            key_len = mask_shape[-1]
    if query_len is None:
        if bias.shape[2] > 1:
            query_len = bias.shape[2]
        elif four_d and mask_shape[2] > 1:
            query_len = mask_shape[2]
        elif padding and mask_shape[1] < key_len:
            query_len = mask_shape[1]  # a KV-cache step: the padding of the new queries
        else:
            query_len = 1
    return batch_size, query_len, key_len


def _type_name(obj) -> str:
    # `type` is shadowed by create_mask's parameter, so error messages go through here.
    return obj.__class__.__name__


# The interval form of the top-W selections above (O(L) memory) lives with the planners, as
# does the min_dtype rule both share.
from ..planning.selection import resolve_min_dtype, topk_intervals  # noqa: E402
