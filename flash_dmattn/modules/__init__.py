"""Model-level ``nn.Module`` layers built on flash_dmattn.

* :class:`DynamicMaskAttention` — GQA self-attention with the Dynamic Mask Attention bias
  ``exp(A * softplus(dt_proj(V)))`` and top-``window_size`` key selection.
* :class:`MultiheadAttention` — a drop-in ``torch.nn.MultiheadAttention`` (same parameters,
  state_dict keys and mask conventions) computed through flash_dmattn.
"""
from .dynamic_mask_attention import DynamicMaskAttention, apply_rotary_pos_emb, rotate_half
from .multihead_attention import MultiheadAttention

__all__ = ["DynamicMaskAttention", "MultiheadAttention", "apply_rotary_pos_emb", "rotate_half"]
