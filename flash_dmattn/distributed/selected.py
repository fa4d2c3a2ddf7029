"""Context parallelism that moves only the selected keys.

When the mask is a :class:`~flash_dmattn.KeyIntervals` known in full on every rank (global key
order, global query positions), every rank can work out, without asking, which of rank ``s``'s
keys rank ``r``'s queries see: key ``j`` (position ``p_j``) is needed for batch ``b`` and
selection head ``h`` iff its interval ``[start, end)`` (with ``start`` raised to ``p_j`` when
causal) meets one of ``r``'s query segments. So each rank:

1. sends every other rank exactly the K/V rows (and per-key bias values) it needs, and receives
   the rows it needs, all at once (point-to-point);
2. attends to ``[received keys ; its own keys]`` in **one** local call: the received rows are
   packed into ``M`` columns per selection head (head ``h``'s ``m``-th column is its ``m``-th
   needed key; the shorter lists are padded with keys whose interval is empty), placed before
   its own ``n`` keys, and every column's interval is translated to the call's rows. One call
   per pass means no merging of partial outputs, no second dQ accumulator and no summing of
   partial gradients: the call's output, log-sum-exp and dQ are the result.

With the received columns first, the call keeps the kernels' causal rule (key column ``c``
visible from row ``i`` iff ``c <= i + Lk - Lq``, bottom-right aligned): it shows every
received column to every row (their intervals carry the causal limit) and, on the own columns,
is the shard's own causal rule (a layout's shard against its own keys is one causal call).

The backward is the same call's backward; each received column's dK/dV (and dbias) goes back to
its owner, which adds it to its own. Traffic per rank and pass is the needed rows
(``2·Hkv/Hs·D`` values and the bias values each), whatever the sequence length: for a top-W
selection about ``W`` per (peer, head), so it grows with ``W·P``, not with ``L``.

:func:`context_parallel_dma_attention` adds the selection of Dynamic Mask Attention: the per-key
bias is all-gathered (``L`` values per head), every rank runs the same
:func:`~flash_dmattn.utils.mask.topk_intervals` on it, and the above does the rest.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
from torch import Tensor

from ..inputs import AttentionInputs, resolve_deterministic
from ..masks import KeyIntervals
from ..planning.selection import topk_intervals
from .comm import Group, Transfer, phase
from .layout import check_layout, check_lengths, unshard_sequence
from .local import (
    LocalKernel,
    accumulation_dtype,
    choose_backend,
    pad4,
    take_segments,
    translate_bounds,
)
from .ring import agreed_rows, check_devices, check_shards

__all__ = ["context_parallel_selected_attention", "context_parallel_dma_attention"]


# The start and end of a padding query range (a rank with fewer pieces): no interval meets it.
_FAR = 1 << 62


def _device_ints(values, device) -> Tensor:
    """int64 ``values`` on ``device`` without a host wait: staged in pinned memory on a GPU, so
    that the copy is queued in stream order (a copy from pageable memory may wait for the
    stream)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _trues_first(flags: Tensor) -> Tensor:
    """int64: the indices of the 1-D bool ``flags``, the True entries first, each group in
    order. ``out[:count]`` (``count`` the number of Trues) is ``flags.nonzero()[:, 0]``, made
    before the host knows ``count``: a stable partition (each True entry's index goes to its
    rank among the Trues, each False one's after them; every slot written once,
    deterministic)."""
    n = flags.numel()
    idx = torch.arange(n, device=flags.device)
    if n == 0:
        return idx
    upto = torch.cumsum(flags, 0)  # Trues up to and including each entry
    target = torch.where(flags, upto - 1, idx - upto + upto[-1])
    return torch.empty_like(idx).scatter_(0, target, idx)


def _meets(lo: Tensor, hi: Tensor, ranges) -> Tensor:
    """bool: ``[lo, hi)`` is not empty and meets one of ``ranges`` (``(start, end)`` pairs,
    numbers or tensors that broadcast with ``lo``)."""
    hit = None
    for a, e in ranges:
        h = (lo < e) & (hi > a)
        hit = h if hit is None else hit.logical_or_(h)
    return hit.logical_and_(lo < hi)


