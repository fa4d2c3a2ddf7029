"""Ring context parallelism: every rank's queries meet every rank's keys, one block a step.

Forward, ``P`` steps: at step ``t`` rank ``r`` holds the K/V block of rank ``(r - t) mod P``
(with the per-key mask, bias and key-interval shards that travel with it), starts sending it
to rank ``r + 1`` and receiving the next one from rank ``r - 1``, and meanwhile runs the local
calls of that block (:mod:`.plan`), merging their outputs by log-sum-exp.

Backward, ``P`` steps in the same order: the K/V blocks go round again, and with each block a
gradient accumulator (dK, dV and a per-key dbias, in the accumulation dtype): at step ``t``
rank ``r`` adds its share for block ``(r - t) mod P`` to the accumulator received from rank
``r - 1`` (which added its own at step ``t - 1``) and passes it on; one last hop brings every
accumulator home. dQ and the gradients of per-query or whole-sequence masks' biases stay local.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..inputs import AttentionInputs
from ..masks import KeyIntervals
from .comm import Group
from .layout import Segment, check_layout, check_lengths, sequence_segments
from .local import (
    Accumulator,
    Aux,
    LocalKernel,
    Merger,
    accumulation_dtype,
    add_ranges,
    choose_backend,
    classify_keys,
    key_dim,
    pad4,
    query_dim,
    translate_bounds,
)
from .plan import Call, plan_block

__all__ = ["context_parallel_attention"]


def check_shards(query, key, value) -> int:
    """Shapes common to every context-parallel call; returns the shard length."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, shard_len, heads, head_dim), got "
                             f"shape {tuple(t.shape)}")
    if not (query.shape[1] == key.shape[1] == value.shape[1]):
        raise ValueError(
            f"query, key and value must be the same tokens (this rank's shard of one sequence), "
            f"got query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    return query.shape[1]


def check_devices(query: Tensor, *others: Optional[Tensor]) -> None:
    """Every tensor of the call on the query's device (what is sent must be where the process
    group's backend moves it from)."""
    for t in others:
        if t is not None and t.device != query.device:
            raise ValueError(f"a tensor of shape {tuple(t.shape)} is on {t.device}, the query on "
                             f"{query.device}; every input of a context-parallel call is on one device")


def agreed_rows(grp: Group, device, values: Sequence[int], error: Optional[Exception],
                layout: str, seq_len: Optional[int]) -> List[List[int]]:
    """Every rank's ``values`` (its shard length first, then key dims, then query dims of a
    mask / bias: sizes equal to the shard length or the sequence length follow each rank's),
    indexed by group rank.

    Without ``seq_len`` they are exchanged (:meth:`Group.agree`: one small all-gather and a
    host synchronisation). With it every rank's length is known, and the others' values are
    taken to be this rank's, read for their length: no communication and no host wait, but
    this rank's checks (and a length that is not the layout's split of ``seq_len``) raise on
    this rank alone. Ranks of a single token make a key dim of 1 ambiguous (its own key or
    every key): they are exchanged anyway. So is the first call on a group: NCCL makes the
    communicator that batched point-to-point transfers use at the first operation, which must
    then involve every rank (a rank with nothing to send in a selected-keys exchange skips its
    batch).
    """
    if seq_len is None:
        return grp.agree(device, values, len(values), error)
    lengths = [sum(n for _, n in segs) for segs in sequence_segments(layout, grp.size, seq_len)]
    if min(lengths) < 2 or not grp.opened():
        rows = grp.agree(device, values, len(values), error)
        if [r[0] for r in rows] != lengths:
            raise ValueError(
                f"the ranks hold {[r[0] for r in rows]} tokens, but the {layout} layout of "
                f"seq_len={seq_len} gives them {lengths}; cut the shards with "
                f"flash_dmattn.distributed.shard_sequence"
            )
        return rows
    if error is not None:
        raise error
    mine = lengths[grp.rank]
    if values[0] != mine:
        raise ValueError(
            f"this rank (rank {grp.rank} of {grp.size}) holds {values[0]} tokens, but the {layout} "
            f"layout of seq_len={seq_len} gives it {mine}; cut the shards with "
            f"flash_dmattn.distributed.shard_sequence"
        )

    def theirs(v: int, n: int) -> int:
        if v < 0 or v == seq_len or v != mine:
            return v
        return n

    return [[n] + [theirs(v, n) for v in values[1:]] for n in lengths]


def _resized(t: Tensor, dim: int, length: int) -> Tensor:
    """An uninitialised tensor like ``t`` with ``length`` along ``dim``."""
    shape = list(t.shape)
    shape[dim] = length
    return torch.empty(shape, dtype=t.dtype, device=t.device)


def _seq_dim(name: str) -> int:
    """The token dim of what travels with a K/V block: dim 1 of K and V, the last of the rest."""
    return 1 if name in ("k", "v") else -1


class Setup:
    """Everything a ring call needs besides its tensors."""

    def __init__(self, group: Group, layout: str, segments: Sequence[Tuple[Segment, ...]],
                 mask: Optional[Aux], bias: Optional[Aux], bounds: Optional[Aux],
                 is_causal: bool) -> None:
        self.group, self.layout = group, layout
        self.mask, self.bias, self.bounds = mask, bias, bounds
        self.is_causal = is_causal
        world = group.size
        self.segments = list(segments)
        self.lengths = [sum(n for _, n in segs) for segs in self.segments]
        self.shard_len = self.lengths[group.rank]
        mine = self.segments[group.rank]
        # (Calls may span both pieces of a zigzag shard, key intervals included: their bounds
        # are translated to the call's rows, see translate_bounds.)
        self.plans: List[List[Call]] = [
            plan_block(mine, self.segments[s], is_causal, False) for s in range(world)
        ]
        self.kernel: Optional[LocalKernel] = None
        self.keep_plans = False  # local calls' plans kept for the backward (LocalKernel)
        self.scale = self.softcap = 0.0
        self.deterministic = False

    def whole_shard_call(self) -> Call:
        """The rank's queries against its own keys as one call (validation and dispatch)."""
        mine = self.segments[self.group.rank]
        ranges = tuple((a, a + n) for a, n in mine)
        return Call((0, self.shard_len), (0, self.shard_len), self.is_causal, mine[0][0], ranges,
                    ranges)

    def travelling(self, k: Tensor, v: Tensor, mask, bias, bounds) -> Dict[str, Tensor]:
        """What goes round the ring with the keys: K, V and the per-key shards."""
        block = {"k": k, "v": v}
        for name, aux, t in (("mask", self.mask, mask), ("bias", self.bias, bias),
                             ("bounds", self.bounds, bounds)):
            if aux is not None and aux.travels:
                block[name] = t.detach().contiguous()
        return block

    def incoming(self, block: Dict[str, Tensor], src: int) -> Dict[str, Tensor]:
        """Receive buffers for rank ``src``'s block, shaped like ``block`` with its length."""
        return {name: _resized(t, _seq_dim(name), self.lengths[src]) for name, t in block.items()}

    def call_args(self, call: Call, q: Tensor, block: Dict[str, Tensor], mask, bias, bounds):
        """``(q, k, v, mask, bias, bounds)`` of one local call."""
        (r0, r1), (c0, c1) = call.rows, call.cols
        qc = q[:, r0:r1].contiguous()
        kc = block["k"][:, c0:c1].contiguous()
        vc = block["v"][:, c0:c1].contiguous()
        mask_c = bias_c = bounds_c = None
        if self.mask is not None:
            mask_c = self.mask.rows(self.mask.cols(block.get("mask", mask), call), call.rows)
        if self.bias is not None:
            bias_c = self.bias.rows(self.bias.cols(block.get("bias", bias), call), call.rows)
        if self.bounds is not None:
            raw = self.bounds.cols(block.get("bounds", bounds), call)
            bounds_c = translate_bounds(raw, call.row_ranges, r1 - r0, c1 - c0)
        return qc, kc, vc, mask_c, bias_c, bounds_c


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, st: Setup, q, k, v, mask, bias, bounds):
        grp, kernel = st.group, st.kernel
        q, k, v = (t.contiguous() for t in (q, k, v))
        order = [(grp.rank - step) % grp.size for step in range(grp.size)]
        merger = Merger(q.shape[0], q.shape[1], q.shape[2], v.shape[3], q.dtype, q.device,
                        [call.rows for src in order for call in st.plans[src]])
        block = st.travelling(k, v, mask, bias, bounds)
        for step, src in enumerate(order):
            nxt, transfer = None, None
            if step < grp.size - 1:
                nxt = st.incoming(block, (src - 1) % grp.size)
                transfer = grp.ring_shift("kv", list(block.values()), list(nxt.values()))
            for call in st.plans[src]:
                args = st.call_args(call, q, block, mask, bias, bounds)
                out_c, lse_c, _ = kernel.forward(*args, st.scale, call.causal, st.softcap,
                                                 st.deterministic, call.row_ranges,
                                                 key_ranges=call.key_ranges)
                merger.add(call.rows, out_c, lse_c)
            if transfer is not None:
                transfer.wait()
                block = nxt
        out, lse = merger.result()
        ctx.save_for_backward(q, k, v, mask, bias, bounds, out, lse)
        ctx.st = st
        return out

    @staticmethod
    def backward(ctx, dout):
        st: Setup = ctx.st
        grp, kernel = st.group, st.kernel
        q, k, v, mask, bias, bounds, out, lse = ctx.saved_tensors
        need_q, need_k, need_v = ctx.needs_input_grad[1:4]
        need_bias = bias is not None and ctx.needs_input_grad[5]
        needs = (need_q, need_k, need_v, need_bias)
        acc = accumulation_dtype(q.dtype)
        dout = dout.contiguous()
        order = [(grp.rank - step) % grp.size for step in range(grp.size)]
        # dQ: every call's rows, summed once per term (Accumulator: no zero-fill).
        dq = (Accumulator(q.shape, 1, [c.rows for src in order for c in st.plans[src]], q.dtype,
                          q.device) if need_q else None)
        bias_travels = need_bias and st.bias.travels
        dbias_local = (torch.zeros(bias.shape, dtype=acc, device=q.device)
                       if need_bias and not bias_travels else None)
        # The accumulator that follows each block: dK, dV and (per-key bias) dbias.
        carried = []
        if need_k or need_v or bias_travels:
            carried = [(k, 1), (v, 1)] + ([(bias, -1)] if bias_travels else [])
        produced = (need_k, need_v, bias_travels)  # which of them this rank's calls add to

        def block_sums(src: int, incoming: bool) -> List[Accumulator]:
            """Rank ``src``'s block's accumulators: this rank's calls on it, and the sums
            received from rank r - 1 (``incoming``), in the accumulation dtype (they travel)."""
            out = []
            for (t, dim), made in zip(carried, produced):
                shape = list(t.shape)
                shape[dim] = st.lengths[src]
                ranges = [c.cols for c in st.plans[src]] if made else []
                if incoming:
                    ranges.append((0, st.lengths[src]))
                out.append(Accumulator(shape, dim, ranges, acc, q.device))
            return out

        block = st.travelling(k, v, mask, bias, bounds)
        carry: List[Tensor] = []
        for step, src in enumerate(order):
            incoming, carry_transfer = [], None
            if step > 0 and carry:
                # Rank r - 1's accumulator of the block this rank computes now (its previous one).
                incoming = [_resized(t, dim, st.lengths[src]) for t, (_, dim) in zip(carry, carried)]
                carry_transfer = grp.ring_shift("grad", carry, incoming)
            nxt, transfer = None, None
            if step < grp.size - 1:
                nxt = st.incoming(block, (src - 1) % grp.size)
                transfer = grp.ring_shift("kv", list(block.values()), list(nxt.values()))
            contrib = block_sums(src, bool(incoming))
            for call in st.plans[src]:
                r0, r1 = call.rows
                qc, kc, vc, mask_c, bias_c, bounds_c = st.call_args(call, q, block, mask, bias,
                                                                    bounds)
                dq_c, dk_c, dv_c, db_c = kernel.backward(
                    dout[:, r0:r1].contiguous(), qc, kc, vc, mask_c, bias_c, bounds_c,
                    out[:, r0:r1].contiguous(), lse[:, :, r0:r1].contiguous(), st.scale,
                    call.causal, st.softcap, st.deterministic, needs, call.row_ranges,
                    key_ranges=call.key_ranges,
                )
                if dq_c is not None:
                    dq.add(call.rows, dq_c)
                for a, g, made in zip(contrib, (dk_c, dv_c, db_c), produced):
                    if made:
                        a.add(call.cols, g)
                if db_c is not None and not bias_travels:
                    _add_bias_grad(st.bias, dbias_local, call, db_c)
            if carry_transfer is not None:
                carry_transfer.wait()
                for a, x in zip(contrib, incoming):
                    a.add((0, st.lengths[src]), x)
            carry = [a.result() for a in contrib]
            if transfer is not None:
                transfer.wait()
                block = nxt
        if carry and grp.size > 1:
            home = [_resized(t, dim, st.shard_len) for t, (_, dim) in zip(carry, carried)]
            grp.ring_shift("grad", carry, home).wait()
            carry = home
        dk = carry[0].to(k.dtype) if need_k else None
        dv = carry[1].to(v.dtype) if need_v else None
        dbias = None
        if need_bias:
            dbias = (carry[2] if bias_travels else dbias_local).to(bias.dtype)
        return None, (dq.result() if need_q else None), dk, dv, None, dbias, None


