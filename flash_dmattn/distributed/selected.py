"""Context parallelism that moves only the selected keys.

When the mask is a :class:`~flash_dmattn.KeyIntervals` known in full on every rank (global key
order, global query positions), every rank can work out, without asking, which of rank ``s``'s
keys rank ``r``'s queries see: key ``j`` (position ``p_j``) is needed for batch ``b`` and
selection head ``h`` iff its interval ``[start, end)`` (with ``start`` raised to ``p_j`` when
causal) meets one of ``r``'s query segments. So each rank:

1. sends every other rank exactly the K/V rows (and per-key bias values) it needs, and receives
   the rows it needs, all at once (point-to-point), while it computes its queries against its
   own keys;
2. packs the received rows into one ``(B, M, Hkv, D)`` block per selection head (head ``h``'s
   ``m``-th column is its ``m``-th needed key; the shorter lists are padded with keys whose
   interval is empty) and attends to it with the translated intervals, causal folded into them;
3. merges the two results by log-sum-exp.

The backward sends each received row's dK/dV (and dbias) back to its owner, which adds them to
its own. Traffic per rank and pass is the needed rows (``2·Hkv/Hs·D`` values and the bias
values each), whatever the sequence length: for a top-W selection about ``W`` per
(peer, head), so it grows with ``W·P``, not with ``L``.

:func:`context_parallel_dma_attention` adds the selection of Dynamic Mask Attention: the per-key
bias is all-gathered (``L`` values per head), every rank runs the same
:func:`~flash_dmattn.utils.mask.topk_intervals` on it, and the above does the rest.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import Tensor

from ..inputs import AttentionInputs
from ..masks import KeyIntervals
from ..planning.selection import topk_intervals
from .comm import Group
from .layout import check_layout, check_lengths, segment_positions, unshard_sequence
from .local import (
    Accumulator,
    Aux,
    LocalKernel,
    Merger,
    accumulation_dtype,
    choose_backend,
    pad4,
    max_terms,
    take_segments,
    translate_bounds,
)
from .ring import Setup, agreed_rows, check_devices, check_shards

__all__ = ["context_parallel_selected_attention", "context_parallel_dma_attention"]


# The start and end of a padding query range (a rank with fewer pieces): no interval meets it.
_FAR = 1 << 62


def _device_ints(values, device) -> Tensor:
    """int64 ``values`` on ``device`` without a host wait (an asynchronous copy: the host's
    list is staged at once, the device copies it in stream order)."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def _true_positions(flags: Tensor, count: int) -> Tensor:
    """int64: the indices of the True entries of the 1-D bool ``flags``, in order, given their
    number ``count`` (known on the host): ``flags.nonzero()[:, 0]`` without the host waiting
    to learn its size. A stable partition: each True entry's index goes to its rank among the
    Trues, each False one's after them (every slot written once, deterministic)."""
    n = flags.numel()
    idx = torch.arange(n, device=flags.device)
    before = torch.cumsum(flags, 0) - 1  # Trues before each entry, minus one where it is one
    target = torch.where(flags, before, idx - before - 1 + count)
    out = torch.empty(n, dtype=torch.int64, device=flags.device)
    out.scatter_(0, target, idx)
    return out[:count]


