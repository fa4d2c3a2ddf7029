"""The local attention calls of a context-parallel step, and the merging of their results.

Each rank computes its queries against one block of keys at a time with the library's own
forward/backward pair, the ``flash_dmattn::<op>_fwd`` / ``_bwd`` custom ops that every kernel
backend registers (:class:`flash_dmattn.ops.AttentionOp`):

* ``fwd(q, k, v, mask, bias, scale, is_causal, softcap, deterministic, cache_seqlens,
  block_table, key_intervals) -> (out, lse)``;
* ``bwd(dout, q, k, v, mask, bias, out, lse, scale, is_causal, softcap, deterministic, needs,
  cache_seqlens, key_intervals) -> (dq, dk, dv, dbias)``.

The backward of a block given the *merged* output and log-sum-exp of the whole row is exactly
that block's share of the gradient (``p = exp(s - lse)`` and ``delta = rowsum(dout * out)`` are
the row's), which is what makes attention split over key blocks differentiable block by block.
"""
from __future__ import annotations

import importlib
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import registry
from ..inputs import AttentionInputs

# Backends with a registered forward/backward op pair, and how to make sure it is registered.
# flex has none: it differentiates through torch.nn.attention.flex_attention as a whole.
_OPS = {
    "cuda": ("flash_dmattn.backends.cuda.backend", "cuda_op"),
    "triton": ("flash_dmattn.backends.triton.backend", "triton_op"),
    "torch-reference": ("flash_dmattn.reference.attention", None),
}
_OP_NAMES = {"cuda": "cuda", "triton": "triton", "torch-reference": "reference"}

# Bounds of a translated key interval stay inside what KeyIntervals stores (int32, +-2**30).
_CLAMP = 1 << 30


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where partial outputs, log-sum-exps and gradients are summed: float32, or float64 for
    float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def choose_backend(inputs: AttentionInputs, backend: Optional[str]) -> str:
    """The backend whose op pair runs the local calls.

    ``backend`` given: that one (it must support the inputs). Otherwise the one auto-dispatch
    would pick for ``inputs``; when that one has no op pair (flex), the first backend in the
    dispatch policy's order for the call that has one and supports the inputs.
    """
    if backend is not None:
        chosen = registry.check_explicit(registry.get_backend(backend), inputs)
        if chosen.name not in _OPS:
            raise ValueError(
                f"backend {backend!r} has no separate forward/backward with the log-sum-exp, "
                f"which context parallelism merges; use one of {', '.join(_OPS)}"
            )
        return chosen.name
    chosen = registry.select_backend(inputs)
    if chosen.name in _OPS:
        return chosen.name
    from ..policy import rank

    for name in rank(inputs).order:
        if name in _OPS and registry.can_run(name, inputs):
            return name
    raise RuntimeError(f"no backend with a forward/backward op pair can run {inputs.describe()}")


# Rows of a local call whose query positions jump (a zigzag shard's two pieces as one call):
# the kernels' query tiles and the cuda backward's segments (ITEM_SEGMENT_ROWS, 1024) never
# exceed this many rows, and the planner aligns them to row 0, so a jump at a multiple of it
# falls between tiles and segments. See LocalKernel.window_for.
_JUMP_ALIGN = 1024


