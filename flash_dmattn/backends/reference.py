"""The ``torch-reference`` backend: runs anywhere torch runs, supports every input.

Float64 calls (the tests' ground truth) and everything SDPA cannot express run the oracle of
:mod:`flash_dmattn.reference.attention`; other CPU calls run PyTorch's fused attention over
query chunks (:mod:`flash_dmattn.reference.sdpa_cpu`), the same attention at SDPA's speed.
On a GPU a plain call (no mask, bias, soft cap, KV cache, dropout or probabilities) is one
SDPA call too (:func:`~flash_dmattn.reference.sdpa_cpu.sdpa_plain_cuda`): auto-dispatch sends
small decoding steps here (policy rule ``gpu-plain-decode``), where that call's host time is
what counts, and on Hopper plain training calls of the shapes cuDNN's attention takes (rule
``hopper-plain-training``), which that call runs with cuDNN's attention first."""
from __future__ import annotations

import torch

from ..reference import gather_kv_pages, reference_attention, reference_probs, reference_varlen_attention
from ..reference.sdpa_cpu import sdpa_cpu_attention, sdpa_cpu_reasons, sdpa_plain, sdpa_plain_cuda
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
        key, value = inputs.key, inputs.value
        if inputs.block_table is not None:
            # Paged KV: gather the pages into contiguous (B, Lk, Hkv, D) K/V (autograd
            # scatter-adds the gradients back into the pools), then the ordinary path.
            key = gather_kv_pages(key, inputs.block_table)
            value = gather_kv_pages(value, inputs.block_table)
        if not sdpa_cpu_reasons(inputs):
            # CPU: PyTorch's fused attention where it computes exactly this call.
            return sdpa_cpu_attention(inputs.query, key, value, inputs.attn_mask,
                                      inputs.attn_bias, inputs.softmax_scale, inputs.is_causal,
                                      inputs.key_intervals)
        if inputs.plain and not (inputs.deterministic and inputs.needs_grad):
            # GPU: a plain call is one SDPA call (None where SDPA's semantics differ), unless a
            # deterministic backward is asked for (SDPA's fused backward accumulates with
            # atomics). On CUDA a training call asks for cuDNN's attention first.
            plain = sdpa_plain_cuda if inputs.device.type == "cuda" else sdpa_plain
            out = plain(inputs.query, key, value, inputs.softmax_scale, inputs.is_causal,
                        inputs.seqlen_q, inputs.seqlen_k)
            if out is not None:
                return out
        args = (inputs.query, key, value, inputs.attn_mask, inputs.attn_bias)
        cfg = (inputs.softmax_scale, inputs.is_causal, inputs.softcap)
        extra = dict(cache_seqlens=inputs.cache_seqlens, key_intervals=inputs.key_intervals)
        out, lse = reference_attention(*args, *cfg, **extra, dropout_p=inputs.dropout_p,
                                       dropout_rng=inputs.dropout_rng)
        if not inputs.return_attn_probs:
            return out
        probs = reference_probs(inputs.query, key, inputs.attn_mask, inputs.attn_bias, *cfg, **extra)
        return out, lse, probs

    # registry.run_plain asks for CPU calls only: where attention() would run one SDPA call,
    # that call on the tensors as given (no last-dim copy: run_plain checked them). The
    # function itself, not a method calling it: one Python frame less on every such call.
    plain_attention = staticmethod(sdpa_plain)
    # The same for CUDA tensors (registry.run_plain asks once the policy chose this backend
    # for the call's signature: small decoding steps, rule gpu-plain-decode; plain training
    # calls on Hopper, rule hopper-plain-training, cuDNN's attention first). run_plain never
    # asks for a deterministic training call: SDPA's backward is not deterministic.
    plain_cuda_attention = staticmethod(sdpa_plain_cuda)

    def varlen_attention(self, inputs):
        out, lse, probs = reference_varlen_attention(inputs)
        return (out, lse, probs) if inputs.return_attn_probs else out
