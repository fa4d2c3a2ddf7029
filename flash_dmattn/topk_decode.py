"""Decoding with a top-W key selection: a step reads only the selected keys.

Dynamic Mask Attention keeps, for every query, the ``W`` keys with the largest per-key bias. A
decoding step (one new query against a KV cache of ``L`` keys) therefore needs ``W`` keys' K/V,
not ``L``. Two functions:

* :func:`topk_key_index` selects them: per (batch, kv head), the positions of the ``W`` best
  keys, ``O(B·Hkv·W)`` integers (``-1`` for empty slots), exactly the keys that
  :func:`~flash_dmattn.utils.mask.create_mask` / :func:`~flash_dmattn.utils.mask.topk_intervals`
  let the step's (last) query see.
* :func:`selected_keys_attention` attends over the listed keys only. On a GPU with triton its
  split-KV decode kernel reads the K/V rows and bias values by index
  (:mod:`flash_dmattn.backends.triton.decode_selected`); elsewhere the listed rows are gathered
  and attended by :func:`~flash_dmattn.flash_dmattn_func`. Both equal the dense call with the
  selection as a bool mask.

Together (``cache_seqlens`` optional, a preallocated cache's used lengths)::

    index = topk_key_index(bias, window_size=W, cache_seqlens=n)        # (B, Hkv, W) int64
    out = selected_keys_attention(q, k_cache, v_cache, index, attn_bias=bias, cache_seqlens=n)

The Hugging Face integration runs a Doge decoding step this way
(:mod:`flash_dmattn.integrations.hf_transformers`).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from . import envs, registry
from .inputs import _check_cache_seqlens, _check_qkv, _scale_and_softcap, normalise_mask_or_bias
from .ops import eager_inference
from .planning.decode import DECODE_MAX_ROWS
from .planning.selection import _check_inputs as _check_selection

__all__ = ["topk_key_index", "selected_keys_attention"]


# ---------------------------------------------------------------------------------------------
# Selection
# ---------------------------------------------------------------------------------------------
def topk_key_index(
    attention_bias: torch.Tensor,
    window_size: int,
    cache_seqlens: Optional[torch.Tensor] = None,
    padding_mask: Optional[torch.Tensor] = None,
    min_dtype: Optional[float] = None,
) -> torch.Tensor:
    """The keys a decoding step's query keeps under a top-``window_size`` selection, as
    positions.

    Args:
        attention_bias: float ``(B, H, 1, L)``, one bias per key (``H`` usually ``Hkv``); it
            is detached.
        window_size: keys kept (an int >= 1).
        cache_seqlens: None or int ``(B,)``: batch ``b``'s query sees keys ``j <
            cache_seqlens[b]`` (the last position of a KV cache of used length ``n``); None:
            every key (the query is position ``L - 1``).
        padding_mask: None or bool ``(B, L)`` (True = real token).
        min_dtype: bias value meaning "masked" (default ``torch.finfo(bias.dtype).min``): a
            key is a candidate iff ``bias > min_dtype``, padding allows it and it is used.

    Returns int64 ``(B, H, min(window_size, L))``: per (batch, head) the positions of the
    ``window_size`` candidates with the largest bias (ties to the lower position), best first,
    then ``-1`` for the slots left when fewer keys are candidates. With ``window_size >= L``
    every candidate is kept, and slot ``j`` holds key ``j`` (or ``-1`` where ``j`` is no
    candidate): no sort.

    The same keys as the last row of the dense selections: for batch ``b`` with used length
    ``n``, ``create_mask(bias[b:b+1, ..., :n], padding_mask[b:b+1, :n], window_size=W,
    min_dtype=min_dtype)`` and the last query of ``topk_intervals(bias[b:b+1, ..., :n], W,
    padding_mask=..., min_dtype=...)``. Equivalent plain PyTorch::

        valid = (bias[:, :, 0] > min_dtype) & padding_mask[:, None] & (j < cache_seqlens[:, None, None])
        score = bias[:, :, 0].masked_fill(~valid, float("-inf"))
        order = score.sort(dim=-1, descending=True, stable=True)
        index = torch.where(order.values > float("-inf"), order.indices, -1)[..., :window_size]

    Cost: one stable sort per (batch, head) row (``O(L log L)``, no host synchronisation); with
    ``window_size >= L`` none.
    """
    # Window, bias, padding and min_dtype as topk_intervals checks them; then the cache lengths.
    padding_mask, min_dtype = _check_selection(attention_bias, window_size, False, padding_mask,
                                               min_dtype)
    bias = attention_bias.detach()[:, :, 0]
    batch, heads, length = bias.shape
    device = bias.device
    if padding_mask is not None:
        batch = max(batch, padding_mask.shape[0])
    if cache_seqlens is not None:
        if not isinstance(cache_seqlens, torch.Tensor):
            raise TypeError(
                f"cache_seqlens must be a torch.Tensor or None, got {type(cache_seqlens).__name__}")
        if cache_seqlens.device != device:
            raise ValueError(f"cache_seqlens is on {cache_seqlens.device} but attention_bias is on "
                             f"{device}")
        if cache_seqlens.dtype not in (torch.int32, torch.int64) or cache_seqlens.dim() != 1:
            raise ValueError(
                f"cache_seqlens must be int32/int64 (batch,), got {cache_seqlens.dtype} "
                f"{tuple(cache_seqlens.shape)}")
        if cache_seqlens.shape[0] != batch and batch != 1:
            raise ValueError(
                f"cache_seqlens has batch {cache_seqlens.shape[0]}, the other arguments {batch}")
        batch = cache_seqlens.shape[0]
        if padding_mask is not None and padding_mask.shape[0] not in (1, batch):
            raise ValueError(
                f"padding_mask batch {padding_mask.shape[0]} does not match the batch of "
                f"cache_seqlens ({batch})")
    # `>` also rejects -inf and NaN, as create_mask does.
    valid = bias > min_dtype
    if padding_mask is not None:
        valid = valid & padding_mask[:, None, :]
    if cache_seqlens is not None:
        pos = torch.arange(length, device=device)
        valid = valid & (pos < cache_seqlens.view(-1, 1, 1))
    valid = valid.expand(batch, heads, length)
    if window_size >= length:
        # Every candidate fits: the positions themselves, in order.
        pos = torch.arange(length, device=device)
        return torch.where(valid, pos, -1)
    # A stable descending sort ranks equal biases by ascending position (ties to the lower
    # index) and the non-candidates (-inf) last; `+ 0.0` makes -0.0 equal to +0.0 for it.
    score = torch.where(valid, bias + 0.0, float("-inf"))
    values, order = torch.sort(score, dim=-1, descending=True, stable=True)
    values, order = values[..., :window_size], order[..., :window_size]
    return torch.where(values > float("-inf"), order, -1)


# ---------------------------------------------------------------------------------------------
# Attention over the selected keys
# ---------------------------------------------------------------------------------------------
def selected_keys_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_index: torch.Tensor,
    attn_bias: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    is_causal: bool = False,
    softcap: Optional[float] = None,
    cache_seqlens: Optional[torch.Tensor] = None,
    bias_floor: Optional[float] = None,
) -> torch.Tensor:
    """Attention of a few queries over the keys that ``key_index`` lists.

    Args:
        query: ``(B, Lq, H, D)``; key, value: ``(B, Lk, Hkv, D)`` (e.g. a KV cache), as
            :func:`~flash_dmattn.flash_dmattn_func`.
        key_index: int32 / int64 ``(B|1, Hi, W)``: per batch and head, the positions of the
            keys to attend to; entries ``< 0`` (or ``>= Lk``, or past ``cache_seqlens``) are
            empty slots. ``Hi`` is ``1`` or ``Hkv`` (one list per kv head, shared by its
            query heads: the DMA models' selection) or ``H`` (one per query head). A list's
            positions must be distinct. :func:`topk_key_index` builds it.
        attn_bias: None or float, broadcastable to ``(B, H, Lq, Lk)`` as in
            :func:`~flash_dmattn.flash_dmattn_func` (e.g. the DMA bias ``(B, Hkv, 1, Lk)``);
            only the listed keys' entries are read.
        softmax_scale, softcap: as :func:`~flash_dmattn.flash_dmattn_func`.
        is_causal: query ``i`` sees position ``j`` only if ``j <= i + n - Lq`` (``n`` the used
            length: ``cache_seqlens[b]`` or ``Lk``); no effect for ``Lq = 1``.
        cache_seqlens: None or int ``(B,)``: positions ``>= cache_seqlens[b]`` are invisible.
        bias_floor: None, or a float: a listed key is also invisible where its bias is not
            finite or ``<= bias_floor``; a transformers additive mask (0 / real bias where
            kept, ``finfo.min`` where masked) passed as ``attn_bias`` with ``bias_floor =
            finfo.min / 2`` is then read the way transformers reads it.

    Returns ``(B, Lq, H, D)`` in the query's dtype; rows that see no key give 0.

    Equivalent plain PyTorch (``kv(h) = h // (H // Hi)`` for a per-kv-head list)::

        listed = (key_index >= 0) & (key_index < Lk)
        mask = torch.zeros(B, Hi, 1, Lk + 1, dtype=torch.bool)   # column Lk: empty slots
        mask.scatter_(-1, torch.where(listed, key_index, Lk)[:, :, None], True)
        mask = mask[..., :Lk]
        if bias_floor is not None:
            mask = mask & torch.isfinite(attn_bias) & (attn_bias > bias_floor)
        out = flash_dmattn_func(query, key, value, attn_mask=mask, attn_bias=attn_bias,
                                softmax_scale=softmax_scale, is_causal=is_causal,
                                softcap=softcap, cache_seqlens=cache_seqlens)

    The triton kernel runs forward calls on a GPU (or on CPU with ``FLASH_DMATTN_BACKEND=triton``
    under ``TRITON_INTERPRET=1``) of at most 64 rows (``Lq * H / Hkv``) with a list per kv
    head; the others (gradients, per-query-head lists, CPU, another backend forced, no triton)
    gather the listed rows and run one dense call on the backend auto-dispatch picks. Either
    way K/V are read at the listed rows only.
    """
    _check_qkv(query, key, value, "4-D (batch, seqlen, heads, head_dim)")
    batch, seqlen_q, heads, head_dim = query.shape
    kb, seqlen_k, kv_heads, kd = key.shape
    if kb != batch or kd != head_dim or kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(
            f"query {tuple(query.shape)} and key/value {tuple(key.shape)} must share batch and "
            f"head_dim, with num_heads a multiple of num_kv_heads"
        )
    scale, cap = _scale_and_softcap(softmax_scale, softcap, head_dim)
    if not isinstance(key_index, torch.Tensor):
        raise TypeError(f"key_index must be a torch.Tensor, got {type(key_index).__name__}")
    if key_index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"key_index must be int32 or int64, got {key_index.dtype}")
    if (key_index.dim() != 3 or key_index.shape[0] not in (1, batch)
            or key_index.shape[1] not in (1, kv_heads, heads)):
        raise ValueError(
            f"key_index must have shape (batch or 1, heads, W) with heads 1, num_kv_heads="
            f"{kv_heads} or num_heads={heads}; got {tuple(key_index.shape)}"
        )
    if key_index.device != query.device:
        raise ValueError(f"key_index is on {key_index.device} but query is on {query.device}")
    bias = normalise_mask_or_bias(
        "attn_bias", attn_bias, query=query, batch=batch, num_heads=heads,
        num_kv_heads=kv_heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
    )
    if bias_floor is not None:
        if bias is None:
            raise ValueError("bias_floor needs attn_bias (it hides keys by their bias)")
        bias_floor = float(bias_floor)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    cache_seqlens = _check_cache_seqlens(cache_seqlens, query, batch, seqlen_k)
    return run_selected(query, key, value, key_index, bias, scale, is_causal, cap, cache_seqlens,
                        bias_floor)


def run_selected(query, key, value, key_index, attn_bias=None, softmax_scale: float = 1.0,
                 is_causal: bool = False, softcap: float = 0.0, cache_seqlens=None,
                 bias_floor: Optional[float] = None):
    """:func:`selected_keys_attention` on arguments already checked: ``attn_bias`` None or a
    4-D view, ``softmax_scale`` / ``softcap`` floats (0.0: no softcap), ``cache_seqlens`` None
    or int32 ``(B,)``. Callers that check their own arguments (a model's decoding step, once
    per layer) call this directly."""
    bias, scale = attn_bias, softmax_scale
    heads, kv_heads = query.shape[2], key.shape[2]
    if _triton_runs(query, key, value, key_index, bias, heads, kv_heads):
        out, _ = _selected_module().selected_decode_forward(
            query, key, value, key_index, bias, scale, is_causal, softcap, cache_seqlens,
            bias_floor)
        return out
    return _gathered_attention(query, key, value, key_index, bias, scale, is_causal, softcap,
                               cache_seqlens, bias_floor)


_SELECTED = None


def _selected_module():
    """:mod:`flash_dmattn.backends.triton.decode_selected` (imported on first use: it needs
    triton; then kept, since a decoding step reaches it once per layer)."""
    global _SELECTED
    if _SELECTED is None:
        from .backends.triton import decode_selected

        _SELECTED = decode_selected
    return _SELECTED


def _triton_runs(query, key, value, key_index, bias, heads: int, kv_heads: int) -> bool:
    """Whether the triton selected-keys kernel runs this call (see
    :func:`selected_keys_attention`): an eager forward the kernel takes, with triton usable
    and no other backend forced."""
    # One read of the variables this depends on (FLASH_DMATTN_BACKEND, FLASH_DMATTN_DISABLE,
    # TRITON_INTERPRET), raw: the key of _triton_usable's answer.
    env = envs.dispatch_environment()
    forced = envs.forced_backend() if env[3] is not None else None
    if forced is not None and forced != "triton":
        return False
    if query.device.type != "cuda" and forced is None:
        return False  # on CPU the reference runs (the dispatch policy's cpu rule)
    group = heads // kv_heads
    if group * query.shape[1] > DECODE_MAX_ROWS or (key_index.shape[1] == heads and group > 1):
        return False
    # Gradients, compiling / tracing, tensor subclasses and dispatch modes take the gathered
    # call, whose dense kernels are custom ops with autograd and fake kernels.
    if not eager_inference(query, key, value, key_index, bias):
        return False
    return _triton_usable(query.device, query.dtype, query.shape[3], env)


@functools.lru_cache(maxsize=64)
def _triton_usable(device: torch.device, dtype: torch.dtype, head_dim: int, env: tuple) -> bool:
    """Whether the triton backend is there and its kernels take this device, dtype and head
    dim (the triton backend's own rules; cached per device and environment: ``env`` is
    :func:`flash_dmattn.envs.dispatch_environment`, which holds the raw values of
    ``FLASH_DMATTN_DISABLE`` and ``TRITON_INTERPRET`` read here)."""
    interp = envs.interpret_mode()
    if "triton" in envs.disabled_backends():
        return False
    backend = registry._BACKENDS.get("triton")
    if backend is None or backend.unavailable_reason() is not None:
        return False
    if device.type == "cuda":
        from .policy import device_capability

        if device_capability(device) < (8, 0) or dtype not in (torch.float16, torch.bfloat16):
            return False
    elif not (device.type == "cpu" and interp) or dtype not in (
            torch.float16, torch.bfloat16, torch.float32):
        return False
    return head_dim <= 256


def _gather_rows(t: torch.Tensor, b_ar: torch.Tensor, pos: torch.Tensor,
                 head: torch.Tensor) -> torch.Tensor:
    """``t[b, pos[b, s, w], head[s]]`` as ``(B, W, S, D)``: the listed rows of a ``(B, L, Hkv, D)``
    tensor. One ``index_select`` of whole rows where ``t``'s rows are one array (heads-first or
    sequence-first contiguous: a KV cache either way), else advanced indexing."""
    batch, length, heads, dim = t.shape
    if t.transpose(1, 2).is_contiguous():  # (B, Hkv, L, D) storage, as transformers keeps it
        flat = (b_ar * heads + head) * length + pos
        rows = t.transpose(1, 2).reshape(-1, dim)
    elif t.is_contiguous():
        flat = (b_ar * length + pos) * heads + head
        rows = t.reshape(-1, dim)
    else:
        return t[b_ar, pos, head].transpose(1, 2)
    return rows.index_select(0, flat.reshape(-1)).view(*pos.shape, dim).transpose(1, 2)


def _gathered_attention(query, key, value, key_index, bias, scale, is_causal, softcap,
                        cache_seqlens, bias_floor):
    """The listed keys gathered into ``(B, W, Hs, D)`` K/V (``Hs`` the list's heads, at least
    ``Hkv``), the selection, causality and used lengths folded into a bool mask, and one dense
    call on the backend auto-dispatch picks. Differentiable in query, key, value and bias."""
    from .api import flash_dmattn_func

    batch, seqlen_q, heads, _ = query.shape
    seqlen_k, kv_heads = key.shape[1], key.shape[2]
    group = heads // kv_heads
    device = query.device
    # The list's heads: one per kv head (Hi = 1 is broadcast to them) or one per query head.
    sel_heads = heads if key_index.shape[1] == heads and group > 1 else kv_heads
    idx = key_index.to(torch.int64).expand(batch, sel_heads, key_index.shape[-1])
    used = seqlen_k if cache_seqlens is None else cache_seqlens.to(torch.int64).view(-1, 1, 1)
    valid = (idx >= 0) & (idx < used) & (idx < seqlen_k)
    pos = torch.where(valid, idx, 0)
    b_ar = torch.arange(batch, device=device).view(-1, 1, 1)
    head_kv = (torch.arange(sel_heads, device=device) // (sel_heads // kv_heads)).view(1, -1, 1)
    k_sel = _gather_rows(key, b_ar, pos, head_kv)  # (B, W, Hs, D)
    v_sel = _gather_rows(value, b_ar, pos, head_kv)
    mask = valid[:, :, None, :]  # (B, Hs, 1, W)
    if is_causal and seqlen_q > 1:
        # Query i sits at position i + n - Lq (n: the batch's used length).
        qpos = torch.arange(seqlen_q, device=device).view(1, 1, -1, 1) - seqlen_q
        qpos = qpos + (used if isinstance(used, int) else used.view(-1, 1, 1, 1))
        mask = mask & (pos[:, :, None, :] <= qpos)
    bias_sel = None
    if bias is not None:
        bx, hx, qx, kx = bias.shape
        # Per query head if the bias or the lists are; else one per list head.
        out_heads = heads if heads in (hx, sel_heads) else sel_heads
        # The position list of each of the bias's output heads.
        pos_o = pos if out_heads == sel_heads else pos.repeat_interleave(out_heads // sel_heads, 1)
        if hx in (1, out_heads):
            # Bias heads line up with the output heads: one gather along the keys.
            cols = pos_o[:, :, None, :].expand(batch, out_heads, qx, pos_o.shape[-1])
            bias_sel = bias.expand(batch, out_heads, qx, kx).gather(3, cols if kx > 1 else
                                                                    torch.zeros_like(cols))
        else:
            head_b = torch.arange(out_heads, device=device) // (out_heads // hx)
            cols = pos_o[:, :, None, :] if kx > 1 else torch.zeros_like(pos_o[:, :, None, :])
            bias_sel = bias.expand(batch, hx, qx, kx)[
                b_ar.view(-1, 1, 1, 1), head_b.view(1, -1, 1, 1),
                torch.arange(qx, device=device).view(1, 1, -1, 1), cols]  # (B, Ho, qx, W)
        if bias_floor is not None:
            seen = (bias_sel > bias_floor) & (bias_sel < float("inf"))  # finite and above
            if out_heads != sel_heads:
                mask = mask.repeat_interleave(out_heads // sel_heads, 1)
            mask = mask & seen
    return flash_dmattn_func(query, k_sel, v_sel, attn_mask=mask, attn_bias=bias_sel,
                             softmax_scale=scale, is_causal=False, softcap=softcap or None)
