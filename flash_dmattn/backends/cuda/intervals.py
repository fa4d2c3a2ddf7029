"""Host side of the cuda backend's key-interval kernels: attention at the cost of the selected
keys, on Hopper.

A :class:`~flash_dmattn.masks.KeyIntervals` mask is planned by the backend-neutral planner
(:mod:`flash_dmattn.planning.key_lists`) at the kernels' own tile sizes:

* the forward (``fwd_intervals``, the warp-specialised wgmma forward walking gathered keys)
  reads, per 128-query tile, the K/V rows of the keys whose interval meets the tile, by index,
  with each key's visible query range and bias staged beside them;
* the backward (``bwd_intervals``) walks the planner's 128-key blocks: a CTA holds a block's
  K/V rows and walks one segment of the block's query range for every query head of the kv
  head's group, computing dK, dV, the per-key dbias and, fused, dQ. Under a window promise the
  blocks are the planner's segment items (each segment's keys, those seen by the whole segment
  first, cut into blocks whose ranges lie in the segment), which waste fewer pairs than key
  blocks spanning many segments. Blocks and segments that share keys add their dK/dV/dbias
  with fp32 atomics and dQ is accumulated with asynchronous reductions, so
  the last bits of the gradients vary between runs: ``deterministic=True`` calls go to the
  triton kernels (see :func:`interval_reasons`).
"""
from __future__ import annotations

from typing import List

import torch

from ...planning.key_lists import DenseEquivalent, full_bounds, plan_intervals
from ...policy import HOPPER, device_capability
from .extension import NO_DROPOUT, kernel_module, reduce_key_partials, vector_ready

# Query rows one dK/dV CTA walks at most over a key block (a multiple of the backward's 64-row
# tiles): a key that stays selected for most of the sequence is spread over several CTAs.
SEGMENT_ROWS = 2048
# The segment of the segment items (masks with a window promise). Shorter segments waste fewer
# pairs at the ends of keys' ranges and cost more K/V loads and dK/dV atomics: 1024 was the
# fastest of 1024 / 2048 / 4096 for causal and shared top-2048 selections at 32K and 64K
# (benchmarks/results/nvidia-h100/SUMMARY.md).
ITEM_SEGMENT_ROWS = 1024

__all__ = ["DenseEquivalent", "SEGMENT_ROWS", "ITEM_SEGMENT_ROWS", "interval_reasons",
           "interval_forward", "interval_backward", "plan_for"]


def interval_reasons(inputs) -> List[str]:
    """Why the cuda key-interval kernels cannot run a call with a KeyIntervals mask."""
    reasons = []
    if inputs.cache_seqlens is not None or inputs.block_table is not None:
        reasons.append("key-interval masks with a KV cache (cache_seqlens / block_table) have "
                       "no cuda kernel")
    bias = inputs.attn_bias
    if bias is not None and bias.shape[2] != 1:
        reasons.append("with a key-interval mask the cuda kernels take a per-key bias "
                       f"(Bx, Hx, 1, Lk); got bias {tuple(bias.shape)}")
    bounds = inputs.key_intervals
    if bounds.shape[2] == inputs.num_heads and inputs.num_heads != inputs.num_kv_heads:
        reasons.append("key intervals per query head within a kv-head group have no cuda "
                       "kernel (triton runs them)")
    if inputs.head_dim > 128:
        reasons.append(f"key-interval kernels take head_dim <= 128, got {inputs.head_dim}")
    if inputs.deterministic and inputs.needs_grad:
        # The forward is deterministic (each output row is one program's); only a backward
        # that will run needs the reproducible one.
        reasons.append("deterministic=True: the cuda key-interval backward adds partial "
                       "gradients with atomics (triton runs it deterministically)")
    if inputs.device.type == "cuda" and device_capability(inputs.device) != HOPPER:
        reasons.append("the cuda key-interval kernels are built for Hopper (sm_90) only")
    return reasons


def _module(q: torch.Tensor, bias, op: str):
    return kernel_module(q, True, bias is not None, op=op)