def _add_bias_grad(aux: Aux, dst: Tensor, call: Call, grad: Tensor) -> None:
    """Add a call's dbias into a bias gradient that stays on this rank."""
    target = aux.rows(dst, call.rows)
    if aux.keys == "global":
        add_ranges(target, call.key_ranges, grad)
    else:
        target += grad


def context_parallel_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask=None,
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
    """Attention over a sequence split across the ranks of ``group``; each rank passes its shard.

    Equivalent to ``flash_dmattn_func`` on the whole sequence (self-attention: queries and keys
    are the same positions), with this rank's rows of the result returned. See
    ``docs/context-parallel.md`` for the full contract.

    Args:
        query: ``(B, n, H, D)``, this rank's ``n`` tokens; key, value: ``(B, n, Hkv, D)``, the
            same tokens (``H % Hkv == 0``). The sequence has ``L`` = the sum of the ranks'
            ``n`` tokens, any length: the shards are the layout's split of ``L``
            (:func:`~flash_dmattn.distributed.shard_sequence`; equal when the layout's pieces
            divide ``L``). The ranks exchange their ``n`` once per call and raise
            ``ValueError`` on every rank when they are not that split.
        attn_mask: bool, 4-D or fewer dims, ``(1|B, 1|Hkv|H, Qx, Kx)``, or a
            :class:`~flash_dmattn.KeyIntervals` whose bounds are global query positions. The
            key dim ``Kx`` is 1, ``n`` (this rank's keys: the shard travels with its keys) or
            ``L`` (every key in global order, the same on every rank); the query dim ``Qx`` is
            1 or ``n`` (this rank's queries), and ``Qx = n`` needs ``Kx`` of 1 or ``L``.
            KeyIntervals start/end have shape ``(1|B, 1|Hkv|H, n or L)``.
        attn_bias: float, the same shapes as a bool mask; its gradient has its shape. A bias
            with neither a query dim nor this rank's keys (``Qx = 1``, ``Kx`` 1 or ``L``) is
            replicated: each rank gets the gradient of its own queries (sum over the group for
            the total).
        softmax_scale, softcap, deterministic: as ``flash_dmattn_func``.
        is_causal: causal over global positions (key ``j`` visible to query ``i`` iff
            ``j <= i``).
        group: a ``ProcessGroup`` (default: the default group) or a ``DeviceMesh``.
        mesh_dim: the mesh dimension of the ranks sharing the sequence (a ``DeviceMesh``
            of several dims).
        layout: ``"contiguous"`` or ``"zigzag"`` (:mod:`flash_dmattn.distributed.layout`).
        backend: the backend of the local calls (``"cuda"``, ``"triton"``,
            ``"torch-reference"``); default: the one auto-dispatch picks for this rank's queries
            against its own keys.
        seq_len: ``L``, when the caller knows it: the ranks then skip the exchange of their
            lengths and dims (no communication before the ring, and no host wait for it), and
            a rank whose arguments do not fit raises alone instead of on every rank
            (:func:`agreed_rows`).

    Returns ``(B, n, H, Dv)`` in the query's dtype. Differentiable in query, key, value and
    attn_bias (eager mode).
    """
    layout = check_layout(layout)
    grp = Group(group, mesh_dim)
    device = query.device if isinstance(query, Tensor) else torch.device("cpu")
    # This rank's own checks, then one exchange of what the ranks must agree on: shard lengths
    # (the layout's split of their sum) and the key dims of mask, bias and intervals.
    error, shard_len, mask, bias, bounds, window = None, 0, None, None, None, 0
    try:
        shard_len = check_shards(query, key, value)
        if isinstance(attn_mask, KeyIntervals):
            bounds, window = attn_mask.bounds, attn_mask.window or 0
            attn_mask = None
        mask = pad4("attn_mask", attn_mask)
        bias = pad4("attn_bias", attn_bias)
        if mask is not None and mask.dtype != torch.bool:
            raise TypeError(f"attn_mask must be bool, got {mask.dtype}")
        Aux.check_query_dim("attn_mask", mask, shard_len)
        Aux.check_query_dim("attn_bias", bias, shard_len)
        check_devices(query, key, value, mask, bias, bounds)
    except (TypeError, ValueError) as exc:
        error = exc
    rows = agreed_rows(grp, device, [shard_len, key_dim(mask), key_dim(bias), key_dim(bounds),
                                     query_dim(mask), query_dim(bias)], error, layout, seq_len)
    lengths = [r[0] for r in rows]
    segments = check_lengths(layout, lengths)

    def aux(name: str, t: Optional[Tensor], col: int, qcol: Optional[int] = None) -> Optional[Aux]:
        dims = [r[col] for r in rows]
        if all(d < 0 for d in dims):
            return None
        keys = classify_keys(name, dims, lengths, qcol is None)
        if qcol is not None:
            Aux.check_query_and_key_dims(name, t.shape, keys, [r[qcol] for r in rows], lengths)
        return Aux(name, t, shard_len, keys, bounds=qcol is None)

    mask_aux = aux("attn_mask", mask, 1, 4)
    bias_aux = aux("attn_bias", bias, 2, 5)
    bounds_aux = aux("attn_mask (KeyIntervals)", bounds, 3)
    st = Setup(grp, layout, segments, mask_aux, bias_aux, bounds_aux, bool(is_causal))

    # Validate the call as the local kernels will see it: this rank's queries against its keys.
    whole = st.whole_shard_call()
    _, _, _, mask_c, bias_c, bounds_c = st.call_args(
        whole, query, st.travelling(key, value, mask, bias, bounds), mask, bias, bounds)
    inputs = AttentionInputs.from_args(
        query, key, value,
        KeyIntervals.from_bounds(bounds_c) if bounds_c is not None else mask_c, bias_c,
        softmax_scale, bool(is_causal), softcap, deterministic,
    )
    st.kernel = LocalKernel(choose_backend(inputs, backend), window)
    st.scale, st.softcap, st.deterministic = inputs.softmax_scale, inputs.softcap, inputs.deterministic
    return _RingAttention.apply(st, query, key, value, mask, bias, bounds)
