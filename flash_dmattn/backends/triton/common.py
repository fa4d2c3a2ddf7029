"""What every Triton kernel module of the backend shares: allocation of kernel-written outputs,
argument helpers (head blocks, strides of broadcast views), the ``tl.dot`` and ``tanh`` device
primitives, the block shapes of the attention kernels and their launch with or without
autotuning.

The rest of what the kernels share has a module per topic: :mod:`.scores` (score tiles: mask
and bias loads, hiding, key tiles), :mod:`.varlen` (packed sequences' bounds and key-tile
lists) and :mod:`.dropout_mask` (the dropout keep-mask). :mod:`.forward_kernel`,
:mod:`.backward_kernel`, :mod:`.decode` and :mod:`.intervals` import from these and not from each
other's launchers, so each kernel module can be read (and imported) on its own.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ...envs import interpret_mode, triton_autotune
from ...intmath import next_power_of_2

LOG2E = 1.4426950408889634

# Tests flip this to fill kernel-written outputs with NaN first, so unwritten elements show.
DEBUG_POISON = False


def alloc_output(shape, dtype, device) -> torch.Tensor:
    """``torch.empty`` that the kernels must fully overwrite (NaN-poisoned in debug mode)."""
    if DEBUG_POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def alloc_partials(num_splits: int, rows: int, head_dim: int, device, lse_shape: tuple
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fp32 workspace of a split-KV decode launch that merges its splits, in one
    allocation: the partial outputs (``num_splits * rows`` rows of ``head_dim``), their
    log-sum-exps (``num_splits * rows``) and the merged log-sum-exps (``rows = B * H * Lq`` of
    them, viewed as ``lse_shape = (B, H, Lq)``). The kernels address the partials and their
    log-sum-exps as flat rows from base pointers, so all three are views of one buffer: one
    allocator call per decode layer. Returns ``(partials, partial_lse, lse)``."""
    n = num_splits * rows * head_dim
    m = num_splits * rows
    buf = alloc_output((n + m + rows,), torch.float32, device)
    _, heads, seqlen_q = lse_shape
    lse = buf.as_strided(lse_shape, (heads * seqlen_q, seqlen_q, 1), n + m)
    return buf, buf[n:], lse


def dot_upcast(dtype: torch.dtype) -> bool:
    """Whether kernels must feed tl.dot fp32 copies (bf16 under the interpreter)."""
    return interpret_mode() and dtype == torch.bfloat16


def head_block(head_dim: int) -> int:
    """Padded head dim: next power of two, at least 16 (tl.dot's minimum K)."""
    return max(16, next_power_of_2(head_dim))


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def seqlen_bucket(n: int) -> int:
    """Autotune key bucket: sequence lengths within a power of two share tuned configs."""
    return next_power_of_2(max(n, 1))


def broadcast_strides(t: Optional[torch.Tensor], num_heads: int):
    """(stride_b, stride_h, stride_q, stride_k, head_div) for a 4-D mask/bias view.

    Size-1 dims get stride 0 so the kernels can index them with the full program index; the
    head index is ``h // head_div`` which maps query heads to 1, Hkv or H mask heads.
    """
    if t is None:
        return 0, 0, 0, 0, 1
    (b, h, m, n), (sb, sh, sm, sn) = t.shape, t.stride()
    return (0 if b == 1 else sb, 0 if h == 1 else sh, 0 if m == 1 else sm, 0 if n == 1 else sn,
            num_heads // h)



# ------------------------------------------------------------------------------------------
# Device primitives of every kernel
# ------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    # The CPU interpreter's tl.dot mishandles bfloat16 operands; it gets them as fp32 (exact).
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    # fp32 inputs (testing only) must not silently drop to tf32 on the GPU.
    if a.dtype == tl.float32:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _tanh(x):
    # tanh via exp2: saturates cleanly to +-1 for large |x| (exp2 -> inf or 0), no NaN.
    e = tl.exp2(x * 2.8853900817779268)
    return 1.0 - 2.0 / (e + 1.0)



# ------------------------------------------------------------------------------------------
# Block shapes and launches
# ------------------------------------------------------------------------------------------


def fwd_blocks(head_dim: int) -> Tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of the forward kernel; the tile lists are built for this shape.

    Block sizes are fixed per head dim (not autotuned) because the live-tile lists depend on
    them; autotuning covers num_warps / num_stages. Chosen from sm_90 register/smem reports of
    ahead-of-time compiles (no spills at 8 warps with mask + bias + softcap enabled).
    """
    if interpret_mode():
        return 16, 16
    if head_block(head_dim) <= 128:
        return 128, 64
    return 64, 64


def bwd_blocks(head_dim: int) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """Block shapes ``((BLOCK_M, BLOCK_N) of dK/dV, (BLOCK_M, BLOCK_N) of dQ)``.

    The dK/dV kernel keeps a long key tile resident (K, V and two fp32 accumulators) and streams
    short query tiles; the dQ kernel is forward-shaped (long query tile, short key tile), so for
    head dims up to 128 it uses the forward's blocks. The shapes match what FlexAttention picks
    on sm_90 (the same register budget); D=256 halves the
    long side because the fp32 accumulators alone fill the register file.
    """
    if interpret_mode():
        return (16, 16), (16, 16)
    bd = head_block(head_dim)
    if bd <= 128:
        # 128-key dK/dV tiles: a 64-key tile halves the accumulators but doubles the programs,
        # each re-reading Q and dO, and measured slower (benchmarks/results/nvidia-h200/).
        return (64, 128), (128, 64)
    return (64, 64), (64, 64)


def launch_tuned(kernel, tuned, grid, args, meta, autotune: bool = True) -> None:
    """Launch ``tuned`` (an autotuner over ``kernel``), or ``kernel`` with fixed settings under
    the interpreter, with autotuning switched off, or without ``autotune``: the first of
    ``tuned``'s (pruned) configs this GPU can fit. During CUDA-graph capture a specialisation
    the autotuner has not timed yet also takes the first config: timing synchronises the
    device, which capture forbids (its choice is used once it has one)."""
    if interpret_mode():
        kernel[grid](*args, **meta, num_warps=4, num_stages=1)
    elif (not autotune or not triton_autotune()
          or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
              and not _autotuned(tuned, args, meta))):
        configs = tuned.configs
        prune = getattr(tuned, "early_config_prune", None)
        if prune is not None:
            configs = prune(configs, dict(zip(kernel.arg_names, args)), **meta)
        # Like the autotuner, skip configs this GPU cannot fit (shared memory, registers).
        for i, cfg in enumerate(configs):
            try:
                kernel[grid](*args, **meta, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
                return
            except triton.runtime.errors.OutOfResources:
                if i == len(configs) - 1:
                    raise
    else:
        tuned[grid](*args, **meta)


def _autotuned(tuned, args, meta) -> bool:
    """Whether ``tuned`` has a timed config for these arguments (its cache key, built as
    Triton's ``Autotuner.run`` builds it: the key arguments, then every tensor's dtype)."""
    if len(tuned.configs) <= 1:
        return True
    try:
        named = {k: v for k, v in {**dict(zip(tuned.arg_names, args)), **meta}.items()
                 if k in tuned.arg_names}
        key = [named[k] for k in tuned.keys if k in named]
        key += [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
        return tuple(key) in tuned.cache
    except Exception:  # noqa: BLE001  (another Triton's internals: take the safe branch)
        return False