class LocalKernel:
    """The forward/backward pair of one backend.

    ``window``: the window promise of the call's key-interval mask (0: none; see
    :class:`~flash_dmattn.masks.KeyIntervals`). It holds for any subset of the queries and
    keys of a mask that makes it, so every local call with key-interval bounds passes it on
    (the kernels then plan without waiting for the device; :meth:`window_for` adapts it to a
    call).

    Where the backend plans its backward in the forward (``AttentionOp.planned_forward``:
    cuda, triton), :meth:`forward` with ``keep_plan`` returns that plan and :meth:`backward`
    takes it back, as one ``flash_dmattn_func`` call does: the local calls' work lists are
    made once per training step, not once per direction. Otherwise (torch-reference, or no
    plan kept) the registered ``flash_dmattn::<backend>_fwd`` / ``_bwd`` ops run."""

    def __init__(self, backend: str, window: int = 0) -> None:
        module, factory = _OPS[backend]
        mod = importlib.import_module(module)
        op = getattr(mod, factory)() if factory is not None else None  # registers the ops
        ops = getattr(torch.ops.flash_dmattn, _OP_NAMES[backend] + "_fwd"), getattr(
            torch.ops.flash_dmattn, _OP_NAMES[backend] + "_bwd")
        self.backend = backend
        self.window = int(window)
        self._fwd, self._bwd = ops
        self._planned = getattr(op, "_planned_forward", None)
        self._planned_backward = getattr(op, "_backward", None) if self._planned else None

    def window_for(self, query_ranges: Optional[Sequence[Tuple[int, int]]], num_cols: int,
                   key_ranges: Optional[Sequence[Tuple[int, int]]] = None) -> int:
        """The window promise as one call passes it (0: none).

        * A call whose rows are two pieces of the sequence (``query_ranges`` of several
          ranges) jumps from position ``p`` to ``p'``. Every query still sees at most
          ``window`` keys, and the keys a later position keeps that an earlier one did not
          lie between them (a top-W selection never takes a key back): at the jump, the
          call's keys with positions in ``(p, p')``. Where the call's columns
          (``key_ranges``) have none there (a zigzag shard against its own keys), the promise
          holds as it is. Otherwise a row may see up to ``window`` keys the row before it did
          not: a tile (or backward segment) of ``m`` rows across the jump meets at most
          ``2·window + m - 2`` keys, which a promise of ``2·window`` covers; a jump at a
          multiple of :data:`_JUMP_ALIGN` rows lies between tiles and segments, whose bounds
          then hold with ``window``. ``key_ranges`` None: columns anywhere.
        * A call of at most ``window`` keys: the planner sizes its lists ``min(Lk, window +
          m - 1)`` and trusts a promise only below ``Lk``; ``Lk - 1`` gives lists of ``Lk``
          keys a tile (all of them, which no tile can exceed) without asking the device.
        """
        w = self.window
        if not w:
            return 0
        if query_ranges is not None and len(query_ranges) > 1:
            row = 0
            for (a, e), (nxt, _) in zip(query_ranges, query_ranges[1:]):
                row += e - a
                gap_keys = key_ranges is None or any(ka < nxt and kb > e for ka, kb in key_ranges)
                if gap_keys and row % _JUMP_ALIGN:
                    w = 2 * self.window
        if w >= num_cols:
            w = num_cols - 1
        return max(w, 0)

    def _extra(self, bounds, query_ranges, num_cols, key_ranges=None) -> dict:
        if bounds is None:
            return {}
        extra = {"key_intervals": bounds}
        w = self.window_for(query_ranges, num_cols, key_ranges)
        if w:
            extra["key_window"] = w
        return extra

    def forward(self, q, k, v, mask, bias, bounds, scale, causal, softcap, deterministic,
                query_ranges=None, keep_plan: bool = False, key_ranges=None):
        """``(out (B, Lq, H, Dv) in q's dtype, lse (B, H, Lq) in the accumulation dtype,
        plan)``; ``plan`` is what :meth:`backward` takes back (None unless ``keep_plan`` and
        the backend plans in its forward). ``query_ranges`` / ``key_ranges``: the global
        positions of the rows / columns (:class:`~.plan.Call`), for the window promise."""
        extra = self._extra(bounds, query_ranges, k.shape[1], key_ranges)
        if keep_plan and self._planned is not None:
            out, lse, plan = self._planned(q, k, v, mask, bias, float(scale), bool(causal),
                                           float(softcap), **extra)
            return out.contiguous(), lse.contiguous().to(accumulation_dtype(q.dtype)), plan
        out, lse = self._fwd(q, k, v, mask, bias, scale, causal, softcap, deterministic,
                             None, None, bounds, extra.get("key_window", 0))
        return out, lse.to(accumulation_dtype(q.dtype)), None

    def backward(self, dout, q, k, v, mask, bias, bounds, out, lse, scale, causal, softcap,
                 deterministic, needs: Sequence[bool], query_ranges=None,
                 plan=None, key_ranges=None) -> List[Optional[Tensor]]:
        """``[dq, dk, dv, dbias]``, None where ``needs`` did not ask; each in its input's dtype
        and shape, contiguous. ``plan``: what :meth:`forward` returned for this call."""
        needs = [bool(n) for n in needs]
        needs[3] = needs[3] and bias is not None
        extra = self._extra(bounds, query_ranges, k.shape[1], key_ranges)
        if plan is not None and self._planned_backward is not None:
            grads = self._planned_backward(dout, q, k, v, mask, bias, out, lse, float(scale),
                                           bool(causal), float(softcap), bool(deterministic),
                                           tuple(needs), plan=plan, **extra)
            return [g.contiguous() if n and g is not None else None for g, n in zip(grads, needs)]
        grads = self._bwd(dout, q, k, v, mask, bias, out, lse, scale, causal, softcap,
                          deterministic, needs, None, bounds, extra.get("key_window", 0))
        return [g if n else None for g, n in zip(grads, needs)]