def _decode_rows(flat: Tensor, heads: int, n: int) -> Tensor:
    """Row ``(b·n + j)·heads + h`` of K/V seen as rows (:meth:`_Plan.rows`), from the flat
    index ``(b·heads + h)·n + j`` of a ``(B, heads, n)`` tensor."""
    bh, j = flat // n, flat % n
    b, h = bh // heads, bh % heads
    return (b * n + j) * heads + h


class Selection:
    """Which rows move between which ranks, and the columns of the rank's local call; the same
    arithmetic on every rank.

    Rows are K/V viewed as ``(B·n·Hs, (Hkv/Hs)·D)``: row ``(b·n + j)·Hs + h`` is key ``j`` of
    batch ``b`` for selection head ``h`` (all the kv heads that head covers). The local call's
    K/V are ``(B, M + n, Hkv, D)``: the ``M`` received columns, then the ``n`` own keys; its
    rows are numbered the same way with ``M + n`` keys a batch.

    One host synchronisation (the buffer sizes: rows to send to and receive from each peer,
    the padded width of each peer's columns, the rows any peer needs). Everything that does not
    need those sizes is queued before it (the flags and their stable partitions); after it only
    the indices are read off the partitions, each set when it is first needed: the rows to send
    at once, the received rows' places while they travel (:meth:`locate_received`), the
    gradients' places in the backward (:meth:`locate_returned`). A group of one rank moves
    nothing and builds nothing.

    Attributes, in peer order (peers ascending, each peer's rows in its ``(b, h, j)`` order):
    ``send_index`` (own rows sent, all peers), ``send_rows`` / ``recv_rows`` (rows per peer),
    ``recv_index`` (the received rows' rows in the local call), ``recv_block_index`` (the same
    among the ``B·M·Hs`` rows of the received columns alone), ``col_bounds`` (the received
    columns' bounds, global query positions, causal folded in, ``(2, B, Hs, M)``),
    ``union_pos`` (where each sent row lies among the own keys any peer needs), ``union_index``
    (those keys' rows in the local call).
    """

    def __init__(self, grp: Group, segments, bounds: Tensor, batch: int, is_causal: bool) -> None:
        world, me = grp.size, grp.rank
        device = bounds.device
        heads = bounds.shape[2]
        self.heads, self.batch = heads, batch
        self.peers = [p for p in range(world) if p != me]
        self.query_ranges = tuple((a, a + m) for a, m in segments[me])
        lengths = [sum(m for _, m in segs) for segs in segments]
        n = self.keys = lengths[me]
        self.send_rows: Dict[int, int] = {}
        self.recv_rows: Dict[int, int] = {}
        self.send_index: Optional[Tensor] = None
        self.recv_index: Optional[Tensor] = None
        self.recv_block_index: Optional[Tensor] = None
        self.union_index: Optional[Tensor] = None
        self.union_pos: Optional[Tensor] = None
        self.width = 0  # M: received columns per (batch, selection head)
        self.col_bounds: Optional[Tensor] = None
        self._received = self._returned = None  # what locate_* read, until they have run
        if not self.peers:
            return
        L = bounds.shape[-1]
        full = bounds.expand(2, batch, heads, L)
        lo, hi = full[0], full[1]
        if is_causal:
            lo = torch.maximum(lo, torch.arange(L, device=device, dtype=lo.dtype))
        # To send: which rank's queries see each own key (local order), (world, B, Hs, n).
        most = max(len(segs) for segs in segments)
        ranges = [[(a, a + m) for a, m in segs] + [(_FAR, _FAR)] * (most - len(segs))
                  for segs in segments]
        query_bounds = _device_ints(ranges, device).view(world, most, 2, 1, 1, 1)
        own_lo, own_hi = take_segments(lo, segments[me]), take_segments(hi, segments[me])
        send_need = _meets(own_lo, own_hi, [(query_bounds[:, i, 0], query_bounds[:, i, 1])
                                            for i in range(most)])
        send_need[me] = False
        union = send_need.any(0)  # (B, Hs, n): own keys some peer needs
        # To receive: each peer's keys (its local order) this rank's queries see, padded to the
        # longest peer's shard, (peers, B, Hs, longest).
        mine = _meets(lo, hi, self.query_ranges)  # (B, Hs, L), global order
        longest = max(lengths[s] for s in self.peers)
        recv_need = torch.zeros(len(self.peers), batch, heads, longest, dtype=torch.bool,
                                device=device)
        table = []  # per peer: first piece's start and length, second piece's start
        for t, s in enumerate(self.peers):
            col = 0
            for a, m in segments[s]:
                recv_need[t, :, :, col:col + m] = mine[..., a:a + m]
                col += m
            (a0, m0), (a1, _) = segments[s][0], segments[s][-1]
            table.append((a0, m0, a1))
        per_head = recv_need.sum(-1)  # (peers, B, Hs)
        widths = per_head.amax((1, 2))
        sizes = torch.cat([send_need.sum((1, 2, 3)), per_head.sum((1, 2)), widths,
                           union.sum().view(1)])
        # What needs no sizes, queued before the wait: the partitions, each received key's
        # slot in its peer's columns, the peers' column offsets.
        send_order = _trues_first(send_need.view(-1))
        recv_order = _trues_first(recv_need.view(-1))
        union_order = _trues_first(union.view(-1))
        union_rank = torch.cumsum(union.view(-1), 0) - 1
        slots = (torch.cumsum(recv_need, -1) - 1).view(-1)
        offsets = torch.cumsum(widths, 0) - widths
        table = _device_ints(table, device)

        sizes = sizes.tolist()  # the one host synchronisation
        k = len(self.peers)
        send_counts = sizes[:world]
        self.send_rows = {p: send_counts[p] for p in self.peers}
        self.recv_rows = dict(zip(self.peers, sizes[world:world + k]))
        self.width = sum(sizes[world + k:world + 2 * k])
        n_union = sizes[-1]

        # Rows sent (peer order; send_need[me] is empty), and where each lies among the own
        # keys any peer needs.
        flat = send_order[:sum(send_counts)] % (batch * heads * n)  # (b, h, j) flat
        self.send_index = _decode_rows(flat, heads, n)
        self.union_pos = union_rank[flat]
        self._received = (full, recv_order, slots, offsets, table, longest, is_causal)
        self._returned = union_order[:n_union]

    def locate_received(self) -> None:
        """Set ``recv_index``, ``recv_block_index`` and ``col_bounds`` (once)."""
        if self._received is None:
            return
        full, recv_order, slots, offsets, table, longest, is_causal = self._received
        self._received = None
        batch, heads, n, M = self.batch, self.heads, self.keys, self.width
        # Received rows: their peer t, (b, h), the peer's key j, and their column (slot).
        f = recv_order[:sum(self.recv_rows.values())]
        t, rest = f // (batch * heads * longest), f % (batch * heads * longest)
        b, h, j = rest // (heads * longest), (rest // longest) % heads, rest % longest
        slot = slots[f] + offsets[t]
        self.recv_block_index = (b * M + slot) * heads + h
        self.recv_index = self.recv_block_index + b * (n * heads)
        # Bounds of the received columns in global query positions, causal folded into the
        # start; padding columns keep the empty interval [0, 0).
        a0, m0, a1 = table[t, 0], table[t, 1], table[t, 2]
        pos = torch.where(j < m0, a0 + j, a1 + j - m0)
        start, end = full[0][b, h, pos].to(torch.int64), full[1][b, h, pos].to(torch.int64)
        if is_causal:
            start = torch.maximum(start, pos)
        col_bounds = torch.zeros(2, batch * heads * M, dtype=torch.int64, device=f.device)
        col_bounds[:, (b * heads + h) * M + slot] = torch.stack([start, end])
        self.col_bounds = col_bounds.view(2, batch, heads, M)

    def locate_returned(self) -> None:
        """Set ``union_index`` (once): the rows of the local call where the peers' gradients of
        the own keys are added."""
        if self._returned is None:
            return
        union_keys, self._returned = self._returned, None
        heads, n = self.heads, self.keys
        own = _decode_rows(union_keys, heads, n)
        # ... in the local call: b·M + M columns before own key (b, j)
        self.union_index = own + (own // (n * heads) + 1) * (self.width * heads)

    def exchange(self, grp: Group, purpose: str, sends: Sequence[Tensor], recvs: Sequence[Tensor],
                 sent_rows: Dict[int, int], received_rows: Dict[int, int]) -> Transfer:
        """Start one batch of point-to-point transfers: each tensor of ``sends`` holds the rows
        for every peer (peer order, ``sent_rows[p]`` each), each of ``recvs`` receives every
        peer's (``received_rows[p]`` each). Both sides issue a peer's operations in the same
        order: its sends, then its receives."""
        ops = []
        out_at = in_at = 0
        for p in self.peers:
            a, b = sent_rows[p], received_rows[p]
            ops += [("send", p, t[out_at:out_at + a]) for t in sends]
            ops += [("recv", p, t[in_at:in_at + b]) for t in recvs]
            out_at, in_at = out_at + a, in_at + b
        return grp.exchange(purpose, ops)


class _Plan:
    """A selected-keys call: its selection, the local kernel and its arguments, and the layout
    of the local call's columns."""

    def __init__(self, grp: Group, sel: Selection, kernel: LocalKernel, kv_heads: int,
                 bias_heads: Optional[int], batch: int, is_causal: bool, scale: float,
                 softcap: float, deterministic: bool, keep_plans: bool) -> None:
        self.grp, self.sel, self.kernel = grp, sel, kernel
        self.batch = batch
        self.is_causal = is_causal
        self.scale, self.softcap, self.deterministic = scale, softcap, deterministic
        self.keep_plans = keep_plans  # the forward's kernel plan kept for the backward
        self.kv_per_row = kv_heads // sel.heads  # kv heads per selection head
        # Bias values per row: a bias of Hb heads seen as max(Hb, Hs) heads, Hs of them a row.
        self.bias_heads = None if bias_heads is None else max(bias_heads, sel.heads)
        # The window promise as the call passes it: its columns' positions are the own keys'
        # when nothing is received, anywhere otherwise (see LocalKernel.window_for).
        self.key_ranges = sel.query_ranges if sel.width == 0 else None

    def rows(self, t: Tensor) -> Tensor:
        """K or V ``(B, keys, Hkv, D)`` as rows ``(B·keys·Hs, Hkv/Hs·D)``."""
        return t.view(-1, self.kv_per_row * t.shape[-1])

    def bias_rows(self, bias: Tensor) -> Tensor:
        """A per-key bias ``(Bb, Hb, 1, n)`` as rows ``(B·n·Hs, max(Hb, Hs)/Hs)``."""
        n = bias.shape[-1]
        full = bias[:, :, 0].expand(self.batch, self.bias_heads, n)
        return full.permute(0, 2, 1).reshape(-1, self.bias_heads // self.sel.heads)

    def sum_to(self, grad: Tensor, shape) -> Tensor:
        """A gradient ``(B, max(Hb, Hs), 1, n)`` summed over the dims ``shape`` broadcasts."""
        if shape[1] == 1 and grad.shape[1] > 1:
            grad = grad.sum(1, keepdim=True)
        if shape[0] == 1 and grad.shape[0] > 1:
            grad = grad.sum(0, keepdim=True)
        return grad

    def columns(self, t: Tensor) -> Tensor:
        """The local call's K or V: ``t`` when nothing is received, else ``(B, M + n, Hkv, D)``
        with ``t`` in its last ``n`` columns and zeros in the received ones (filled by
        :meth:`place` once they arrive)."""
        M = self.sel.width
        if M == 0:
            return t
        out = t.new_empty(t.shape[0], M + t.shape[1], *t.shape[2:])
        out[:, M:].copy_(t)
        out[:, :M].zero_()
        return out

    def place(self, cols: Tensor, received: Tensor) -> None:
        """Write the received K or V rows into their columns of the local call."""
        self.rows(cols).index_copy_(0, self.sel.recv_index, received)

    def call_bias(self, bias: Tensor, received: Optional[Tensor]) -> Tensor:
        """The local call's bias: ``bias`` when nothing is received, else ``(B, max(Hb, Hs), 1,
        M + n)``, the received values (zeros in the padding) and then ``bias``."""
        sel, M = self.sel, self.sel.width
        if M == 0:
            return bias
        block = received.new_zeros(self.batch * M * sel.heads, received.shape[1])
        block.index_copy_(0, sel.recv_block_index, received)
        remote = block.view(self.batch, M, self.bias_heads).permute(0, 2, 1).unsqueeze(2)
        own = bias.expand(self.batch, self.bias_heads, 1, bias.shape[-1])
        return torch.cat([remote, own], -1)

    def call_bounds(self, own_bounds: Tensor) -> Tensor:
        """The local call's key-interval bounds, translated to its rows: the received columns'
        (causal folded in), then the own keys' (the call's causal rule limits those)."""
        sel, M, n = self.sel, self.sel.width, self.sel.keys
        if M == 0:
            return translate_bounds(own_bounds, sel.query_ranges, n, n)
        own = own_bounds.expand(2, self.batch, sel.heads, n).to(torch.int64)
        return translate_bounds(torch.cat([sel.col_bounds, own], -1), sel.query_ranges, n, M + n)


class _SelectedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, q, k, v, bias, own_bounds):
        sel, kernel = plan.sel, plan.kernel
        q, k, v = (t.contiguous() for t in (q, k, v))
        sends = [plan.rows(k), plan.rows(v)]
        if bias is not None:
            sends.append(plan.bias_rows(bias.detach()))
        transfer, got = None, []
        if sel.peers:
            with phase("send_kv"):
                got = [t.new_empty(sum(sel.recv_rows.values()), t.shape[1]) for t in sends]
                transfer = sel.exchange(plan.grp, "kv",
                                        [t.index_select(0, sel.send_index) for t in sends],
                                        got, sel.send_rows, sel.recv_rows)
        # While the rows travel: the call's own columns and bounds.
        with phase("columns"):
            k_call, v_call = plan.columns(k), plan.columns(v)
            sel.locate_received()
            bounds = plan.call_bounds(own_bounds)
        if transfer is not None:
            with phase("wait_kv"):
                transfer.wait()
        with phase("place_kv"):
            if sel.width > 0:
                plan.place(k_call, got[0])
                plan.place(v_call, got[1])
            bias_call = None
            if bias is not None:
                bias_call = plan.call_bias(bias.detach(), got[2] if sel.width > 0 else None)
        with phase("local_forward"):
            out, lse, kernel_plan = kernel.forward(
                q, k_call, v_call, None, bias_call, bounds, plan.scale, plan.is_causal,
                plan.softcap, plan.deterministic, sel.query_ranges, plan.keep_plans,
                plan.key_ranges)
        ctx.save_for_backward(q, k_call, v_call, bias_call, bounds, out, lse)
        ctx.plan = plan
        ctx.kernel_plan = kernel_plan
        ctx.bias_shape = None if bias is None else (tuple(bias.shape), bias.dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        plan: _Plan = ctx.plan
        sel, kernel = plan.sel, plan.kernel
        q, k_call, v_call, bias_call, bounds, out, lse = ctx.saved_tensors
        kernel_plan, ctx.kernel_plan = ctx.kernel_plan, None
        need_q, need_k, need_v = ctx.needs_input_grad[1:4]
        need_bias = ctx.bias_shape is not None and ctx.needs_input_grad[4]
        M = sel.width
        with phase("local_backward"):
            dq, dk, dv, db = kernel.backward(
                dout.contiguous(), q, k_call, v_call, None, bias_call, bounds, out, lse,
                plan.scale, plan.is_causal, plan.softcap, plan.deterministic,
                (need_q, need_k, need_v, need_bias), sel.query_ranges, kernel_plan,
                plan.key_ranges)

        if sel.peers:
            # The received columns' gradients go back to their owners; the peers' gradients of
            # the own keys come in, each peer's rows in the order this rank sent them.
            sends, recvs = [], []
            sel.locate_returned()
            with phase("send_grad"):
                for g, need in ((dk, need_k), (dv, need_v)):
                    if need:
                        rows = plan.rows(g)
                        sends.append(rows.index_select(0, sel.recv_index))
                        recvs.append(rows.new_empty(sel.send_index.numel(), rows.shape[1]))
                if need_bias:
                    remote = db[:, :, 0, :M].permute(0, 2, 1).reshape(
                        -1, plan.bias_heads // sel.heads)
                    sends.append(remote.index_select(0, sel.recv_block_index))
                    recvs.append(remote.new_empty(sel.send_index.numel(), remote.shape[1]))
                transfer = sel.exchange(plan.grp, "grad", sends, recvs, sel.recv_rows,
                                        sel.send_rows)
            with phase("wait_grad"):
                transfer.wait()
            acc = accumulation_dtype(q.dtype)
            i = 0
            with phase("add_grad"):
                for g, need in ((dk, need_k), (dv, need_v)):
                    if need:
                        # Own value + every peer's, summed in the accumulation dtype and
                        # rounded once; only the rows some peer needs are touched.
                        rows = plan.rows(g)
                        part = rows.index_select(0, sel.union_index).to(acc)
                        part.index_add_(0, sel.union_pos, recvs[i].to(acc))
                        rows.index_copy_(0, sel.union_index, part.to(rows.dtype))
                        i += 1
        dk = _own_columns(dk, M) if need_k else None
        dv = _own_columns(dv, M) if need_v else None
        dbias = None
        if need_bias:
            shape, dtype = ctx.bias_shape
            own = db[..., M:]
            if sel.peers:
                acc = accumulation_dtype(q.dtype)
                rows = torch.zeros(plan.batch * sel.keys * sel.heads, recvs[-1].shape[1],
                                   dtype=acc, device=q.device)
                rows.index_add_(0, sel.send_index, recvs[-1].to(acc))
                peers = rows.view(plan.batch, sel.keys, plan.bias_heads).permute(0, 2, 1)
                own = plan.sum_to(own.to(acc), shape) + plan.sum_to(peers.unsqueeze(2), shape)
            else:
                own = plan.sum_to(own, shape)
            dbias = own.to(dtype)
        return None, (dq if need_q else None), dk, dv, dbias, None


def _own_columns(grad: Tensor, M: int) -> Tensor:
    """The own keys' part of a gradient of the local call's K or V (its last columns)."""
    if M == 0:
        return grad
    return grad[:, M:].contiguous()


def _check_selected(query, key, value, intervals, bias, shard_len: int, total: Optional[int]):
    """This rank's own checks of a selected-keys call. ``total``: the sequence length, when
    known (else the intervals' key dim is taken as it, and checked once the ranks agree)."""
    B, H, Hkv = query.shape[0], query.shape[2], key.shape[2]
    if not isinstance(intervals, KeyIntervals):
        raise TypeError(f"intervals must be a KeyIntervals, got {type(intervals).__name__}")
    bx, hs, lk = intervals.bounds.shape[1:]
    if (total is not None and lk != total) or bx not in (1, B) or Hkv == 0 or hs not in (1, Hkv):
        raise ValueError(
            f"intervals must cover the whole sequence on every rank: start/end of shape "
            f"(1|B, 1|Hkv, L) = (1|{B}, 1|{Hkv}, {'L' if total is None else total}); got "
            f"{(bx, hs, lk)}"
        )
    bias4 = pad4("attn_bias", bias)
    if bias4 is not None:
        bb, hb, qx, kx = bias4.shape
        if bb not in (1, B) or hb not in (1, Hkv, H) or qx != 1 or kx != shard_len:
            raise ValueError(
                f"attn_bias must be this rank's per-key shard (1|B, 1|Hkv|H, 1, n) = "
                f"(1|{B}, 1|{Hkv}|{H}, 1, {shard_len}); got {tuple(bias4.shape)}"
            )
    check_devices(query, key, value, intervals.bounds, bias4)
    return bias4


def _selected(grp: Group, layout: str, segments, query, key, value, intervals: KeyIntervals,
              bias4, softmax_scale, is_causal, softcap, deterministic, backend) -> Tensor:
    """The selected-keys call once the ranks agree on ``segments`` (every rank's) and the
    arguments passed their checks."""
    B, Hkv = query.shape[0], key.shape[2]
    bounds = intervals.bounds
    own_bounds = take_segments(bounds, segments[grp.rank]).contiguous()
    # Validation and dispatch as the local kernels see the rank's queries against its own keys
    # (the shapes of that call: its bounds' values are not read, so they are not translated).
    inputs = AttentionInputs.from_args(query, key, value, KeyIntervals.from_bounds(own_bounds), bias4,
                                       softmax_scale, bool(is_causal), softcap, deterministic)
    # A selection's window promise holds for the local call (its queries keep a subset of
    # their keys): the kernels then plan without waiting for the device.
    kernel = LocalKernel(choose_backend(inputs, backend), intervals.window or 0)
    # The local call's plan is kept for the backward when there will be one.
    keep = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, bias4))
    with phase("selection"):
        sel = Selection(grp, segments, bounds, B, bool(is_causal))
    plan = _Plan(grp, sel, kernel, Hkv, None if bias4 is None else bias4.shape[1], B,
                 bool(is_causal), inputs.softmax_scale, inputs.softcap, inputs.deterministic, keep)
    return _SelectedAttention.apply(plan, query, key, value, bias4, own_bounds)


def _agree(grp: Group, layout: str, query, check, seq_len: Optional[int]) -> list:
    """This rank's checks (``check()``, returning its shard length), every rank's shard length
    (exchanged, or from ``seq_len``: :func:`~.ring.agreed_rows`), and the layout's segments of
    every rank."""
    device = query.device if isinstance(query, Tensor) else torch.device("cpu")
    error, shard_len = None, 0
    try:
        shard_len = check()
    except (TypeError, ValueError) as exc:
        error = exc
    lengths = [r[0] for r in agreed_rows(grp, device, [shard_len], error, layout, seq_len)]
    return list(check_lengths(layout, lengths))


def context_parallel_selected_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    intervals: KeyIntervals,
    attn_bias: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    is_causal: bool = False,
    softcap: Optional[float] = None,
    deterministic: Optional[bool] = None,
    *,
    group=None,
    mesh_dim=None,
    layout: str = "contiguous",
    backend: Optional[str] = None,
    seq_len: Optional[int] = None,
) -> Tensor:
    """Attention under a key-interval mask over a sequence split across ``group``, moving only
    the keys each rank's queries see.

    Equivalent to ``flash_dmattn_func(q, k, v, attn_mask=intervals, attn_bias=bias,
    is_causal=...)`` on the whole sequence, this rank's rows returned.

    Args:
        query, key, value: this rank's shards, as :func:`context_parallel_attention`.
        intervals: the mask of the *whole* sequence, the same on every rank: start/end of shape
            ``(1|B, 1|Hkv, L)`` in global key order, bounds in global query positions.
        attn_bias: None or this rank's per-key shard ``(1|B, 1|Hkv|H, 1, n)``; its values
            travel with the selected keys and its gradient comes back with theirs.
        softmax_scale, is_causal, softcap, deterministic, group, mesh_dim, layout, backend,
            seq_len: as :func:`context_parallel_attention`.

    Each rank sends and receives the needed K/V rows once per pass (the forward's rows, then
    their gradients in the backward); the received keys are kept for the backward.
    ``requires_grad`` of query, key, value and bias must be the same on every rank.
    """
    grp = Group(group, mesh_dim)
    deterministic = resolve_deterministic(deterministic)
    layout = check_layout(layout)
    checked = {}

    def check() -> int:
        n = check_shards(query, key, value)
        checked["bias"] = _check_selected(query, key, value, intervals, attn_bias, n, None)
        return n

    segments = _agree(grp, layout, query, check, seq_len)
    total = sum(n for segs in segments for _, n in segs)
    if intervals.bounds.shape[-1] != total:  # the same on every rank: the key dim vs sum(n)
        _check_selected(query, key, value, intervals, attn_bias, query.shape[1], total)
    return _selected(grp, layout, segments, query, key, value, intervals, checked["bias"],
                     softmax_scale, is_causal, softcap, deterministic, backend)