def plan_for(q, k, bias, bounds, is_causal, backward: bool, window=None):
    """``(plan, full bounds)`` of a call, at its forward module's query tile and, with
    ``backward``, its backward module's key block (a forward-only plan has no key blocks and
    loads no backward module); ``window``: the mask's window promise (see
    :class:`~flash_dmattn.masks.KeyIntervals`)."""
    B, Lq, H, _ = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    fb, _ = full_bounds(bounds, B, H, Hkv)
    fwd_m, fwd_n = _module(q, bias, "fwd").block_sizes()
    key_block = _module(q, bias, "bwd").block_sizes()[1] if backward else fwd_n
    return plan_intervals(fb, Lq, Lk, is_causal, fwd_m, key_block, backward, window=window,
                          segment_rows=ITEM_SEGMENT_ROWS), fb


def interval_forward(q, k, v, bias, bounds, scale, is_causal, softcap, plan=None,
                     drop=NO_DROPOUT):
    """``(out, lse, plan)``; ``plan`` is ``(IntervalPlan, full bounds)``; ``drop``: the
    extension's dropout arguments (:func:`~.extension.dropout_args`)."""
    q, k, v = (vector_ready(t) for t in (q, k, v))
    mod = _module(q, bias, "fwd")
    if plan is None:
        plan = plan_for(q, k, bias, bounds, is_causal, backward=False)
    ivp, fb = plan
    out, lse = mod.fwd_intervals(q, k, v, None, bias, fb, ivp.tile_start, ivp.tile_len,
                                 ivp.tile_full, ivp.keys, float(scale), bool(is_causal),
                                 float(softcap), *drop)
    return out, lse, plan


def interval_backward(dout, q, k, v, bias, bounds, out, lse, scale, is_causal, softcap, needs,
                      plan=None, dbias_dtype=None, drop=NO_DROPOUT):
    """``(dq, dk, dv, dbias)`` with None where ``needs`` did not ask; dbias (summed in fp32)
    in ``dbias_dtype`` (default: the bias's dtype); ``drop`` as in :func:`interval_forward`."""
    need_dq, need_dk, need_dv, need_dbias = needs
    need_dbias = need_dbias and bias is not None
    dout, q, k, v, out = (vector_ready(t) for t in (dout, q, k, v, out))
    mod = _module(q, bias, "bwd")
    if plan is None or plan[0].blk_keys is None:
        plan = plan_for(q, k, bias, bounds, is_causal, backward=True)
    ivp, fb = plan
    B, Lq, H, _ = q.shape
    Lk = k.shape[1]
    if ivp.n_blocks == 0:
        # Nobody sees any key: every output row is 0, so is every gradient.
        dq = torch.zeros_like(q) if need_dq else None
        dk = torch.zeros_like(k) if need_dk else None
        dv = torch.zeros_like(v) if need_dv else None
        db = torch.zeros((B, H, Lk), dtype=torch.float32, device=q.device)
        return dq, dk, dv, reduce_key_partials(db, bias, dbias_dtype) if need_dbias else None
    segment_rows = SEGMENT_ROWS
    if ivp.segment_rows is not None:
        # Segment items lie within one segment each: one CTA per item.
        bwd_m = mod.block_sizes()[0]
        segment_rows = max(SEGMENT_ROWS, -(-Lq // bwd_m) * bwd_m)
    dq, dk32, dv32, db32 = mod.bwd_intervals(
        dout, q, k, v, bias, out, lse.contiguous(), fb, ivp.blk_keys, ivp.blk_qlo, ivp.blk_qhi,
        ivp.blocks_per_row, segment_rows, float(scale), bool(is_causal), float(softcap),
        bool(need_dq), bool(need_dk or need_dv), bool(need_dbias), *drop)
    return (dq if need_dq else None,
            dk32.to(k.dtype) if need_dk else None,
            dv32.to(v.dtype) if need_dv else None,
            reduce_key_partials(db32, bias, dbias_dtype) if need_dbias else None)

