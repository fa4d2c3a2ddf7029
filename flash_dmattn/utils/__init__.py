"""Helpers around the attention kernels: mask construction from biases (``mask``),
the Dynamic Mask Attention bias and call (``dynamic``), and varlen packing (``padding``).
"""
from .dynamic import apply_dynamic_mask_attention, dynamic_mask_bias
from .mask import create_mask, topk_intervals
from .padding import cu_seqlens_from_lengths, pad_input, unpad_input

__all__ = [
    "apply_dynamic_mask_attention",
    "create_mask",
    "cu_seqlens_from_lengths",
    "dynamic_mask_bias",
    "pad_input",
    "topk_intervals",
    "unpad_input",
]