class Selection:
    """Which rows move between which ranks; the same arithmetic on every rank.

    Rows are K/V viewed as ``(B·n·Hs, (Hkv/Hs)·D)``: row ``(b·n + j)·Hs + h`` is key ``j`` of
    batch ``b`` for selection head ``h`` (all the kv heads that head covers).

    One host synchronisation (the buffer sizes: rows to send to and receive from each peer,
    the padded width of each peer's columns, the rows any peer needs); every index is then
    built on the device from those sizes (no ``nonzero``, no boolean indexing). A group of one
    rank moves nothing and builds nothing.
    """

    def __init__(self, grp: Group, segments, bounds: Tensor, batch: int, is_causal: bool) -> None:
        world, me = grp.size, grp.rank
        device = bounds.device
        heads = bounds.shape[2]
        self.heads = heads
        self.peers = [p for p in range(world) if p != me]
        self.query_segments = tuple(segments[me])  # (first global position, rows)
        lengths = [sum(m for _, m in segs) for segs in segments]
        n = lengths[me]
        self.send_rows: Dict[int, int] = {}
        self.recv_rows: Dict[int, int] = {}
        self.send_index: Dict[int, Tensor] = {}
        self.recv_index: Dict[int, Tensor] = {}
        self.union_index: Optional[Tensor] = None  # this rank's rows any peer needs
        self.union_pos: Dict[int, Tensor] = {}  # where a peer's rows are among them
        self.width = 0  # M: columns of the received block
        self.col_bounds: Optional[Tensor] = None
        if not self.peers:
            return
        L = bounds.shape[-1]
        full = bounds.expand(2, batch, heads, L)
        lo, hi = full[0].to(torch.int64), full[1].to(torch.int64)
        if is_causal:
            lo = torch.maximum(lo, torch.arange(L, device=device))
        # seen[r, b, h, j]: rank r's queries see key j (global order) for (b, h), i.e. its
        # interval [lo, hi) meets one of r's query ranges [a, e).
        most = max(len(segs) for segs in segments)
        ranges = [[(a, a + m) for a, m in segs] + [(_FAR, _FAR)] * (most - len(segs))
                  for segs in segments]
        bounds_q = _device_ints(ranges, device).view(world, most, 2, 1, 1, 1)
        seen = None
        for i in range(most):
            hit = (lo < bounds_q[:, i, 1]) & (hi > bounds_q[:, i, 0])  # (world, B, Hs, L)
            seen = hit if seen is None else seen.logical_or_(hit)
        seen.logical_and_(lo < hi)
        # To send: this rank's keys (local order) each rank needs; to receive: each peer's keys
        # this rank needs (that peer's local order).
        send_need = take_segments(seen, segments[me])  # (world, B, Hs, n)
        send_need[me] = False
        recv_need = [take_segments(seen[me], segments[s]) for s in self.peers]  # (B, Hs, n_s)
        per_head = torch.stack([t.sum(-1) for t in recv_need])  # (peers, B, Hs)
        union = send_need.any(0)  # (B, Hs, n)
        sizes = torch.cat([send_need.sum((1, 2, 3)), per_head.sum((1, 2)), per_head.amax((1, 2)),
                           union.sum().view(1)])
        sizes = sizes.tolist()  # the one host synchronisation
        k = len(self.peers)
        send_counts = sizes[:world]
        self.send_rows = {p: send_counts[p] for p in self.peers}
        self.recv_rows = dict(zip(self.peers, sizes[world:world + k]))
        widths = dict(zip(self.peers, sizes[world + k:world + 2 * k]))
        self.width = M = sum(widths.values())
        n_union = sizes[-1]

        # Rows this rank sends to each peer, in (b, h, j) order, and where they are among the
        # rows any peer needs (the backward adds the peers' gradients there).
        per_rank = batch * heads * n
        flat = _true_positions(send_need.reshape(-1), sum(send_counts)) % per_rank  # (b, h, j)
        b, h, j = flat // (heads * n), (flat // n) % heads, flat % n
        rows = (b * n + j) * heads + h
        union_flags = union.view(-1)
        union_rank = torch.cumsum(union_flags, 0) - 1
        u = _true_positions(union_flags, n_union)
        self.union_index = ((u // (heads * n)) * n + u % n) * heads + (u // n) % heads
        for p, part, at in zip(range(world), rows.split(send_counts), flat.split(send_counts)):
            if p != me:
                self.send_index[p] = part
                self.union_pos[p] = union_rank[at]

        # Where each received row goes in the (B·M·Hs) rows of the received block (the
        # sender's (b, h, j) order), and the key position and bounds of every column; a
        # peer's columns are [offset, offset + its width), padding after each head's list.
        col_pos = torch.zeros(batch * heads * M, dtype=torch.int64, device=device)
        live = []
        offset = 0
        for t, s in enumerate(self.peers):
            need, n_s, w = recv_need[t], lengths[s], widths[s]
            f = _true_positions(need.reshape(-1), self.recv_rows[s])
            b, h, j = f // (heads * n_s), (f // n_s) % heads, f % n_s
            slot = (torch.cumsum(need, -1) - 1).view(-1)[f] + offset
            self.recv_index[s] = (b * M + slot) * heads + h
            col_pos.scatter_(0, (b * heads + h) * M + slot,
                             segment_positions(segments[s], device)[j])
            live.append(torch.arange(w, device=device) < per_head[t].unsqueeze(-1))
            offset += w
        col_pos = col_pos.view(batch, heads, M)
        col_live = torch.cat(live, -1) if live else col_pos.new_zeros(batch, heads, 0).bool()
        # Bounds of the received columns in global query positions, causal folded into the
        # start; padding columns get the empty interval.
        cols = full.gather(-1, col_pos.unsqueeze(0).expand(2, batch, heads, M)).to(torch.int64)
        start, end = cols[0], cols[1]
        if is_causal:
            start = torch.maximum(start, col_pos)
        zero = torch.zeros_like(start)
        self.col_bounds = torch.stack([torch.where(col_live, start, zero),
                                       torch.where(col_live, end, zero)])


class _Plan:
    """A selected-keys call: its selection, own-keys setup, kernel and head arithmetic."""

    def __init__(self, st: Setup, sel: Selection, kv_heads: int, bias_heads: Optional[int],
                 batch: int) -> None:
        self.st, self.sel = st, sel
        self.batch = batch
        self.group = kv_heads // sel.heads  # kv heads per selection head
        # Bias values per row: a bias of Hb heads seen as max(Hb, Hs) heads, Hs of them a row.
        self.bias_heads = None if bias_heads is None else max(bias_heads, sel.heads)
        # The received keys, one call for all of this rank's queries (its pieces' rows as one:
        # translate_bounds maps positions to rows).
        self.query_ranges = tuple((a, a + m) for a, m in sel.query_segments)
        self.num_rows = sum(m for _, m in sel.query_segments)

    def rows(self, t: Tensor) -> Tensor:
        """K or V ``(B, n, Hkv, D)`` as rows ``(B·n·Hs, Hkv/Hs·D)``."""
        return t.view(-1, self.group * t.shape[-1])

    def bias_rows(self, bias: Tensor) -> Tensor:
        """A per-key bias ``(Bb, Hb, 1, n)`` as rows ``(B·n·Hs, max(Hb, Hs)/Hs)``."""
        n = bias.shape[-1]
        full = bias[:, :, 0].expand(self.batch, self.bias_heads, n)
        return full.permute(0, 2, 1).reshape(-1, self.bias_heads // self.sel.heads)

    def unrows_bias(self, rows: Tensor, bias_shape) -> Tensor:
        """The inverse of :meth:`bias_rows` for a gradient: summed over broadcast dims."""
        n = bias_shape[-1]
        g = rows.view(self.batch, n, self.bias_heads).permute(0, 2, 1).unsqueeze(2)
        if bias_shape[1] == 1 and self.bias_heads > 1:
            g = g.sum(1, keepdim=True)
        if bias_shape[0] == 1 and self.batch > 1:
            g = g.sum(0, keepdim=True)
        return g

    def received_block(self, parts: List[Tensor], width: int) -> Tensor:
        """Received rows, per peer, packed into ``(B·M·Hs, width)`` (zeros in the padding)."""
        sel = self.sel
        out = parts[0].new_zeros(self.batch * sel.width * sel.heads, width)
        if sel.peers:
            index = torch.cat([sel.recv_index[s] for s in sel.peers])
            out.index_copy_(0, index, torch.cat(parts))
        return out

    def remote_bounds(self) -> Tensor:
        """The received columns' bounds, translated to the rows of the one remote call."""
        return translate_bounds(self.sel.col_bounds, self.query_ranges, self.num_rows,
                                self.sel.width)


class _SelectedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, q, k, v, bias, own_bounds):
        st, sel, kernel = plan.st, plan.sel, plan.st.kernel
        grp = st.group
        q, k, v = (t.contiguous() for t in (q, k, v))
        B, n, H, _ = q.shape
        Hkv, D, Dv = k.shape[2], k.shape[3], v.shape[3]
        keep = st.keep_plans
        k_rows, v_rows = plan.rows(k), plan.rows(v)
        b_rows = plan.bias_rows(bias.detach()) if bias is not None else None
        ops, got_k, got_v, got_b = [], [], [], []
        for p in sel.peers:
            idx = sel.send_index[p]
            ops += [("send", p, k_rows.index_select(0, idx)), ("send", p, v_rows.index_select(0, idx))]
            if b_rows is not None:
                ops.append(("send", p, b_rows.index_select(0, idx)))
            rows = sel.recv_rows[p]
            got_k.append(k_rows.new_empty(rows, k_rows.shape[1]))
            got_v.append(v_rows.new_empty(rows, v_rows.shape[1]))
            ops += [("recv", p, got_k[-1]), ("recv", p, got_v[-1])]
            if b_rows is not None:
                got_b.append(b_rows.new_empty(rows, b_rows.shape[1]))
                ops.append(("recv", p, got_b[-1]))
        transfer = grp.exchange("kv", ops)

        M = sel.width
        me = grp.rank
        own_calls = st.plans[me]
        merger = Merger(B, n, H, Dv, q.dtype, q.device,
                        [c.rows for c in own_calls] + ([(0, n)] if M > 0 else []))
        block = st.travelling(k, v, None, bias, own_bounds)
        own_plans = []
        for call in own_calls:
            args = st.call_args(call, q, block, None, bias, own_bounds)
            out_c, lse_c, kplan = kernel.forward(*args, st.scale, call.causal, st.softcap,
                                                 st.deterministic, call.row_ranges, keep,
                                                 call.key_ranges)
            own_plans.append(kplan)
            merger.add(call.rows, out_c, lse_c)
        transfer.wait()

        k_sel = v_sel = b_sel = bounds_sel = None
        remote_plan = None
        if M > 0:
            k_sel = plan.received_block(got_k, k_rows.shape[1]).view(B, M, Hkv, D)
            v_sel = plan.received_block(got_v, v_rows.shape[1]).view(B, M, Hkv, Dv)
            if b_rows is not None:
                packed = plan.received_block(got_b, b_rows.shape[1])
                b_sel = packed.view(B, M, plan.bias_heads).permute(0, 2, 1).unsqueeze(2).contiguous()
            bounds_sel = plan.remote_bounds()
            out_c, lse_c, remote_plan = kernel.forward(q, k_sel, v_sel, None, b_sel, bounds_sel,
                                                       st.scale, False, st.softcap,
                                                       st.deterministic, plan.query_ranges, keep)
            merger.add((0, n), out_c, lse_c)
        out, lse = merger.result()
        ctx.save_for_backward(q, k, v, bias, own_bounds, out, lse, k_sel, v_sel, b_sel, bounds_sel)
        ctx.plan = plan
        ctx.kernel_plans = (own_plans, remote_plan)
        return out

    @staticmethod
    def backward(ctx, dout):
        plan: _Plan = ctx.plan
        st, sel, kernel = plan.st, plan.sel, plan.st.kernel
        grp = st.group
        q, k, v, bias, own_bounds, out, lse, k_sel, v_sel, b_sel, bounds_sel = ctx.saved_tensors
        own_plans, remote_plan = ctx.kernel_plans
        ctx.kernel_plans = None
        need_q, need_k, need_v = ctx.needs_input_grad[1:4]
        need_bias = bias is not None and ctx.needs_input_grad[4]
        needs = (need_q, need_k, need_v, need_bias)
        acc = accumulation_dtype(q.dtype)
        dout = dout.contiguous()
        n = q.shape[1]
        M = sel.width
        own_calls = st.plans[grp.rank]
        # dQ: the remote call's rows and the own calls', each term added once (no zero-fill).
        dq = (Accumulator(q.shape, 1, ([(0, n)] if M > 0 else []) + [c.rows for c in own_calls],
                          q.dtype, q.device) if need_q else None)

        # Selected keys first, so that their gradients travel while the own keys are computed.
        sends = []
        if M > 0:
            dq_c, dk_sel, dv_sel, db_sel = kernel.backward(
                dout, q, k_sel, v_sel, None, b_sel, bounds_sel, out, lse, st.scale, False,
                st.softcap, st.deterministic, needs, plan.query_ranges, remote_plan)
            if dq_c is not None:
                dq.add((0, n), dq_c)
            if need_k:
                sends.append(plan.rows(dk_sel))
            if need_v:
                sends.append(plan.rows(dv_sel))
            if need_bias:
                db = db_sel[:, :, 0].permute(0, 2, 1)
                sends.append(db.reshape(-1, plan.bias_heads // sel.heads))
        widths = []
        if need_k:
            widths.append((plan.group * k.shape[-1], k.dtype))
        if need_v:
            widths.append((plan.group * v.shape[-1], v.dtype))
        if need_bias:
            widths.append((plan.bias_heads // sel.heads, bias.dtype))
        ops, got = [], {p: [] for p in sel.peers}
        for p in sel.peers:
            for t in sends:
                ops.append(("send", p, t.index_select(0, sel.recv_index[p])))
            for width, dtype in widths:
                buf = torch.empty(sel.send_rows[p], width, dtype=dtype, device=q.device)
                got[p].append(buf)
                ops.append(("recv", p, buf))
        transfer = grp.exchange("grad", ops)

        # The own keys: dK, dV, dbias summed over the own calls (one call for a layout's shard:
        # its gradients are the result as they come), then the peers' rows added in.
        # (In the accumulation dtype when the peers' rows are added to a sum of several own
        # terms, so that every element is rounded once.)
        cols = [c.cols for c in own_calls]
        summed = bool(sel.peers) and max_terms(n, cols) > 1
        dk = Accumulator(k.shape, 1, cols, acc if summed else k.dtype, q.device) if need_k else None
        dv = Accumulator(v.shape, 1, cols, acc if summed else v.dtype, q.device) if need_v else None
        dbias = (Accumulator(bias.shape, -1, cols, acc if sel.peers else bias.dtype, q.device)
                 if need_bias else None)
        block = st.travelling(k, v, None, bias, own_bounds)
        for call, kplan in zip(own_calls, own_plans):
            r0, r1 = call.rows
            qc, kc, vc, _, bias_c, bounds_c = st.call_args(call, q, block, None, bias, own_bounds)
            dq_c, dk_c, dv_c, db_c = kernel.backward(
                dout[:, r0:r1].contiguous(), qc, kc, vc, None, bias_c, bounds_c,
                out[:, r0:r1].contiguous(), lse[:, :, r0:r1].contiguous(), st.scale, call.causal,
                st.softcap, st.deterministic, needs, call.row_ranges, kplan, call.key_ranges)
            for a, g in ((dq, dq_c), (dk, dk_c), (dv, dv_c), (dbias, db_c)):
                if a is not None:
                    a.add(call.rows if a is dq else call.cols, g)
        dk = dk.result() if need_k else None
        dv = dv.result() if need_v else None
        dbias = dbias.result() if need_bias else None
        transfer.wait()

        if sel.peers:
            # The rows any peer needs, gathered once: own value + every peer's, summed in the
            # accumulation dtype and rounded once (only those rows are touched).
            k_targets = [plan.rows(t) for t in (dk, dv) if t is not None]
            for i, target in enumerate(k_targets):
                part = target.index_select(0, sel.union_index).to(acc)
                for p in sel.peers:
                    part.index_add_(0, sel.union_pos[p], got[p][i].to(acc))
                target.index_copy_(0, sel.union_index, part.to(target.dtype))
            if need_bias:
                rows = torch.zeros(plan.batch * n * sel.heads, plan.bias_heads // sel.heads,
                                   dtype=acc, device=q.device)
                for p in sel.peers:
                    rows.index_add_(0, sel.send_index[p], got[p][-1].to(acc))
                dbias = dbias + plan.unrows_bias(rows, bias.shape)
        return (None, dq.result() if need_q else None, dk.to(k.dtype) if need_k else None,
                dv.to(v.dtype) if need_v else None, dbias.to(bias.dtype) if need_bias else None,
                None)


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
    n = query.shape[1]
    bounds = intervals.bounds
    own_bounds = take_segments(bounds, segments[grp.rank]).contiguous()
    bias_aux = Aux("attn_bias", bias4, n, "shard") if bias4 is not None else None
    bounds_aux = Aux("intervals", own_bounds, n, "shard", bounds=True)
    st = Setup(grp, layout, segments, None, bias_aux, bounds_aux, bool(is_causal))
    # Validation and dispatch as the local kernels see the rank's queries against its own keys
    # (the shapes of that call: its bounds' values are not read, so they are not translated).
    inputs = AttentionInputs.from_args(query, key, value, KeyIntervals.from_bounds(own_bounds), bias4,
                                       softmax_scale, bool(is_causal), softcap, deterministic)
    # A selection's window promise holds for every local call (each is a subset of the queries
    # and keys): the kernels then plan without waiting for the device.
    st.kernel = LocalKernel(choose_backend(inputs, backend), intervals.window or 0)
    st.scale, st.softcap, st.deterministic = inputs.softmax_scale, inputs.softcap, inputs.deterministic
    # The local calls' plans are kept for the backward when there will be one.
    st.keep_plans = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, bias4))
    sel = Selection(grp, segments, bounds, B, bool(is_causal))
    plan = _Plan(st, sel, Hkv, None if bias4 is None else bias4.shape[1], B)
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
    deterministic: bool = False,
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
    deterministic: bool = False,
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
    pieces = grp.all_gather("bias", bias4.detach(), lengths)
    whole = unshard_sequence(pieces, layout, dim=-1)
    intervals = topk_intervals(whole, window_size, is_causal=bool(is_causal), min_dtype=min_dtype)
    out = _selected(grp, layout, segments, query, key, value, intervals, bias4, softmax_scale,
                    is_causal, softcap, deterministic, backend)
    return (out, intervals) if return_intervals else out