def _cuts(size: int, ranges: Sequence[Tuple[int, int]]) -> List[Tuple[int, int, int]]:
    """The pieces ``[a, b)`` of ``[0, size)`` between every range's ends, each with the number
    of ranges that cover it."""
    points = sorted({0, size} | {x for r in ranges for x in r if 0 <= x <= size})
    out = []
    for a, b in zip(points, points[1:]):
        out.append((a, b, sum(1 for r0, r1 in ranges if r0 <= a and b <= r1)))
    return out


def max_terms(size: int, ranges: Sequence[Tuple[int, int]]) -> int:
    """The most ranges that cover one index of ``[0, size)``."""
    return max((t for _, _, t in _cuts(size, ranges)), default=0)


class _Piece:
    __slots__ = ("a", "b", "total", "seen", "pending")

    def __init__(self, a: int, b: int, total: int) -> None:
        self.a, self.b, self.total, self.seen, self.pending = a, b, total, 0, None


class _Pieces:
    """What :class:`Accumulator` and :class:`Merger` share: the pieces of the summed dim between
    the announced ranges' ends, each with the number of terms that cover it, and the result and
    the accumulation buffer, allocated when first written. ``_name`` and ``_term``: how errors
    name the class and one contribution."""

    _name = ""
    _term = ""

    def __init__(self, shape: Sequence[int], dim: int, ranges: Sequence[Tuple[int, int]],
                 dtype: torch.dtype, device) -> None:
        self.shape = tuple(shape)
        self.dim = dim % len(self.shape)
        self.dtype, self.acc = dtype, accumulation_dtype(dtype)
        self.device = device
        self._pieces = [_Piece(a, b, t) for a, b, t in _cuts(self.shape[self.dim], ranges)]
        self._out: Optional[Tensor] = None
        self._buf: Optional[Tensor] = None

    def _slice(self, t: Tensor, a: int, b: int) -> Tensor:
        return t.narrow(self.dim, a, b - a)

    def _result_view(self, p: _Piece) -> Tensor:
        if self._out is None:
            self._out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self._slice(self._out, p.a, p.b)

    def _acc_view(self, p: _Piece) -> Tensor:
        if self.acc == self.dtype:
            return self._result_view(p)
        if self._buf is None:
            self._buf = torch.empty(self.shape, dtype=self.acc, device=self.device)
        return self._slice(self._buf, p.a, p.b)

    def _reached(self, r0: int, r1: int):
        """The pieces a contribution on ``[r0, r1)`` reaches, each checked to expect one more."""
        for p in self._pieces:
            if p.b <= r0 or p.a >= r1:
                continue
            if p.seen >= p.total:
                raise RuntimeError(f"{self._name}: a {self._term} on [{p.a}, {p.b}) beyond the "
                                   f"{p.total} announced")
            yield p

    def _check_complete(self) -> None:
        for p in self._pieces:
            if p.seen != p.total:
                raise RuntimeError(f"{self._name}: [{p.a}, {p.b}) got {p.seen} of {p.total} "
                                   f"{self._term}s")


