"""The ``torch-reference`` backend: runs anywhere torch runs, supports every input."""
from __future__ import annotations

import torch

from ..reference import reference_attention, reference_probs, reference_varlen_attention
from .base import Backend


class ReferenceBackend(Backend):
    name = "torch-reference"

    def probe(self):
        return None

    def version(self) -> str:
        return f"torch {torch.__version__}"

    def not_supported_reasons(self, inputs):
        return []

    def varlen_not_supported_reasons(self, inputs):
        return []

    def attention(self, inputs):
        args = (inputs.query, inputs.key, inputs.value, inputs.attn_mask, inputs.attn_bias)
        cfg = (inputs.softmax_scale, inputs.is_causal, inputs.softcap)
        out, lse = reference_attention(*args, *cfg, cache_seqlens=inputs.cache_seqlens)
        if not inputs.return_attn_probs:
            return out
        probs = reference_probs(
            inputs.query, inputs.key, inputs.attn_mask, inputs.attn_bias, *cfg,
            cache_seqlens=inputs.cache_seqlens,
        )
        return out, lse, probs

    def varlen_attention(self, inputs):
        out, lse, probs = reference_varlen_attention(inputs)
        return (out, lse, probs) if inputs.return_attn_probs else out
