"""Dynamic Mask Attention (DMA) helpers: the value-dependent "ZOH" bias and a
ready-made attention call that combines it with top-k key selection.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..planning.selection import topk_intervals
from .mask import _CHUNK_ELEMENTS, create_mask

__all__ = ["dynamic_mask_bias", "apply_dynamic_mask_attention"]


def _require_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {value.__class__.__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")
    return value


def dynamic_mask_bias(
    value: torch.Tensor,
    dt_proj: Union[torch.Tensor, nn.Linear],
    A: torch.Tensor,
    heads_first: bool = False,
) -> torch.Tensor:
    """Compute the DMA zero-order-hold bias ``exp(A * softplus(value @ dt_proj.T))``.

    Args:
        value: ``(B, Lk, Hkv, D)``, or ``(B, Hkv, Lk, D)`` when ``heads_first``.
        dt_proj: weight of shape ``(Hkv, Hkv * D)`` (as ``nn.Linear(Hkv * D, Hkv).weight``)
            or the ``nn.Linear`` itself; a module's own bias, if it has one, is added
            (i.e. the result equals calling the module).
        A: ``(Hkv,)`` per-head coefficient.
        heads_first: layout of ``value``.

    Returns:
        ``(B, Hkv, 1, Lk)`` in ``value``'s dtype: one bias per key, shared by all queries.
        Differentiable w.r.t. ``value``, ``dt_proj`` and ``A``. The exp/softplus run in
        float32 (or float64 if any input is float64).

    Equivalent plain PyTorch (``heads_first=False``, ``dt_proj`` a weight tensor)::

        B, Lk, Hkv, D = value.shape
        dt = value.reshape(B, Lk, Hkv * D) @ dt_proj.T                 # (B, Lk, Hkv)
        bias = torch.exp(A.float() * F.softplus(dt.float()))
        bias = bias.transpose(1, 2).unsqueeze(2).to(value.dtype)       # (B, Hkv, 1, Lk)
    """
    if not isinstance(heads_first, bool):
        raise TypeError(f"heads_first must be a bool, got {heads_first.__class__.__name__}")
    _require_tensor("value", value)
    if value.dim() != 4:
        layout = "(B, Hkv, Lk, D)" if heads_first else "(B, Lk, Hkv, D)"
        raise ValueError(f"value must be 4-D {layout}, got shape {tuple(value.shape)}")
    if heads_first:
        value = value.transpose(1, 2)
    batch, key_len, kv_heads, head_dim = value.shape

    if isinstance(dt_proj, nn.Linear):
        weight, lin_bias = dt_proj.weight, dt_proj.bias
    elif isinstance(dt_proj, torch.Tensor):
        weight, lin_bias = dt_proj, None
    else:
        raise TypeError(f"dt_proj must be a torch.Tensor or nn.Linear, got {dt_proj.__class__.__name__}")
    _require_tensor("dt_proj", weight)
    if tuple(weight.shape) != (kv_heads, kv_heads * head_dim):
        raise ValueError(
            f"dt_proj weight has shape {tuple(weight.shape)}; for value of shape (B, Lk, Hkv, D) = "
            f"{(batch, key_len, kv_heads, head_dim)} it must be (Hkv, Hkv*D) = {(kv_heads, kv_heads * head_dim)}"
        )
    _require_tensor("A", A)
    if tuple(A.shape) != (kv_heads,):
        raise ValueError(f"A has shape {tuple(A.shape)}; it must be (Hkv,) = ({kv_heads},)")

    # Mixed dtypes (e.g. a bf16 value with an fp32 projection) would make F.linear fail;
    # run the projection at the wider of the two precisions instead.
    mm_dtype = torch.promote_types(value.dtype, weight.dtype)
    flat = value.reshape(batch, key_len, kv_heads * head_dim).to(mm_dtype)
    dt = F.linear(flat, weight.to(mm_dtype), None if lin_bias is None else lin_bias.to(mm_dtype))
    # softplus/exp overflow quickly in half precision, hence float32 at least.
    ew_dtype = torch.promote_types(torch.promote_types(dt.dtype, A.dtype), torch.float32)
    bias = torch.exp(A.to(ew_dtype) * F.softplus(dt.to(ew_dtype)))
    return bias.transpose(1, 2).unsqueeze(2).to(value.dtype).contiguous()


def _allowed_from_mask(causal_mask: torch.Tensor) -> torch.Tensor:
    if causal_mask.dtype == torch.bool:
        return causal_mask
    if causal_mask.is_floating_point():
        # Additive masks only ever hold 0 (keep) or a "minus infinity" stand-in; anything
        # non-zero is treated as masked, as in the original DMA code (`mask != 0`).
        return causal_mask == 0
    raise TypeError(
        f"causal_mask must be a bool (True = attend) or additive float tensor, got dtype {causal_mask.dtype}"
    )


def _dynamic_mask_and_bias(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dt_proj: Union[torch.Tensor, nn.Linear],
    A: torch.Tensor,
    causal_mask: Optional[torch.Tensor],
    keep_window_size: int,
    is_causal: bool,
):
    """Validate inputs and return ``(mask or None, bias)`` for the attention call.

    The mask is a :class:`~flash_dmattn.masks.KeyIntervals` when the selection allows it (a per-key candidate
    mask or none, and ``Lq <= Lk``), else a dense bool mask; see
    :func:`apply_dynamic_mask_attention`.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        _require_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, heads, L, D), got shape {tuple(t.shape)}")
    batch, heads, query_len, head_dim = query.shape
    if key.shape[:3] != value.shape[:3]:
        raise ValueError(f"key shape {tuple(key.shape)} and value shape {tuple(value.shape)} differ in (B, Hkv, Lk)")
    kb, kv_heads, key_len, key_dim = key.shape
    if kb != batch:
        raise ValueError(f"query batch {batch} != key batch {kb}")
    if key_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} != key head_dim {key_dim}")
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
    if isinstance(keep_window_size, bool) or not isinstance(keep_window_size, int):
        raise TypeError(f"keep_window_size must be an int, got {keep_window_size.__class__.__name__}")
    if keep_window_size < 1:
        raise ValueError(f"keep_window_size must be >= 1, got {keep_window_size}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal.__class__.__name__}")

    allowed = None
    if causal_mask is not None:
        if not isinstance(causal_mask, torch.Tensor):
            raise TypeError(f"causal_mask must be a torch.Tensor or None, got {causal_mask.__class__.__name__}")
        allowed = _allowed_from_mask(causal_mask)
        if allowed.dim() != 4:
            raise ValueError(f"causal_mask must be 4-D (B, heads, Lq, Lk), got shape {tuple(causal_mask.shape)}")
        mb, mh, mq, mk = allowed.shape
        if mb not in (1, batch) or mh not in (1, kv_heads, heads) or mq not in (1, query_len) or mk not in (1, key_len):
            raise ValueError(
                f"causal_mask shape {tuple(causal_mask.shape)} does not broadcast to "
                f"(B={batch}, 1|Hkv={kv_heads}|H={heads}, Lq={query_len}, Lk={key_len})"
            )

    bias = dynamic_mask_bias(value, dt_proj, A, heads_first=True)
    if allowed is not None and allowed.shape[1] not in (1, kv_heads):
        # A mask per query head cannot broadcast against a per-kv-head bias; give each
        # query head its group's bias (query head h reads kv head h // group).
        group = heads // kv_heads
        bias = bias.unsqueeze(2).expand(batch, kv_heads, group, 1, key_len).reshape(batch, heads, 1, key_len)

    if key_len <= keep_window_size:
        # Every candidate fits in the window: the kernel's own causal handling suffices.
        return allowed, bias

    min_dtype = torch.finfo(bias.dtype).min
    if (allowed is None or allowed.shape[2] == 1) and query_len <= key_len:
        # The candidates are the same for every query (up to causality), so the top-k is one
        # interval of query positions per key: O(L) numbers instead of an (Lq, Lk) mask. Key
        # positions serve the queries as the last Lq positions (bottom-right, like is_causal),
        # so a KV-cache step (Lq < Lk) gets exactly the rows of the full causal selection.
        # A per-key candidate mask is folded into the bias the selection ranks: a -inf bias is
        # never a candidate, exactly like a disallowed key.
        ranked = bias.detach()
        if allowed is not None:
            ranked = ranked.masked_fill(~allowed, float("-inf"))
        return topk_intervals(ranked, keep_window_size, is_causal=is_causal, min_dtype=min_dtype), bias
    if not is_causal:
        return create_mask(bias, allowed, batch, query_len, key_len, keep_window_size, min_dtype), bias

    # Top-k must only pick causally visible keys (j <= i + Lk - Lq), otherwise window
    # slots go to keys the kernel then masks. Building the causal pattern per chunk of
    # query rows avoids ever holding a full (Lq, Lk) causal matrix.
    lead = (batch, bias.shape[1] if allowed is None else max(bias.shape[1], allowed.shape[1]))
    out = torch.empty((*lead, query_len, key_len), dtype=torch.bool, device=bias.device)
    chunk = max(1, _CHUNK_ELEMENTS // max(lead[0] * lead[1] * key_len, 1))
    key_pos = torch.arange(key_len, device=bias.device)
    for lo in range(0, query_len, chunk):
        hi = min(lo + chunk, query_len)
        query_pos = torch.arange(lo, hi, device=bias.device) + (key_len - query_len)
        cand = (key_pos <= query_pos[:, None]).view(1, 1, hi - lo, key_len)
        if allowed is not None:
            cand = cand & (allowed if allowed.shape[2] == 1 else allowed[:, :, lo:hi])
        out[:, :, lo:hi] = create_mask(bias, cand, batch, hi - lo, key_len, keep_window_size, min_dtype)
    return out, bias


def apply_dynamic_mask_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dt_proj: Union[torch.Tensor, nn.Linear],
    A: torch.Tensor,
    causal_mask: Optional[torch.Tensor] = None,
    keep_window_size: int = 2048,
    is_causal: bool = True,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Dynamic Mask Attention: ZOH bias from ``value`` plus top-k key selection.

    Args:
        query: ``(B, H, Lq, D)`` (heads-first).
        key, value: ``(B, Hkv, Lk, D)``; ``H`` must be a multiple of ``Hkv`` (GQA/MQA).
        dt_proj, A: see :func:`dynamic_mask_bias`.
        causal_mask: optional bool (True = attend) or additive float (0 = keep, any other
            value, e.g. ``-inf`` / dtype min, = masked) tensor broadcastable to
            ``(B, 1|Hkv|H, Lq, Lk)``. Restricts the top-k candidates and is passed to the
            kernel as (part of) the attention mask.
        keep_window_size: keys kept per query when ``Lk > keep_window_size``; otherwise
            no top-k selection happens.
        is_causal: bottom-right aligned causal attention (query ``i`` sees keys
            ``j <= i + Lk - Lq``); top-k then only picks among causally visible keys.
        dropout_p: attention dropout in ``[0, 1)`` on the normalised probabilities, as
            :func:`~flash_dmattn.flash_dmattn_func` applies it (kept entries scaled by
            ``1 / (1 - dropout_p)``; ``torch.manual_seed`` reproduces a call). Pass ``0.0``
            for inference.

    Returns:
        ``(B, H, Lq, D)`` attention output.

    The mask handed to the kernel when ``Lk > keep_window_size``: if ``causal_mask`` is None
    or per key (a padding mask, shape ``(B|1, 1|Hkv|H, 1, Lk|1)``) and ``Lq <= Lk``, the
    selection is a :class:`~flash_dmattn.masks.KeyIntervals` mask built by
    :func:`~flash_dmattn.planning.selection.topk_intervals` (two int32 per key and head, no
    ``(Lq, Lk)`` tensor; with ``is_causal`` each query keeps the best keys it can see).
    Otherwise (a mask with a query dim, or ``Lq > Lk``) a dense bool ``(B, Hkv|H, Lq, Lk)``
    mask is built, one chunk of query rows at a time. Both give the same result.

    Equivalent plain PyTorch (for Lq >= 1 and every query row seeing at least one key)::

        bias = dynamic_mask_bias(value, dt_proj, A, heads_first=True)   # (B, Hkv, 1, Lk)
        if causal_mask is None:
            allowed = torch.ones(1, 1, Lq, Lk, dtype=torch.bool)
        else:
            allowed = causal_mask if causal_mask.dtype == torch.bool else causal_mask == 0
        if is_causal:
            i = torch.arange(Lq)[:, None]; j = torch.arange(Lk)
            allowed = allowed & (j <= i + Lk - Lq)
        allowed = allowed.expand(B, Hkv, Lq, Lk)
        if Lk > keep_window_size:
            cand = bias.masked_fill(~allowed, float("-inf"))
            idx = cand.sort(dim=-1, descending=True, stable=True).indices[..., :keep_window_size]
            allowed = allowed & torch.zeros_like(allowed).scatter(-1, idx, True)
        k, v, bias, allowed = (einops.repeat(t, "b hkv i j -> b (hkv g) i j", g=H // Hkv)
                               for t in (key, value, bias, allowed))
        scores = query @ k.transpose(-1, -2) / D ** 0.5 + bias
        scores = scores.masked_fill(~allowed, float("-inf"))
        p = scores.softmax(-1)
        p = p * keep / (1 - dropout_p)  # keep: the call's keep-mask (flash_dmattn.testing)
        out = p @ v                                                       # (B, H, Lq, D)
    """
    mask, bias = _dynamic_mask_and_bias(query, key, value, dt_proj, A, causal_mask, keep_window_size, is_causal)
    # Imported here: the api module pulls in the registry and dispatch, which the mask
    # utilities above do not need.
    from ..api import flash_dmattn_func

    out = flash_dmattn_func(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        attn_mask=mask,
        attn_bias=bias,
        is_causal=is_causal,
        dropout_p=dropout_p,
    )
    return out.transpose(1, 2)