def context_parallel_dma_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_bias: Tensor,
    window_size: int,
    is_causal: bool = True,
    softmax_scale: Optional[float] = None,
    softcap: Optional[float] = None,
    deterministic: Optional[bool] = None,
    *,
    min_dtype: Optional[float] = None,
    group=None,
    mesh_dim=None,
    layout: str = "contiguous",
    backend: Optional[str] = None,
    return_intervals: bool = False,
    seq_len: Optional[int] = None,
):
    """Dynamic Mask Attention over a sequence split across ``group``: each query keeps the
    ``window_size`` keys of largest bias (among its causal prefix when ``is_causal``), and only
    those keys' K/V move between ranks.

    Equivalent on the whole sequence to::

        mask = topk_intervals(bias, window_size, is_causal=is_causal, min_dtype=min_dtype)
        flash_dmattn_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=is_causal)

    Args:
        attn_bias: this rank's shard of the per-key bias, ``(1|B, 1|Hkv, 1, n)`` (e.g. from
            :func:`flash_dmattn.dynamic_mask_bias` on this rank's values); it ranks the keys
            (no gradient through the selection) and is added to the scores (with gradient).
            Keys whose bias is ``<= min_dtype`` (default: the dtype's lowest value, e.g.
            padding) are never selected.
        window_size: W, keys kept per query.
        return_intervals: also return the selection (``KeyIntervals`` of the whole sequence,
            the same on every rank).

    The other arguments are those of :func:`context_parallel_selected_attention`. Traffic:
    one all-gather of the bias shard (``(1|B)·(1|Hkv)·L`` values), then the selected rows.
    """
    grp = Group(group, mesh_dim)
    deterministic = resolve_deterministic(deterministic)
    layout = check_layout(layout)
    checked = {}

    def check() -> int:
        n = check_shards(query, key, value)
        bias4 = pad4("attn_bias", attn_bias)
        if bias4 is None or bias4.shape[2] != 1 or bias4.shape[3] != n or \
                bias4.shape[1] not in (1, key.shape[2]) or bias4.shape[0] not in (1, query.shape[0]):
            raise ValueError(
                f"attn_bias must be this rank's per-key bias shard (1|B, 1|Hkv, 1, n) = "
                f"(1|{query.shape[0]}, 1|{key.shape[2]}, 1, {n}); got "
                f"{None if bias4 is None else tuple(bias4.shape)}"
            )
        check_devices(query, key, value, bias4)
        checked["bias"] = bias4
        return n

    segments = _agree(grp, layout, query, check, seq_len)
    bias4 = checked["bias"]
    lengths = [sum(n for _, n in segs) for segs in segments]
    with phase("gather_bias"):
        pieces = grp.all_gather("bias", bias4.detach(), lengths)
        whole = unshard_sequence(pieces, layout, dim=-1)
    with phase("topk"):
        intervals = topk_intervals(whole, window_size, is_causal=bool(is_causal),
                                   min_dtype=min_dtype)
    out = _selected(grp, layout, segments, query, key, value, intervals, bias4, softmax_scale,
                    is_causal, softcap, deterministic, backend)
    return (out, intervals) if return_intervals else out
