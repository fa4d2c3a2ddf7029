"""The ``cuda`` backend: compiled CUDA/CuTe kernels, built per specialisation on first use.

Importing this module touches neither CUDA nor nvcc; :meth:`CudaBackend.probe` (run lazily by
the registry) says precisely why the backend is unavailable, listing every missing piece so one
look at ``python -m flash_dmattn info`` tells what to install. The kernels live in ``csrc/``
(sm80 mma.sync design, runs on Ampere, Ada and Hopper); :mod:`.kernels` is their host side and
:mod:`.spec`, :mod:`.toolchain`, :mod:`.jit` build them on first use.
"""
from __future__ import annotations

import os
from typing import List, Optional

import torch

from ..base import Backend
from . import jit, toolchain
from .spec import KernelSpec


def unavailable_reasons() -> List[str]:
    """Every reason the cuda backend cannot run here (empty = it can)."""
    reasons = []
    cap = toolchain.device_capability()
    if cap is None:
        detail = (f" (torch {torch.__version__} is a CPU-only build)"
                  if torch.version.cuda is None else "")
        reasons.append("no CUDA device" + detail)
    elif cap < toolchain.MIN_CAPABILITY:
        reasons.append(f"GPU {toolchain.device_name()} is {toolchain.arch_name(cap)}; needs "
                       f"compute capability >= 8.0")
    nvcc = toolchain.find_nvcc()
    if nvcc is None:
        reasons.append("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    elif torch.version.cuda is not None:  # only a CUDA build of torch can mismatch
        version = toolchain.nvcc_version(nvcc)
        if version is None:
            reasons.append(f"could not read the version of {nvcc}")
        else:
            mismatch = toolchain.cuda_major_mismatch(version)
            if mismatch:
                reasons.append(mismatch)
    if toolchain.find_ninja() is None:
        reasons.append("ninja not found (pip install ninja)")
    if toolchain.find_cutlass_include() is None:
        reasons.append("CUTLASS/CuTe headers not found (pip install 'flash_dmattn[cuda]' "
                       "installs nvidia-cutlass)")
    missing = jit.missing_kernel_sources()
    if missing:
        where = os.path.dirname(missing[0])
        names = ", ".join(os.path.basename(m) for m in missing)
        reasons.append(f"kernel sources not present yet ({where} has no {names}: the CUDA "
                       f"attention kernels are not written in this version)")
    return reasons


class CudaBackend(Backend):
    name = "cuda"

    def probe(self) -> Optional[str]:
        reasons = unavailable_reasons()
        return "; ".join(reasons) if reasons else None

    def version(self) -> str:
        nvcc = toolchain.find_nvcc()
        version = toolchain.nvcc_version(nvcc) if nvcc else None
        return f"nvcc {version}" if version else "-"

    @staticmethod
    def _call_reasons(inputs) -> List[str]:
        """Reasons shared by dense and packed calls: device, kernel spec, attention probs."""
        reasons = []
        if inputs.device.type != "cuda":
            reasons.append(f"tensors on {inputs.device.type} (needs CUDA)")
        try:
            KernelSpec.from_inputs(inputs)
        except ValueError as exc:
            reasons.append(str(exc))
        if inputs.return_attn_probs:
            reasons.append("return_attn_probs is not supported (use torch-reference)")
        return reasons

    @staticmethod
    def _dropout_reasons(inputs) -> List[str]:
        """Why the kernels cannot run a call's attention dropout: only the sm_90 forward and
        backward draw its keep-mask (flash_dmattn.dropout), dense batches and packed sequences
        alike, so not the decode kernel (KV caches) or the sm80 kernels (other GPUs; head dims
        over 128, whose backward is sm80 on Hopper too)."""
        if not getattr(inputs, "dropout_p", 0.0) > 0.0:
            return []
        from ...policy import HOPPER, device_capability

        reasons = []
        if (getattr(inputs, "cache_seqlens", None) is not None
                or getattr(inputs, "block_table", None) is not None):
            reasons.append("dropout with a KV cache (cache_seqlens / block_table): the cuda "
                           "decode kernel has no dropout")
        if inputs.head_dim > 128:
            reasons.append(f"dropout with head_dim {inputs.head_dim} > 128: the backward of "
                           f"those head dims (sm80 kernels) has no dropout")
        if inputs.device.type == "cuda" and device_capability(inputs.device) != HOPPER:
            reasons.append("dropout is implemented in the sm_90 (Hopper) cuda kernels only")
        return reasons

    def not_supported_reasons(self, inputs) -> List[str]:
        reasons = self._call_reasons(inputs)
        reasons.extend(self._dropout_reasons(inputs))
        if getattr(inputs, "key_intervals", None) is not None:
            from .intervals import interval_reasons
            from .kernels import input_reasons

            reasons.extend(r for r in interval_reasons(inputs) if r not in reasons)
            # The tensors' own limits (dtypes, head dims), which the interval kernels share
            # with the dense ones.
            reasons.extend(r for r in input_reasons(
                inputs.query, inputs.key, inputs.value, None, inputs.attn_bias, False)
                if r not in reasons)
            return reasons
        from .kernels import input_reasons

        reasons.extend(r for r in input_reasons(
            inputs.query, inputs.key, inputs.value, inputs.attn_mask, inputs.attn_bias,
            inputs.bias_needs_grad) if r not in reasons)
        # KV caches run the decode kernel, which has the Triton decode kernel's limits (rows,
        # forward-only pages, a folded mask for gradients) and shares its reasons.
        if getattr(inputs, "cache_seqlens", None) is not None:
            from ...planning.decode import cache_seqlens_reasons

            reasons.extend(r for r in cache_seqlens_reasons(inputs) if r not in reasons)
        if getattr(inputs, "block_table", None) is not None:
            from ...planning.decode import block_table_reasons

            reasons.extend(r for r in block_table_reasons(inputs, "cuda") if r not in reasons)
        from .kernels import HEAD_DIM_ALIGN, head_dim_padding

        if head_dim_padding(inputs.head_dim) and (
                getattr(inputs, "cache_seqlens", None) is not None
                or getattr(inputs, "block_table", None) is not None):
            # Other head dims are zero-padded to a multiple of 8 (kernels.pad_head_dim), which
            # would copy the whole KV cache every step.
            reasons.append(f"head_dim {inputs.head_dim} is not a multiple of {HEAD_DIM_ALIGN} "
                           f"with a KV cache (padding it would copy the cache each call)")
        return reasons

    def varlen_not_supported_reasons(self, inputs) -> List[str]:
        """Why the kernels cannot run packed sequences ``inputs`` (a VarlenInputs)."""
        if getattr(inputs, "key_intervals", None) is not None:
            # One packed key-interval call (flash_dmattn.planning.packed_intervals): its reasons.
            from ...planning.packed_intervals import packed_interval_inputs, packed_interval_reasons

            reasons = packed_interval_reasons(inputs)
            packed = packed_interval_inputs(inputs, remap=False)
            reasons.extend(r for r in self.not_supported_reasons(packed) if r not in reasons)
            return reasons
        reasons = self._call_reasons(inputs)
        reasons.extend(self._dropout_reasons(inputs))
        from .kernels import varlen_input_reasons

        reasons.extend(r for r in varlen_input_reasons(
            inputs.query, inputs.value, inputs.attn_mask, inputs.attn_bias) if r not in reasons)
        return reasons

    def varlen_attention(self, inputs):
        """Packed-sequence attention (docs/contract.md §4) through the ``cuda_varlen`` custom
        ops; with key intervals, one batch-1 key-interval call over the packed tokens (the
        ``cuda`` ops), whose gradients reach the varlen tensors through its views."""
        if getattr(inputs, "key_intervals", None) is not None:
            from ...planning.packed_intervals import packed_interval_inputs

            return self.attention(packed_interval_inputs(inputs))[0]
        return cuda_varlen_op().attention(inputs)

    def kernel_module(self, spec: KernelSpec, op: str, device=None):
        """The compiled extension of operation ``op`` (see :data:`.jit.OPS`) of ``spec`` on
        ``device`` (built and cached on first use)."""
        return jit.load_kernel(spec, op, toolchain.detect(device))

    def attention(self, inputs):
        out, _ = cuda_op()(
            inputs.query, inputs.key, inputs.value, inputs.attn_mask, inputs.attn_bias,
            inputs.softmax_scale, inputs.is_causal, inputs.softcap, inputs.deterministic,
            cache_seqlens=inputs.cache_seqlens, block_table=inputs.block_table,
            key_intervals=getattr(inputs, "key_intervals", None),
            key_window=getattr(inputs, "key_window", None),
            dropout_p=getattr(inputs, "dropout_p", 0.0),
            dropout_rng=getattr(inputs, "dropout_rng", None),
        )
        return out


_op = None


def cuda_op():
    """The registered custom-op pair ``flash_dmattn::cuda_fwd`` / ``cuda_bwd`` (created on
    first use, so importing needs no compiler)."""
    global _op
    if _op is None:
        from ...ops import AttentionOp
        from .kernels import cuda_backward, cuda_forward, cuda_planned_forward

        _op = AttentionOp("cuda", cuda_forward, cuda_backward,
                          planned_forward=cuda_planned_forward)
    return _op


_varlen_op = None


def cuda_varlen_op():
    """The registered packed-sequence custom-op pair ``flash_dmattn::cuda_varlen_fwd`` /
    ``_bwd`` (created on first use)."""
    global _varlen_op
    if _varlen_op is None:
        from ...ops import VarlenAttentionOp
        from .kernels import cuda_varlen_backward, cuda_varlen_forward

        _varlen_op = VarlenAttentionOp("cuda_varlen", cuda_varlen_forward, cuda_varlen_backward)
    return _varlen_op
