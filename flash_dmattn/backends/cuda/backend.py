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

from ...inputs import AttentionInputs
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
        if getattr(inputs, "dropout_p", 0.0) > 0.0:
            reasons.append("dropout is not implemented in the cuda kernels yet")
            reasons.append("return_attn_probs is not supported (use torch-reference)")
        return reasons

    def not_supported_reasons(self, inputs) -> List[str]:
        reasons = self._call_reasons(inputs)
        if getattr(inputs, "key_intervals", None) is not None:
            from .intervals import interval_reasons

            reasons.extend(r for r in interval_reasons(inputs) if r not in reasons)
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
        return reasons

    def varlen_not_supported_reasons(self, inputs) -> List[str]:
        """Why the kernels cannot run packed sequences ``inputs`` (a VarlenInputs)."""
        reasons = self._call_reasons(inputs)
        if getattr(inputs, "key_intervals", None) is not None:
            reasons.append("key-interval masks (KeyIntervals) have no cuda kernel yet")
            return reasons
        from .kernels import varlen_input_reasons

        reasons.extend(r for r in varlen_input_reasons(
            inputs.query, inputs.value, inputs.attn_mask, inputs.attn_bias) if r not in reasons)
        return reasons

    def varlen_attention(self, inputs):
        """Packed-sequence attention (SPEC §4) through the ``cuda_varlen`` custom ops."""
        return cuda_varlen_op().attention(inputs)

    def auto_skip_reasons(self, inputs) -> List[str]:
        # Auto-dispatch takes these kernels where the benchmark measured them at least as fast
        # as triton, on Hopper (H200, 2026-11-23): forward-only calls (nothing needs a
        # gradient; T1 1.97 vs 2.39 ms, T2 0.54 vs 0.66 ms, T3 1.07 vs 1.09 ms), calls with
        # neither mask nor bias, with gradients too (the warp-specialised dK/dV: every dense
        # row of the benchmark, e.g. L16384 D128 causal 8.7 vs 10.1 ms), training with a mask
        # and no bias (T3's per-key mask: 4.38-4.62 vs 4.69-4.83 ms) and training with a
        # per-query mask and a per-key bias (T2: 2.26 vs 3.00 ms). Training with a bias and a
        # per-key mask or none, its decode kernel with a mask + bias and packed sequences are
        # not measured at least as fast: those stay with triton unless FLASH_DMATTN_CUDA_AUTO=1.
        if os.environ.get("FLASH_DMATTN_CUDA_AUTO", "0") not in ("", "0"):
            return []
        if getattr(inputs, "key_intervals", None) is not None:
            # Key-interval masks: wherever these kernels run (not_supported_reasons: Hopper,
            # not deterministic) they beat triton's interval kernels on every dma_long row
            # (benchmarks/results/*/dma_long.md).
            return []
        if _hopper_measured_faster(inputs):
            return []
        return ["forward + backward with a bias, without a per-query mask, not measured as fast "
                "as triton; on Hopper, forward-only calls, training without a bias and "
                "per-query-mask training use it; set FLASH_DMATTN_CUDA_AUTO=1 to prefer it "
                "everywhere"]

    def kernel_module(self, spec: KernelSpec, device=None):
        """The compiled extension for ``spec`` on ``device`` (built and cached on first use)."""
        return jit.load_kernel(spec, toolchain.detect(device))

    def attention(self, inputs):
        out, _ = cuda_op()(
            inputs.query, inputs.key, inputs.value, inputs.attn_mask, inputs.attn_bias,
            inputs.softmax_scale, inputs.is_causal, inputs.softcap, inputs.deterministic,
            cache_seqlens=inputs.cache_seqlens, block_table=inputs.block_table,
            key_intervals=getattr(inputs, "key_intervals", None),
            key_window=getattr(inputs, "key_window", None),
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


def _hopper_measured_faster(inputs) -> bool:
    """A call on an sm_90 GPU (not packed, not decode, no paged / used-length cache) where
    nothing needs a gradient, that has no bias, or whose mask varies per query
    (:func:`_per_query_mask_training`)."""
    if not isinstance(inputs, AttentionInputs) or inputs.device.type != "cuda":
        return False
    if inputs.cache_seqlens is not None or getattr(inputs, "block_table", None) is not None:
        return False
    from .kernels import use_cuda_decode

    q, k = inputs.query, inputs.key
    if use_cuda_decode(q.shape[1], q.shape[2], k.shape[2], k.shape[1], False):
        return False
    leaves = [inputs.query, inputs.key, inputs.value, inputs.attn_bias]
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in leaves)
    if needs_grad and inputs.attn_bias is not None and not _per_query_mask_training(inputs):
        return False
    return torch.cuda.get_device_capability(inputs.device) == (9, 0)


def _per_query_mask_training(inputs) -> bool:
    """The dynamic-mask workload's shape: a mask that varies per query (the forward gathers
    its tiles' live keys, the dK/dV kernel reads its key bits), with no bias or a per-key one
    (T2 on an H200, 2026-11-23: 2.65 vs triton 3.09 ms forward + backward)."""
    mask, bias = inputs.attn_mask, inputs.attn_bias
    q, k = inputs.query, inputs.key
    if mask is None or mask.dim() != 4 or mask.size(2) != q.shape[1] or q.shape[1] <= 1:
        return False
    return bias is None or (bias.dim() == 4 and bias.size(2) == 1 and bias.size(3) == k.shape[1])
