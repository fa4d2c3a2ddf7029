"""The 1.2.x entry point ``flash_dynamic_mask_attention_forward``, kept for existing callers.

It makes the same library call as
:func:`flash_dmattn.integrations.hf_transformers.dmattn_attention_forward`; the additions are
the 1.2.x positional ``attention_bias`` argument and the optional 1.2.x top-k window
(``window_size``), which turns the bias into a dynamic mask before attention.

Where the top-k selection is built as key intervals
---------------------------------------------------
When the bias is per key (``(B, H, Lk)`` or ``(B, H, 1, Lk)``, the DMA bias) and every query
has the same candidates up to causality, the selection is handed to the kernel as a
:class:`~flash_dmattn.masks.KeyIntervals` mask
(:func:`~flash_dmattn.planning.selection.topk_intervals`, O(L log L), two int32 per key)
instead of a dense bool ``(B, H, Lq, Lk)`` mask. That is the case for:

* no mask, or a 2-D ``(B, L)`` padding mask (causal or not, ``Lq <= Lk``: a prefill, a
  chunked prefill or a decode step reading the last positions);
* the ``(B, 1, Lq, Lk)`` bool mask that the registered ``dmattn`` mask function built as
  "causal (or bidirectional) + key padding" (it carries a
  :class:`~flash_dmattn.integrations.hf_varlen.PaddingRecord`; the record gives the ``(B, L)``
  padding and the causality without reading the mask).

The dense path remains for every other mask (user 4-D masks, sliding-window or chunked masks,
masks edited in place or sliced, additive float masks), for a bias with a query dim (e.g. one
that an additive mask's real bias values were added to), and for ``Lq > Lk``; it gives the same
selection.

Where it cannot be intercepted: transformers' own Doge (``DogeAttention``) builds its dynamic
mask inside the layer (``prepare_dynamic_mask``: bias expanded to ``(B, H, Lq, Lk)``, a
``torch.topk`` per query row, folded into one additive float mask) and only then calls the
attention function, so the ``(B, H, Lq, Lk)`` tensor exists before this package sees the call
and ``dmattn_attention_forward`` can only run it as an additive mask. Models that pass the
per-key bias and the window to ``flash_dynamic_mask_attention_forward`` instead (the 1.2.x
calling convention) get the interval form.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from ..masks import KeyIntervals
from ..planning.selection import topk_intervals
from ..utils.mask import create_mask
from . import hf_transformers, hf_varlen


def _interval_selection(
    call: dict, attention_mask: Any, window_size: int
) -> Optional[Tuple[KeyIntervals, bool]]:
    """``(intervals, is_causal)`` for the call's top-k selection, or None where the candidates
    differ per query row in a way intervals do not describe (then the dense path runs)."""
    bias = call["attn_bias"]
    batch, query_len = call["query"].shape[:2]
    key_len = call["key"].shape[1]
    if bias.shape[2] != 1 or query_len > key_len:
        return None
    mask, causal = call["attn_mask"], call["is_causal"]
    if mask is not None and mask.shape[2] != 1:
        # A 4-D mask from the registered mask function that is "causal / bidirectional + key
        # padding" (its record says so) is a per-key mask plus causality.
        record = hf_varlen.record_of(attention_mask)
        if (
            record is None
            or record.causal is None
            or tuple(attention_mask.shape) != (batch, 1, query_len, key_len)
            or record.padding.shape[0] != batch
            or (record.causal and record.q_offset + query_len != key_len)
        ):
            return None
        mask = hf_varlen._valid_keys(record.padding, key_len)[:, None, None, :]
        causal = record.causal
    # A disallowed key gets a -inf bias for the ranking: never a candidate, as in create_mask.
    ranked = bias.detach()
    if mask is not None:
        ranked = torch.where(mask, ranked, float("-inf"))
    intervals = topk_intervals(ranked, window_size, is_causal=causal, min_dtype=torch.finfo(bias.dtype).min)
    return intervals, causal


def flash_dynamic_mask_attention_forward(
    module: Optional[torch.nn.Module],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    attention_bias: Optional[torch.Tensor] = None,
    scaling: Optional[float] = None,
    softcap: Optional[float] = None,
    **kwargs: Any,
) -> Tuple[torch.Tensor, None]:
    """1.2.x-compatible transformers attention function.

    Same arguments as ``dmattn_attention_forward`` (query ``(B, H, Lq, D)``, key/value
    ``(B, Hkv, Lk, D)``, ``attention_mask`` None / bool / additive float / 2-D padding,
    ``scaling``, ``dropout``, ``softcap``, ``is_causal``, ...) plus ``attention_bias`` (float,
    ``(B, 1|Hkv|H, Lq|1, Lk)`` or per-key ``(B, 1|Hkv|H, Lk)``), which is the sixth positional
    argument as in 1.2.x. transformers passes everything after ``attention_mask`` by keyword,
    so this function can also be registered in its ``AttentionInterface`` as is.

    ``window_size`` (keyword; else ``module.window_size`` when that is an int): when a bias is
    present and ``Lk > window_size``, each query keeps only the ``window_size`` visible keys
    with the largest bias (ties to the lower key index); visibility includes the mask and,
    when it applies, causality, so future keys never take a slot. The selection is a
    ``KeyIntervals`` mask where the module docstring says so, else a dense bool mask
    (``flash_dmattn.utils.mask.create_mask``).

    Returns ``(attn_output (B, Lq, H, D), None)``. Equivalent plain PyTorch::

        if bias is not None and window_size and Lk > window_size:
            visible = <bool mask> & <causal band>                     # True where not given
            score = bias.masked_fill(~visible, float("-inf"))
            top = score.topk(window_size, dim=-1).indices             # ties: lower key first
            mask = torch.zeros_like(visible).scatter(-1, top, True) & visible
        return dmattn_attention_forward(module, query, key, value, mask,
                                        attention_bias=bias, scaling=scaling, ...)
    """
    window_size = kwargs.pop("window_size", None)
    if window_size is None:
        candidate = getattr(module, "window_size", None)
        # Only an int is a 1.2.x keep-window; other modules use the name for other things.
        if isinstance(candidate, int) and not isinstance(candidate, bool):
            window_size = candidate
    if attention_bias is not None:
        kwargs["attention_bias"] = attention_bias
    call = hf_transformers.prepare_attention_call(
        module, query, key, value, attention_mask, scaling, kwargs.pop("dropout", 0.0), softcap,
        kwargs,
    )
    bias = call["attn_bias"]
    batch, query_len, _, _ = call["query"].shape
    key_len = call["key"].shape[1]
    if bias is not None and window_size is not None and key_len > int(window_size):
        selection = _interval_selection(call, attention_mask, int(window_size))
        if selection is not None:
            call["attn_mask"], call["is_causal"] = selection
            return hf_transformers._get_kernel()(**call), None
        visible = call["attn_mask"]
        if call["is_causal"]:
            # Materialised only in this compatibility path: the top-k must not spend slots on
            # keys the causal mask hides.
            i = torch.arange(query_len, device=bias.device)[:, None]
            j = torch.arange(key_len, device=bias.device)[None, :]
            band = (j <= i + key_len - query_len)[None, None]
            visible = band if visible is None else visible & band
        call["attn_mask"] = create_mask(
            bias,
            visible,
            batch,
            query_len,
            key_len,
            window_size=int(window_size),
            min_dtype=torch.finfo(bias.dtype).min,
        )
    return hf_transformers._get_kernel()(**call), None
