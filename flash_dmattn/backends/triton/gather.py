"""Key gathering: per query tile, the union of its rows' live keys, compacted.

Tile skipping only helps when whole (query tile, key tile) blocks are dead. The dynamic-mask
workload defeats it: each query keeps its own top-k keys, scattered over the sequence, so every
128 x 64 block holds a few live keys and no block is dead. But consecutive queries keep nearly
the same keys (a per-key bias ranks keys the same way for every query), so the *union* of a
query tile's live keys is barely larger than one query's. Gather mode walks that union instead
of the key tiles: the kernels load K/V rows (and per-key bias entries) by index, BLOCK_N
gathered keys at a time, so the work is about ``union size / Lk`` of the dense work.

Built per call from the mask, on its device, with a few torch ops and one host sync:

* ``idx``  ``(Bm, Hm, nQ, C)`` int32: the live keys of each query tile, ascending; only the
  first ``cnt`` of a row are meaningful;
* ``cnt``  ``(Bm, Hm, nQ)`` int32;
* ``gmask`` ``(Bm, Hm, nQ * block_m, C)`` uint8: the mask gathered to those columns,
  ``gmask[b, h, i, c] = mask[b, h, i, idx[b, h, i // block_m, c]]``, so the kernels read the
  element mask of a gathered tile as one contiguous ``block_m x BLOCK_N`` byte tile;

where ``C`` is the largest union (``Bm, Hm`` are the mask's own, possibly broadcast, dims). No
(B, H, Lq, Lk) temporary is made: the largest is ``gmask``, at most the mask's own size and
usually a fraction of it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ...block_map import block_reduce, cdiv
from .mask_summary import MaskSummary

# Use gather mode when it visits at most this fraction of the key tiles that tile skipping
# would visit. Gathered tiles always load their element mask and their K/V rows by index, so
# they cost a little more than a partial tile of the plain path.
GATHER_MAX_RATIO = 0.75
_POLICIES = ("auto", "always", "never")

# Default policy per kernel, from the H200 run of 2026-11-21 on the dynamic-mask workload
# (B1 H16/Hkv4 L8192 D128, top-2048 per query, causal; auto chose gather for both kernels):
# the gathered forward took 3.09 ms against 2.25 ms for tile skipping, while the backward
# (where only dQ gathers) took 5.91 ms against 6.43 ms. The forward's gathered loads are not
# hidden by the software pipeline yet; until they are, only dQ gathers by default.
DEFAULT_POLICY = {"forward": "never", "dq": "auto"}


def gather_policy(kernel: str = "forward") -> str:
    """``FLASH_DMATTN_TRITON_GATHER``: ``auto`` (gather when it saves work), ``always`` (when
    the inputs allow it; for tests) or ``never``; unset: :data:`DEFAULT_POLICY` of ``kernel``."""
    policy = os.environ.get("FLASH_DMATTN_TRITON_GATHER", "").strip().lower()
    if not policy:
        return DEFAULT_POLICY[kernel]
    if policy not in _POLICIES:
        raise ValueError(f"FLASH_DMATTN_TRITON_GATHER must be one of {_POLICIES}, got {policy!r}")
    return policy


@dataclass(frozen=True)
class KeyGather:
    """Gathered key lists of one call for query tiles of ``block_m`` rows (see module doc)."""

    block_m: int
    capacity: int
    head_div: int
    idx: torch.Tensor
    cnt: torch.Tensor
    gmask: torch.Tensor

    def list_strides(self) -> Tuple[int, int, int, int, int, int]:
        """(idx_b, idx_h, idx_m, cnt_b, cnt_h, cnt_m) with 0 for broadcast dims."""

        def s(t, d):
            return 0 if t.size(d) == 1 else t.stride(d)

        return (s(self.idx, 0), s(self.idx, 1), s(self.idx, 2),
                s(self.cnt, 0), s(self.cnt, 1), s(self.cnt, 2))

    def mask_strides(self, num_heads: int) -> Tuple[int, int, int, int, int]:
        """(b, h, q, k, head_div) strides of ``gmask`` in the kernels' mask-argument layout."""
        g = self.gmask
        return (0 if g.size(0) == 1 else g.stride(0), 0 if g.size(1) == 1 else g.stride(1),
                g.stride(2), 1, num_heads // g.size(1))


def gather_eligible(mask: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                    seqlen_q: int, seqlen_k: int, block_m: int) -> bool:
    """Whether the inputs fit gather mode at all.

    The mask must vary per query (a per-key or broadcast mask already gives dead tiles) and
    the bias, if any, must not: a full (Lq, Lk) bias would be read element by element at
    scattered columns.
    """
    if mask is None or seqlen_q <= 1 or seqlen_k <= 1:
        return False
    if mask.size(2) != seqlen_q or mask.size(3) != seqlen_k:
        return False
    if bias is not None and bias.size(2) != 1 and bias.size(3) != 1:
        return False
    return True


def plan_key_gather(
    mask: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    seqlen_q: int,
    seqlen_k: int,
    num_heads: int,
    is_causal: bool,
    block_m: int,
    block_n: int,
    policy: Optional[str] = None,
    kernel: str = "forward",
    summary: Optional[MaskSummary] = None,
) -> Optional[KeyGather]:
    """Gather lists for ``block_m``-row query tiles, or None when tile skipping is as cheap.

    ``policy`` defaults to :func:`gather_policy` of ``kernel`` (``forward`` or ``dq``). Under
    ``auto`` the union sizes are compared with the live-tile count of ``block_m x block_n``
    tiles (one host sync).
    """
    policy = gather_policy(kernel) if policy is None else policy
    if policy == "never" or not gather_eligible(mask, bias, seqlen_q, seqlen_k, block_m):
        return None
    if policy == "auto" and seqlen_k < 4 * block_n:
        return None
    device = mask.device
    hx = mask.shape[1]
    n_q = cdiv(seqlen_q, block_m)

    # (bx, hx, nQ, Lk); a MaskSummary already holds it (or a finer version of it)
    union = summary.row_union(block_m) if summary is not None else block_reduce(mask, 2, block_m, "any")
    if is_causal:
        q_last = torch.clamp(torch.arange(n_q, device=device) * block_m + block_m, max=seqlen_q) - 1
        keys = torch.arange(seqlen_k, device=device)
        union = union & (keys[None, :] <= (q_last + (seqlen_k - seqlen_q))[:, None])
    cnt = union.sum(-1, dtype=torch.int32)
    if policy == "auto":
        live_tiles = block_reduce(union, 3, block_n, "any").sum()
        gathered_tiles = torch.div(cnt + (block_n - 1), block_n, rounding_mode="floor").sum()
        live, gathered, capacity = torch.stack(
            [live_tiles, gathered_tiles, cnt.max().to(live_tiles.dtype)]).tolist()
        if gathered > GATHER_MAX_RATIO * live:
            return None
    else:
        capacity = int(cnt.max().item())
    capacity = max(int(capacity), 1)

    # Live keys first, ascending (the index breaks ties), then cut to the largest union.
    ar = torch.arange(seqlen_k, device=device, dtype=torch.int32)
    order = torch.sort((~union).to(torch.int32) * seqlen_k + ar, dim=-1).values
    idx = (order[..., :capacity] % seqlen_k).contiguous()

    gmask = _gather_mask(mask.view(torch.uint8), idx, seqlen_q, block_m, capacity)
    return KeyGather(block_m=block_m, capacity=capacity, head_div=num_heads // hx,
                     idx=idx, cnt=cnt.contiguous(), gmask=gmask)


# A multiple of every BLOCK_N the gathered kernels use, so a tile never reads past its row.
GMASK_ROW_ALIGN = 64


def _gather_mask(mask_u8: torch.Tensor, idx: torch.Tensor, seqlen_q: int, block_m: int,
                 capacity: int) -> torch.Tensor:
    """``gmask[b, h, i, c] = mask[b, h, i, idx[b, h, i // block_m, c]]``, rows padded to tiles."""
    bx, hx, _, seqlen_k = mask_u8.shape
    n_q = idx.size(2)
    # Rows padded to a multiple of GMASK_ROW_ALIGN bytes (zeros): the kernels bound their mask
    # reads by the row stride instead of the list length, which the compiler then knows to be
    # a multiple of 16 -- so it reads the mask tile as 16-byte vectors and software-pipelines
    # it (byte-wide loads are not pipelined; see scripts/compile_check.py). Positions past a
    # tile's count are hidden by the kernels' key bound either way.
    width = -(-capacity // GMASK_ROW_ALIGN) * GMASK_ROW_ALIGN
    rows = torch.empty((bx, hx, n_q, block_m, width), dtype=torch.uint8, device=mask_u8.device)
    rows[..., capacity:] = 0
    gmask = rows[..., :capacity]
    n_full = seqlen_q // block_m
    rem = seqlen_q - n_full * block_m
    idx64 = idx.to(torch.int64)
    if n_full:
        src = mask_u8.narrow(2, 0, n_full * block_m).unflatten(2, (n_full, block_m))
        ix = idx64[:, :, :n_full, None, :].expand(bx, hx, n_full, block_m, capacity)
        torch.gather(src, -1, ix, out=gmask[:, :, :n_full])  # strided out: written in place
    if rem:
        src = mask_u8.narrow(2, n_full * block_m, rem)
        ix = idx64[:, :, n_full, None, :].expand(bx, hx, rem, capacity)
        torch.gather(src, -1, ix, out=gmask[:, :, n_full, :rem])
        gmask[:, :, n_full, rem:] = 0
    return rows.view(bx, hx, n_q * block_m, width)[..., :capacity]