class Accumulator(_Pieces):
    """The sum of partial results over ranges of one dim, every range known in advance.

    ``ranges``: the ``[start, end)`` of every contribution :meth:`add` will bring (any order),
    so each element's number of terms is known before the first arrives, and each sum is
    formed with one pass per term and no zero-fill: a piece's first term is kept as it is (a
    piece with one term *is* the result, as the tensor given when it spans the whole dim, or
    copied in once); the second is added to it (into the result when it is the last, else into
    an accumulation buffer); the last is added into the result. Sums are computed in the
    accumulation dtype (float32 for half types: PyTorch's elementwise arithmetic on bfloat16 /
    float16 computes in float32 and rounds once at the store), so every element is rounded to
    ``dtype`` once, whatever the number of terms. Elements no range covers are 0.
    """

    _name, _term = "Accumulator", "term"

    def __init__(self, shape: Sequence[int], dim: int, ranges: Sequence[Tuple[int, int]],
                 dtype: torch.dtype, device) -> None:
        super().__init__(shape, dim, ranges, dtype, device)
        self._whole: Optional[Tensor] = None

    def add(self, rng: Tuple[int, int], t: Tensor) -> None:
        """Add ``t`` (this range's part: the dim has ``rng[1] - rng[0]`` entries)."""
        r0 = rng[0]
        for p in self._reached(*rng):
            part = self._slice(t, p.a - r0, p.b - r0)
            last = p.seen == p.total - 1
            if p.total == 1:
                whole = p.a == 0 and p.b == self.shape[self.dim] and self._out is None
                if whole and t.dtype == self.dtype and tuple(t.shape) == self.shape:
                    self._whole = t
                else:
                    self._result_view(p).copy_(part)
            elif p.seen == 0:
                p.pending = part
            elif p.seen == 1:
                first, p.pending = p.pending, None
                if last:
                    self._add_into(self._result_view(p), first, part)
                else:
                    buf = self._acc_view(p)
                    buf.copy_(first)
                    buf.add_(part)
            elif last:
                self._add_into(self._result_view(p), self._acc_view(p), part)
            else:
                self._acc_view(p).add_(part)
            p.seen += 1

    @staticmethod
    def _add_into(out: Tensor, a: Tensor, b: Tensor) -> None:
        """``out = a + b`` computed in the accumulation dtype, rounded once into ``out``."""
        if out.dtype in (torch.float16, torch.bfloat16) or \
                torch.promote_types(a.dtype, b.dtype) == out.dtype:
            torch.add(a, b, out=out)  # half types compute in float32, then round at the store
        else:  # two half terms into a float32 sum: their own add would round to half first
            out.copy_(a)
            out.add_(b)

    def result(self) -> Tensor:
        """The sums in ``dtype`` (every announced term must have come)."""
        self._check_complete()
        if self._whole is not None:
            return self._whole
        for p in self._pieces:
            if p.total == 0:
                self._result_view(p).zero_()
        if self._out is None:
            self._out = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        return self._out


