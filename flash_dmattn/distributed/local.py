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


class LocalKernel:
    """The forward/backward op pair of one backend.

    ``window``: the window promise of the call's key-interval mask (0: none; see
    :class:`~flash_dmattn.masks.KeyIntervals`). It holds for any subset of the queries and
    keys of a mask that makes it, so every local call with key-interval bounds passes it on
    (the kernels then plan without waiting for the device)."""

    def __init__(self, backend: str, window: int = 0) -> None:
        module, factory = _OPS[backend]
        mod = importlib.import_module(module)
        if factory is not None:
            getattr(mod, factory)()  # registers the ops on first use
        ops = getattr(torch.ops.flash_dmattn, _OP_NAMES[backend] + "_fwd"), getattr(
            torch.ops.flash_dmattn, _OP_NAMES[backend] + "_bwd")
        self.backend = backend
        self.window = int(window)
        self._fwd, self._bwd = ops

    def forward(self, q, k, v, mask, bias, bounds, scale, causal, softcap,
                deterministic) -> Tuple[Tensor, Tensor]:
        """``(out (B, Lq, H, Dv) in q's dtype, lse (B, H, Lq) in the accumulation dtype)``."""
        out, lse = self._fwd(q, k, v, mask, bias, scale, causal, softcap, deterministic,
                             None, None, bounds, self.window if bounds is not None else 0)
        return out, lse.to(accumulation_dtype(q.dtype))

    def backward(self, dout, q, k, v, mask, bias, bounds, out, lse, scale, causal, softcap,
                 deterministic, needs: Sequence[bool]) -> List[Optional[Tensor]]:
        """``[dq, dk, dv, dbias]``, None where ``needs`` did not ask; each in its input's dtype
        and shape."""
        needs = [bool(n) for n in needs]
        needs[3] = needs[3] and bias is not None
        grads = self._bwd(dout, q, k, v, mask, bias, out, lse, scale, causal, softcap,
                          deterministic, needs, None, bounds,
                          self.window if bounds is not None else 0)
        return [g if n else None for g, n in zip(grads, needs)]


class Merger:
    """Outputs and log-sum-exps of calls on row ranges of a shard, merged in the accumulation
    dtype: ``lse = logaddexp(lse, lse_c)``, ``out = out·exp(lse_old - lse) + out_c·exp(lse_c - lse)``.
    Rows no call reached stay 0 with lse = -inf, like rows with no visible key.

    A call on rows no earlier call reached is copied in, not merged (most calls of a shard:
    the first key block of every query segment), and the buffers are only written where a
    call reached (:meth:`result` fills the rest), so the merging costs reads and writes of the
    accumulators only where two calls meet."""

    def __init__(self, batch: int, rows: int, heads: int, dim: int, dtype: torch.dtype,
                 device) -> None:
        acc = accumulation_dtype(dtype)
        self.out = torch.empty(batch, rows, heads, dim, dtype=acc, device=device)
        self.lse = torch.empty((batch, heads, rows), dtype=acc, device=device)
        self._rows = rows
        self._reached: List[Tuple[int, int]] = []  # disjoint, sorted row ranges

    def _fresh(self, r0: int, r1: int) -> bool:
        return all(b1 <= r0 or r1 <= b0 for b0, b1 in self._reached)

    def _mark(self, r0: int, r1: int) -> None:
        spans = sorted(self._reached + [(r0, r1)])
        merged = [spans[0]]
        for a, b in spans[1:]:
            if a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        self._reached = merged

    def add(self, rows: Tuple[int, int], out: Tensor, lse: Tensor) -> None:
        r0, r1 = rows
        if r0 >= r1:
            return
        if self._fresh(r0, r1):
            self.out[:, r0:r1].copy_(out)
            self.lse[:, :, r0:r1].copy_(lse)
            self._mark(r0, r1)
            return
        if not any(a <= r0 and r1 <= b for a, b in self._reached):
            # Rows partly reached before: bring the unreached ones to (0, -inf) first.
            self._clear_unreached(r0, r1)
        old = self.lse[:, :, r0:r1]
        new = torch.logaddexp(old, lse)
        # Rows still without any visible key: both weights 0 (not exp(nan)).
        ref = torch.where(new == float("-inf"), torch.zeros_like(new), new)
        w_old = torch.exp(old - ref).transpose(1, 2).unsqueeze(-1)
        w_new = torch.exp(lse - ref).transpose(1, 2).unsqueeze(-1)
        acc = self.out[:, r0:r1]
        acc.mul_(w_old).addcmul_(out, w_new)
        self.lse[:, :, r0:r1] = new
        self._mark(r0, r1)

    def _clear_unreached(self, r0: int, r1: int) -> None:
        at = r0
        for a, b in self._reached:
            if b <= at or a >= r1:
                continue
            if a > at:
                self.out[:, at:a].zero_()
                self.lse[:, :, at:a].fill_(float("-inf"))
            at = max(at, b)
        if at < r1:
            self.out[:, at:r1].zero_()
            self.lse[:, :, at:r1].fill_(float("-inf"))

    def result(self, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
        """``(out in dtype, lse)``: the merged rows, 0 / -inf where no call reached."""
        self._clear_unreached(0, self._rows)
        self._reached = [(0, self._rows)] if self._rows else []
        return self.out.to(dtype), self.lse


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


def translate_bounds(bounds: Tensor, query_pos: int, num_rows: int, num_cols: int) -> Tensor:
    """Key-interval bounds in global query positions -> those of a local call whose row 0 is
    global position ``query_pos``: the local call places row ``i`` at ``i + Lk - Lq``."""
    shift = num_cols - num_rows - query_pos
    out = bounds.to(torch.int64) + shift
    return out.clamp_(-_CLAMP, _CLAMP).to(torch.int32).contiguous()


def pad4(name: str, t: Optional[Tensor]) -> Optional[Tensor]:
    """A mask or bias as a 4-D view (fewer dims are left-padded with 1s)."""
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dim() > 4:
        raise ValueError(f"{name} must have at most 4 dims, got shape {tuple(t.shape)}")
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) if t.dim() < 4 else t
