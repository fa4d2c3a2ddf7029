"""``flash_dma_attention``: Dynamic Mask Attention in one call, in the layout of
:func:`~flash_dmattn.flash_dmattn_func`.

The call computes the DMA bias of every key from the values (a learned projection
``dt_proj`` and a per-head coefficient ``a_coef``), keeps for every query the
``keep_window_size`` keys with the largest bias, and runs exact attention over the kept keys
with the bias added to the scores. The selection is handed to the kernels as a
:class:`~flash_dmattn.masks.KeyIntervals` mask built by
:func:`~flash_dmattn.planning.selection.topk_intervals` (two int32 per key and kv head, never an
``(Lq, Lk)`` tensor), whose window promise lets the kernels plan and run at a cost
proportional to the window.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import nn

from .api import flash_dmattn_func
from .dropout import check_dropout_p
from .planning.selection import topk_intervals
from .utils.dynamic import dynamic_mask_bias

__all__ = ["flash_dma_attention"]


def _check_layout(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seq_len, heads, head_dim), got shape {tuple(t.shape)}")
    if key.shape != value.shape:
        raise ValueError(
            f"key and value must have the same shape (batch, seq_len_k, num_kv_heads, head_dim), "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    batch, _, heads, head_dim = query.shape
    if key.shape[0] != batch:
        raise ValueError(f"query batch {batch} != key batch {key.shape[0]}")
    if key.shape[3] != head_dim:
        raise ValueError(f"query head_dim {head_dim} != key head_dim {key.shape[3]}")
    kv_heads = key.shape[2]
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")


def _check_options(keep_window_size, dropout_p, causal, return_attn_probs) -> None:
    # bool is a subclass of int; accepting True as a window of 1 would hide caller bugs.
    if isinstance(keep_window_size, bool) or not isinstance(keep_window_size, int):
        raise TypeError(f"keep_window_size must be an int, got {type(keep_window_size).__name__}")
    if keep_window_size < 1:
        raise ValueError(f"keep_window_size must be >= 1, got {keep_window_size}")
    check_dropout_p(dropout_p)
    for name, flag in (("causal", causal), ("return_attn_probs", return_attn_probs)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")


def flash_dma_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dt_proj: Union[torch.Tensor, nn.Linear],
    a_coef: torch.Tensor,
    keep_window_size: int = 1024,
    dropout_p: float = 0.0,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    return_attn_probs: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Dynamic Mask Attention: a value-dependent bias per key, top-``keep_window_size`` key
    selection per query, and exact attention over the kept keys.

    Args:
        query: ``(B, Lq, H, D)``.
        key, value: ``(B, Lk, Hkv, D)``; ``H`` must be a multiple of ``Hkv`` (GQA / MQA:
            query head ``h`` reads kv head ``h // (H // Hkv)``).
        dt_proj: ``(Hkv, Hkv * D)`` projection of a key's values (all kv heads concatenated)
            to one number per kv head; its first dim gives the number of kv heads the bias
            has, which must match ``key``'s. An ``nn.Linear(Hkv * D, Hkv)`` is accepted too
            (its bias, if any, is added).
        a_coef: ``(Hkv,)`` per-head coefficient ``A``.
        keep_window_size: keys each query keeps when ``Lk > keep_window_size`` (ties go to
            the lower key index); with ``Lk <= keep_window_size`` every visible key is kept.
        dropout_p: attention dropout in ``[0, 1)`` on the normalised probabilities (kept
            entries scaled by ``1 / (1 - dropout_p)``; the keep rate uses ``dropout_p``
            rounded to a multiple of ``1/256``), as
            :func:`~flash_dmattn.flash_dmattn_func` applies it: the random stream comes from
            torch's generator for the query's device (``torch.manual_seed`` reproduces a
            call). A plain function has no training mode: pass ``0.0`` for inference.
        causal: bottom-right aligned causal attention (query ``i`` sees keys
            ``j <= i + Lk - Lq``); each query then keeps the best keys among those it sees.
            Not causal: every query keeps the same ``keep_window_size`` keys.
        softmax_scale: default ``1 / sqrt(D)``.
        return_attn_probs: also return the attention probabilities ``(B, H, Lq, Lk)`` as
            :func:`~flash_dmattn.flash_dmattn_func` returns them with
            ``return_attn_probs=True`` (float32; zero outside the selection; before dropout;
            not differentiable).

    Returns:
        The output ``(B, Lq, H, D)`` in the query's dtype, or ``(output, probs)``.

    The bias is differentiable with respect to ``value``, ``dt_proj`` and ``a_coef``; the
    selection is not (it is made on the detached bias).

    Equivalent plain PyTorch (``dt_proj`` a weight tensor)::

        B, Lq, H, D = query.shape; Lk, Hkv = key.shape[1], key.shape[2]; g = H // Hkv
        dt = value.reshape(B, Lk, Hkv * D) @ dt_proj.T                    # (B, Lk, Hkv)
        bias = torch.exp(a_coef * F.softplus(dt)).transpose(1, 2)[:, :, None, :]  # (B, Hkv, 1, Lk)
        i, j = torch.arange(Lq)[:, None], torch.arange(Lk)
        visible = (j <= i + Lk - Lq) if causal else torch.ones(Lq, Lk, dtype=torch.bool)
        if Lk > keep_window_size:
            score = bias.detach().masked_fill(~visible, float("-inf"))    # (B, Hkv, Lq, Lk)
            top = score.sort(dim=-1, descending=True, stable=True).indices[..., :keep_window_size]
            visible = visible & torch.zeros_like(score, dtype=torch.bool).scatter(-1, top, True)
        key, value = (einops.repeat(t, "b j hkv d -> b j (hkv g) d", g=g) for t in (key, value))
        bias, visible = (einops.repeat(t, "b hkv i j -> b (hkv g) i j", g=g)
                         for t in (bias, visible.expand(B, Hkv, Lq, Lk)))
        s = torch.einsum("bihd,bjhd->bhij", query, key) * softmax_scale + bias
        s = s.masked_fill(~visible, float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)                          # rows seeing nothing -> 0
        p = p * keep / (1 - dropout_p)        # keep: the call's keep-mask (flash_dmattn.testing)
        out = torch.einsum("bhij,bjhd->bihd", p, value)
    """
    _check_layout(query, key, value)
    _check_options(keep_window_size, dropout_p, causal, return_attn_probs)
    key_len = key.shape[1]

    # (B, Hkv, 1, Lk): one bias per key, shared by the queries; dynamic_mask_bias checks that
    # dt_proj and a_coef have the kv heads of the values.
    bias = dynamic_mask_bias(value, dt_proj, a_coef)
    mask = None
    if key_len > keep_window_size:
        # A per-key bias ranks the keys the same way for every query, so the selection is one
        # interval of query positions per key (causal) or one shared set of keys (not causal).
        mask = topk_intervals(bias, keep_window_size, is_causal=causal)
    result = flash_dmattn_func(
        query,
        key,
        value,
        attn_mask=mask,
        attn_bias=bias,
        softmax_scale=softmax_scale,
        is_causal=causal,
        return_attn_probs=return_attn_probs,
        dropout_p=dropout_p,
    )
    if return_attn_probs:
        out, _, probs = result
        return out, probs
    return result
