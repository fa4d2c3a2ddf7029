"""Key gathering: per query tile, the union of its rows' live keys, compacted.

Tile skipping only helps when whole (query tile, key tile) blocks are dead. The dynamic-mask
workload defeats it: each query keeps its own top-k keys, scattered over the sequence, so every
128 x 64 block holds a few live keys and no block is dead. But consecutive queries keep nearly
the same keys (a per-key bias ranks keys the same way for every query), so the *union* of a
query tile's live keys is barely larger than one query's. Gather mode walks that union instead
of the key tiles: the kernels load K/V rows by index, BLOCK_N gathered keys at a time, so the
work is about ``union size / Lk`` of the dense work.

Built per call from the mask (and a per-key bias), on their device, by three small Triton
kernels after the mask summary (:mod:`.gather_build` launches :mod:`.gather_kernels`; their
plain-PyTorch twins are in :mod:`.gather_reference`). Nothing waits for the stream: the lists are sized by the
largest causal limit (``Lk``), and the ``auto`` policy's two totals reach the host behind an
event while the bits are built (see :func:`plan_key_gather` and :mod:`.gather_verdicts`):

* ``idx``  ``(Bm, Hm, nQ, Lk)`` int32: the live keys of each query tile, ascending; only the
  first ``cnt`` of a row are written;
* ``cnt``  ``(Bm, Hm, nQ)`` int32;
* ``gbits`` ``(Bm, Hm, nQ * block_m, W)`` int64: the mask gathered to those columns, 64
  columns per word: bit ``c % 64`` of ``gbits[b, h, i, c // 64]`` is
  ``mask[b, h, i, idx[b, h, i // block_m, c]]`` -- and, in a causal call, 0 where that key
  lies past row ``i``'s causal limit -- so the kernels read a gathered tile's element mask as
  one word per row (its bytes were 8 KB per 128 x 64 tile) and need no range or causal test
  of their own; words past ``ceil(cnt / 64)`` are not written;
* ``gbias`` (a per-key bias only) ``(Bg, Hg, nQ, Lk rounded up to 64)``: the bias at those
  keys, ``gbias[b, h, m, c] = bias[b, h, 0, idx[b, h, m, c]]``, read at the same positions, so
  no load in the kernels' loop depends on another load of the same step; written up to the
  count rounded up to 64 (0 past the count);

where ``W = ceil(Lk / 64)`` (``Bm, Hm`` are the mask's own, possibly broadcast, dims). The
kernels read nothing past a tile's count. No (B, H, Lq, Lk) temporary is made: the largest is
``gbits``, an eighth of the mask's own size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .gather_build import (
    bias_per_key,
    compact_keys,
    gather_bias,
    gather_key_bits,
    gather_mask_bits,
    tile_union,
)
from .gather_verdicts import TotalsToHost, lagged_verdict, remember_totals
from .mask_summary import MaskSummary


# Default policy per kernel: both gather when it saves work. The gathered forward kernel is
# the faster of the two on per-query top-k masks once its plan is one compact-and-gather
# kernel rather than a torch sort + gather (benchmarks/results/<gpu>/SUMMARY.md, the dynamic
# suite).
DEFAULT_POLICY = {"forward": "auto", "dq": "auto"}

# Private test hook: "always" (gather whenever the inputs allow it, to reach the gathered
# kernels on small inputs) or "never" replaces every kernel's default; None keeps them.
_FORCED_POLICY: Optional[str] = None


def gather_policy(kernel: str = "forward") -> str:
    """``auto`` (gather when it saves work, see
    :data:`~.gather_verdicts.GATHER_MAX_RATIO`), ``always`` or ``never``:
    :data:`DEFAULT_POLICY` of ``kernel`` (``forward`` or ``dq``)."""
    return _FORCED_POLICY or DEFAULT_POLICY[kernel]


@dataclass(frozen=True)
class KeyGather:
    """Gathered key lists of one call for query tiles of ``block_m`` rows (see module doc)."""

    block_m: int
    head_div: int
    idx: torch.Tensor
    cnt: torch.Tensor
    gbits: torch.Tensor
    gbias: Optional[torch.Tensor] = None

    def list_strides(self) -> Tuple[int, int, int, int, int, int]:
        """(idx_b, idx_h, idx_m, cnt_b, cnt_h, cnt_m) with 0 for broadcast dims."""

        def s(t, d):
            return 0 if t.size(d) == 1 else t.stride(d)

        return (s(self.idx, 0), s(self.idx, 1), s(self.idx, 2),
                s(self.cnt, 0), s(self.cnt, 1), s(self.cnt, 2))

    def bias_strides(self, num_heads: int) -> Tuple[int, int, int, int, int]:
        """(b, h, tile, k, head_div) strides of ``gbias`` in the kernels' bias-argument layout:
        the query-row stride slot carries the per-query-tile stride (the kernels offset the
        bias by it once and read it like a padded per-key bias)."""
        g = self.gbias
        return (0 if g.size(0) == 1 else g.stride(0), 0 if g.size(1) == 1 else g.stride(1),
                g.stride(2), 1, num_heads // g.size(1))

    def mask_strides(self, num_heads: int) -> Tuple[int, int, int, int, int]:
        """(b, h, q, k, head_div) strides of ``gbits`` in the kernels' mask-argument layout
        (the key stride is that of its words)."""
        g = self.gbits
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
    lagged: bool = False,
) -> Optional[KeyGather]:
    """Gather lists for ``block_m``-row query tiles, or None when tile skipping is as cheap.

    ``policy`` defaults to :func:`gather_policy` of ``kernel`` (``forward`` or ``dq``). Under
    ``auto`` the gathered ``block_n``-key tiles are compared with the live ``block_m x
    block_n`` tiles (:func:`~.gather_verdicts.prefers_tiles`). The lists are sized by the
    causal limit (no host sync for their size) and the comparison's two totals are copied to
    the host while the mask bits are built, so the host waits for the count kernel only, not
    for the stream (the bits kernels skip their work on the device when the totals say
    "tiles").

    ``lagged`` (the kernels' own planning): decide ``auto`` from the totals of the previous
    counted call with the same shapes and block sizes when there was one (alike calls count
    every :data:`~.gather_verdicts.LAGGED_SAMPLE_EVERY`-th time), so the host does not wait
    at all: a training step's forward would otherwise wait for the previous step's backward
    to drain before it can queue its own kernels. When those totals have not reached the host yet (the host
    runs more than a call ahead of the device), the previous call's own verdict serves:
    waiting for them would drain the device's queue and leave the GPU idle for a good part
    of the forward. Either choice computes the same attention; only its speed depends on
    the choice.
    """
    policy = gather_policy(kernel) if policy is None else policy
    if policy == "never" or not gather_eligible(mask, bias, seqlen_q, seqlen_k, block_m):
        return None
    if policy == "auto" and seqlen_k < 4 * block_n:
        return None
    union_u8, rows_per_tile = tile_union(mask, summary, block_m)
    auto = policy == "auto"
    # While a CUDA graph is captured no event may be waited on or queried: the plan follows
    # what the host already knows, else tile lists (correct whatever the totals).
    capturing = mask.is_cuda and torch.cuda.is_current_stream_capturing()
    memo_key = None
    verdict = None  # True: gather, False: tiles, None: from this call's own totals
    sample = True  # this call counts its tiles for the verdicts of later calls
    if auto and lagged:
        memo_key = (mask.device, tuple(mask.shape), seqlen_q, seqlen_k, bool(is_causal),
                    block_m, block_n)
        verdict, sample = lagged_verdict(memo_key, capturing)
    if auto and capturing and verdict is None:
        verdict = False
    count = auto and sample and not capturing
    if verdict is False and not count:
        return None  # decided on tile lists, and nothing to count for later calls
    idx, cnt, totals = compact_keys(union_u8, rows_per_tile, seqlen_q, seqlen_k, is_causal,
                                    block_m, block_n, count)
    on_host = TotalsToHost(totals, verdict) if count else None
    if memo_key is not None and on_host is not None:
        remember_totals(memo_key, on_host)
    if verdict is False:
        return None
    skip_check = totals if verdict is None else None  # a decided plan is built whatever they say
    if summary is not None and summary.key_bits is not None and block_m % 64 == 0:
        # The summary's key bits hold the mask (and causality) at an eighth of its size.
        gbits = gather_key_bits(summary.key_bits, idx, cnt, seqlen_q, block_m, skip_check)
    else:
        gbits = gather_mask_bits(mask.view(torch.uint8), union_u8, rows_per_tile, seqlen_q,
                                 block_m, is_causal, skip_check)
    gbias = (gather_bias(bias, idx, cnt, seqlen_k, skip_check)
             if bias_per_key(bias, seqlen_k) else None)
    if verdict is None and on_host is not None and not on_host.gathers(False):
        return None
    return KeyGather(block_m=block_m, head_div=num_heads // mask.shape[1],
                     idx=idx, cnt=cnt, gbits=gbits, gbias=gbias)