class Merger(_Pieces):
    """Outputs and log-sum-exps of calls on row ranges of a shard, merged by log-sum-exp in the
    accumulation dtype: ``lse = logaddexp(lse_1, lse_2, ...)``, ``out = sum_c out_c·exp(lse_c -
    lse)``. Rows no call reaches are 0 with lse = -inf, like rows with no visible key.

    ``ranges``: every call's rows, known before the first result arrives, so that each row
    range is written once per term: rows one call reaches take its output as it is (a call
    on every row of the shard *is* the result, no copy); rows two calls reach are merged as
    the second arrives, ``out_1·w_1 + out_2·w_2`` computed in float32 and stored in the
    output dtype (two passes, no float32 copy of the output kept); rows of more calls
    accumulate in a float32 buffer, the last term stored in the output dtype."""

    _name, _term = "Merger", "call"

    def __init__(self, batch: int, rows: int, heads: int, dim: int, dtype: torch.dtype,
                 device, ranges: Sequence[Tuple[int, int]]) -> None:
        super().__init__((batch, rows, heads, dim), 1, ranges, dtype, device)
        self.lse = torch.empty((batch, heads, rows), dtype=self.acc, device=device)
        self._whole: Optional[Tuple[Tensor, Tensor]] = None

    @staticmethod
    def _weights(old: Tensor, new: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``(lse, w_old, w_new)``, the weights as ``(B, rows, H, 1)``; rows without any
        visible key get weights 0 (not exp(nan))."""
        both = torch.logaddexp(old, new)
        ref = torch.where(both == float("-inf"), torch.zeros_like(both), both)
        w_old = torch.exp(old - ref).transpose(1, 2).unsqueeze(-1)
        w_new = torch.exp(new - ref).transpose(1, 2).unsqueeze(-1)
        return both, w_old, w_new

    def add(self, rows: Tuple[int, int], out: Tensor, lse: Tensor) -> None:
        r0 = rows[0]
        for p in self._reached(*rows):
            o = out[:, p.a - r0:p.b - r0]
            lc = lse[:, :, p.a - r0:p.b - r0]
            last = p.seen == p.total - 1
            if p.total == 1:
                if p.a == 0 and p.b == self.shape[1] and out.dtype == self.dtype and \
                        tuple(out.shape) == self.shape and self._out is None:
                    self._whole = (out, lse)
                else:
                    self._result_view(p).copy_(o)
                    self.lse[:, :, p.a:p.b].copy_(lc)
            elif p.seen == 0:
                p.pending = (o, lc)
            else:
                if p.seen == 1:
                    (o_old, l_old), p.pending = p.pending, None
                else:
                    o_old, l_old = self._acc_view(p), self.lse[:, :, p.a:p.b]
                both, w_old, w_new = self._weights(l_old, lc)
                if p.seen == 1:
                    # o_old·w_old in float32: a fresh buffer when this is the last term,
                    # else the accumulation buffer
                    acc = torch.mul(o_old, w_old) if last else torch.mul(
                        o_old, w_old, out=self._acc_view(p))
                else:
                    acc = o_old.mul_(w_old)
                if last:
                    torch.addcmul(acc, o, w_new, out=self._result_view(p))
                else:
                    acc.addcmul_(o, w_new)
                self.lse[:, :, p.a:p.b] = both
            p.seen += 1

    def result(self, dtype: Optional[torch.dtype] = None) -> Tuple[Tensor, Tensor]:
        """``(out in the output dtype, lse)``: the merged rows, 0 / -inf where no call
        reached (every announced call must have come)."""
        self._check_complete()
        if self._whole is not None:
            out, lse = self._whole
            return out, lse.to(self.acc)
        for p in self._pieces:
            if p.total == 0:
                self._result_view(p).zero_()
                self.lse[:, :, p.a:p.b].fill_(float("-inf"))
        if self._out is None:  # a shard of no rows
            self._out = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        return self._out, self.lse


# ------------------------------------------------------------------------------------------
# Masks, biases and key intervals along the sequence


def key_dim(t: Optional[Tensor]) -> int:
    """The key dim of a mask, bias or interval bounds as exchanged between ranks (-1: none)."""
    return -1 if t is None else int(t.shape[-1])


def query_dim(t: Optional[Tensor]) -> int:
    """The query dim of a mask or bias as exchanged between ranks (-1: none)."""
    return -1 if t is None else int(t.shape[-2])


def classify_keys(name: str, key_dims: Sequence[int], lengths: Sequence[int],
                  bounds: bool = False) -> str:
    """What the key dim of ``name`` is, from its size on every rank (``key_dims``, indexed by
    rank, -1 where a rank passed none) and every rank's number of tokens: ``"global"`` (the
    whole sequence everywhere), ``"shard"`` (each rank's own tokens) or ``"none"`` (1). The
    same answer on every rank, which the transfers need."""
    total = sum(lengths)
    if any(k < 0 for k in key_dims):
        given = [r for r, k in enumerate(key_dims) if k >= 0]
        raise ValueError(f"{name} was passed on ranks {given} only; every rank of the group "
                         f"passes its own (or none does)")
    if all(k == total for k in key_dims):
        return "global"
    if all(k == n for k, n in zip(key_dims, lengths)):
        return "shard"
    if not bounds and all(k == 1 for k in key_dims):
        return "none"
    sizes = "the shard length (rank by rank: " + ", ".join(str(n) for n in lengths) + ")"
    raise ValueError(
        f"{name}: the key dim has sizes {list(key_dims)} on the ranks; on every rank it must be "
        f"{'' if bounds else '1, '}{sizes} (that rank's keys) or the whole sequence {total} (every "
        f"key, global order)"
    )


class Aux:
    """A mask or bias of a context-parallel call, 4-D ``(Bx, Hx, Qx, Kx)``, or the int32
    bounds ``(2, Bx, Hx, Kx)`` of key intervals (``Qx`` is then 1).

    ``per_query``: ``Qx`` is the shard length (rows follow the rank's queries).
    ``keys`` (:func:`classify_keys`): ``"none"`` (``Kx == 1``), ``"shard"`` (``Kx`` is the
    shard length: the rank's own keys, which travel with its K/V) or ``"global"``
    (``Kx == L``: every key, in global position order, the same on every rank).
    """

    def __init__(self, name: str, tensor: Tensor, shard_len: int, keys: str,
                 bounds: bool = False) -> None:
        self.name, self.tensor, self.bounds, self.keys = name, tensor, bounds, keys
        # (a query dim of 1 broadcasts, also on a rank of one token)
        self.per_query = not bounds and tensor.shape[-2] == shard_len != 1

    @staticmethod
    def check_query_and_key_dims(name: str, shape: Sequence[int], keys: str, query_dims: Sequence[int],
                                 lengths: Sequence[int]) -> None:
        """Refuse a mask or bias with this rank's queries and this rank's keys only (from every
        rank's query dim, so that every rank refuses it)."""
        if keys == "shard" and len(lengths) > 1 and any(
                qx == n != 1 for qx, n in zip(query_dims, lengths)):
            raise ValueError(
                f"{name} of shape {tuple(shape)} has this rank's queries and this rank's keys "
                f"only; a mask or bias with a query dim must span every key (key dim "
                f"{sum(lengths)}, global order) or none (key dim 1)"
            )

    @staticmethod
    def check_query_dim(name: str, tensor: Optional[Tensor], shard_len: int) -> None:
        """A mask's or bias's query dim is 1 or the rank's shard length (a check of the rank's
        own arguments)."""
        if tensor is not None and tensor.shape[-2] not in (1, shard_len):
            raise ValueError(
                f"{name}: the query dim has size {tensor.shape[-2]}; it must be 1 or the shard "
                f"length {shard_len} (this rank's queries)"
            )

    @property
    def travels(self) -> bool:
        return self.keys == "shard"

    def rows(self, t: Tensor, rows: Tuple[int, int]) -> Tensor:
        return t[:, :, rows[0]:rows[1]] if self.per_query else t

    def cols(self, t: Tensor, call) -> Tensor:
        """The key columns of ``call`` from ``t``: the block's shard of a travelling aux, or
        the tensor itself (key dim 1 or the whole sequence)."""
        if self.keys == "none":
            return t
        if self.keys == "shard":
            return t[..., call.cols[0]:call.cols[1]]
        return take_ranges(t, call.key_ranges)


def take_ranges(t: Tensor, ranges: Sequence[Tuple[int, int]]) -> Tensor:
    """``t``'s last dim restricted to ``ranges`` (concatenated in order)."""
    pieces = [t[..., a:b] for a, b in ranges]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, -1)


def add_ranges(dst: Tensor, ranges: Sequence[Tuple[int, int]], src: Tensor) -> None:
    """``dst[..., ranges] += src`` (the inverse of :func:`take_ranges`)."""
    offset = 0
    for a, b in ranges:
        dst[..., a:b] += src[..., offset:offset + (b - a)]
        offset += b - a


def translate_bounds(bounds: Tensor, query_ranges: Sequence[Tuple[int, int]], num_rows: int,
                     num_cols: int) -> Tensor:
    """Key-interval bounds in global query positions -> those of a local call whose rows are
    the positions ``query_ranges`` (``[start, end)`` ranges in row order, increasing): the
    local call places row ``i`` at ``i + Lk - Lq``.

    One range from ``p``: a shift by ``Lk - Lq - p``. Several (a zigzag shard's two pieces
    as one call): the rows' positions increase, so the rows whose position lies in
    ``[s, e)`` are the rows ``[rank(s), rank(e))``, ``rank(x)`` the number of rows before
    position ``x`` (``sum over ranges of clamp(x - a, 0, b - a)``): the same rows see the key."""
    shift = num_cols - num_rows
    if len(query_ranges) == 1:
        shift -= query_ranges[0][0]
        if shift == 0 and bounds.dtype == torch.int32:
            return bounds.contiguous()
        out = bounds.to(torch.int64) + shift
        return out.clamp_(-_CLAMP, _CLAMP).to(torch.int32).contiguous()
    for (_, b), (a, _) in zip(query_ranges, query_ranges[1:]):
        if a < b:
            raise ValueError(f"query ranges {tuple(query_ranges)} do not increase")
    x = bounds.to(torch.int64)
    rank = None
    for a, b in query_ranges:
        part = (x - a).clamp_(0, b - a)
        rank = part if rank is None else rank.add_(part)
    return rank.add_(shift).to(torch.int32)


def take_segments(t: Tensor, segments: Sequence[Tuple[int, int]]) -> Tensor:
    """``t``'s last dim at the positions of ``segments`` (``(start, length)``, in order), as
    slices (consecutive segments as one): no index tensor, and a view when one slice."""
    ranges: List[Tuple[int, int]] = []
    for a, n in segments:
        if ranges and ranges[-1][1] == a:
            ranges[-1] = (ranges[-1][0], a + n)
        else:
            ranges.append((a, a + n))
    return take_ranges(t, ranges)


def pad4(name: str, t: Optional[Tensor]) -> Optional[Tensor]:
    """A mask or bias as a 4-D view (fewer dims are left-padded with 1s)."""
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dim() > 4:
        raise ValueError(f"{name} must have at most 4 dims, got shape {tuple(t.shape)}")
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) if t.dim() < 4 else t
