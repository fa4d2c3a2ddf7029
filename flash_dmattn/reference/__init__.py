"""The plain-PyTorch oracle of flash_dmattn (the ``torch-reference`` backend's math)."""
from .attention import gather_kv_pages, reference_attention, reference_probs
from .varlen import reference_varlen_attention

__all__ = ["gather_kv_pages", "reference_attention", "reference_probs", "reference_varlen_attention"]
