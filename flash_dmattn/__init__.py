"""flash_dmattn: exact attention with arbitrary masks, trainable biases and tile skipping.

Quick start (runs on CPU; the fastest available backend is picked per call)::

    import torch
    from flash_dmattn import flash_dmattn_func
    q = torch.randn(1, 256, 8, 64); k = v = torch.randn(1, 256, 2, 64)
    bias = torch.randn(1, 2, 1, 256)              # one bias per kv head and key
    mask = bias > 0                               # any bool mask, broadcastable
    out = flash_dmattn_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True)
"""
from . import backends as _backends  # noqa: F401  (registers the backends)
from ._version import __version__
from .api import (
    flash_dmattn_func,
    flash_dmattn_func_auto,
    flash_dmattn_varlen_func,
    flex_dmattn_func,
    reference_dmattn_func,
    triton_dmattn_func,
)
from .dma import flash_dma_attention
from .inputs import AttentionInputs, VarlenInputs
from .masks import KeyIntervals
from .registry import BackendUnavailableError, get_available_backends
from .utils.dynamic import apply_dynamic_mask_attention, dynamic_mask_bias
from .utils.mask import create_mask

_FLAGS = {"CUDA_AVAILABLE": "cuda", "TRITON_AVAILABLE": "triton", "FLEX_AVAILABLE": "flex"}


def __getattr__(name):
    # Availability flags are computed on first access, so importing never probes a GPU.
    if name in _FLAGS:
        return _FLAGS[name] in get_available_backends()
    raise AttributeError(f"module 'flash_dmattn' has no attribute {name!r}")


__all__ = [
    "__version__",
    "flash_dmattn_func",
    "flash_dmattn_varlen_func",
    "flash_dmattn_func_auto",
    "triton_dmattn_func",
    "flex_dmattn_func",
    "reference_dmattn_func",
    "get_available_backends",
    "create_mask",
    "dynamic_mask_bias",
    "apply_dynamic_mask_attention",
    "flash_dma_attention",
    "AttentionInputs",
    "KeyIntervals",
    "VarlenInputs",
    "BackendUnavailableError",
    "CUDA_AVAILABLE",
    "TRITON_AVAILABLE",
    "FLEX_AVAILABLE",
]

# Model-level nn.Module layers; imported last because they build on everything above.
from .modules import DynamicMaskAttention, MultiheadAttention  # noqa: E402

__all__ += ["DynamicMaskAttention", "MultiheadAttention"]
