"""The 1.2.x entry point ``flash_dynamic_mask_attention_forward``, kept for existing callers.

It makes the same library call as
:func:`flash_dmattn.integrations.hf_transformers.dmattn_attention_forward`; the additions are
the 1.2.x positional ``attention_bias`` argument and the optional 1.2.x top-k window
(``window_size``), which turns the bias into a dynamic mask before attention.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from ..utils.mask import create_mask
from . import hf_transformers


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
    with the largest bias (``flash_dmattn.utils.mask.create_mask``); visibility includes the
    mask and, when it applies, causality, so future keys never take a slot.

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
