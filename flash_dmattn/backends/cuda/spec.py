"""What one compiled CUDA kernel module is specialised for.

A :class:`KernelSpec` keys on what must be known at compile time to generate good code, and
on nothing else, because every extra key multiplies the number of builds (and each build of the
forward and backward kernels takes minutes):

* ``head_dim`` bucket (32/64/96/128/192/256): tile shapes, shared-memory layout and register
  allocation depend on it. Head dims in between run in the next bucket (the kernel pads
  internally, never the caller's tensors).
* ``dtype`` (fp16/bf16): selects the MMA instructions and conversions.
* ``has_mask`` / ``has_bias``: whether the kernels load a mask / bias tile per block (and
  compute dbias in backward). Compiling the loads out saves global traffic, shared memory and
  registers on the common no-mask / mask-only paths.
* ``packed``: packed sequences (``flash_dmattn_varlen_func``). Every tile then reads its
  sequence's offsets and lengths, which held in registers made the Hopper dK/dV kernel spill
  four times as much and the dense backward markedly slower when it was a runtime switch;
  dense calls never pay for it in a module of their own.

Deliberately *not* keyed (runtime arguments of ``fwd`` / ``bwd``, switched inside one module):
``is_causal`` (changes a loop bound and a predicate on diagonal tiles), ``softcap``,
``softmax_scale``, ``deterministic``, sequence lengths and strides. (Keying softcap would
compile each kernel once instead of twice, but saves little compile time per module --
nvcc's front end parsing CuTe dominates each translation unit -- and would add a module
for every softcapped model.) The GPU architecture is not
part of the spec either: it is part of the cache path and key (see :mod:`.jit`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch

HEAD_DIM_BUCKETS: Tuple[int, ...] = (32, 64, 96, 128, 192, 256)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_FLAGS = ("mask", "bias", "varlen")


@dataclass(frozen=True)
class KernelSpec:
    """One specialisation of the CUDA kernels; its :attr:`name` reads ``d128-bf16-mask-bias``."""

    head_dim: int
    dtype: str
    has_mask: bool = False
    has_bias: bool = False
    packed: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int):
            raise ValueError(f"head_dim must be an int, got {self.head_dim!r}")
        if self.head_dim not in HEAD_DIM_BUCKETS:
            raise ValueError(
                f"head_dim {self.head_dim} is not a kernel bucket; buckets are "
                f"{', '.join(map(str, HEAD_DIM_BUCKETS))}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        for flag in ("has_mask", "has_bias", "packed"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")

    # Names ---------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """Stable, canonical name, e.g. ``d128-bf16-mask-bias``, ``d64-fp16`` or
        ``d128-bf16-bias-varlen`` (packed sequences)."""
        parts = [f"d{self.head_dim}", self.dtype]
        if self.has_mask:
            parts.append("mask")
        if self.has_bias:
            parts.append("bias")
        if self.packed:
            parts.append("varlen")
        return "-".join(parts)

    @property
    def ident(self) -> str:
        """:attr:`name` as a Python identifier fragment (extension module names need one)."""
        return self.name.replace("-", "_")

    def __str__(self) -> str:
        return self.name

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @classmethod
    def parse(cls, text: str) -> "KernelSpec":
        """Parse a name such as ``d128-bf16-mask-bias`` (flags in any order, each at most once).

        Raises ``ValueError`` naming what is wrong and what is accepted.
        """
        if not isinstance(text, str):
            raise ValueError(f"a kernel spec must be a string, got {type(text).__name__}")
        usage = ("expected d<head_dim>-<fp16|bf16>[-mask][-bias][-varlen], e.g. "
                 "d128-bf16-mask-bias")
        parts = text.strip().lower().split("-")
        if len(parts) < 2 or not parts[0].startswith("d") or not parts[0][1:].isdigit():
            raise ValueError(f"bad kernel spec {text!r}: {usage}")
        head_dim, dtype, flags = int(parts[0][1:]), parts[1], parts[2:]
        unknown = [f for f in flags if f not in _FLAGS]
        if unknown:
            raise ValueError(f"bad kernel spec {text!r}: unknown flag(s) {unknown}; {usage}")
        if len(set(flags)) != len(flags):
            raise ValueError(f"bad kernel spec {text!r}: repeated flag; {usage}")
        try:
            return cls(head_dim, dtype, "mask" in flags, "bias" in flags, "varlen" in flags)
        except ValueError as exc:
            raise ValueError(f"bad kernel spec {text!r}: {exc}") from None

    @classmethod
    def from_inputs(cls, inputs) -> "KernelSpec":
        """The spec that runs ``inputs`` (an AttentionInputs or VarlenInputs).

        Raises ``ValueError`` when no spec can: head dim above the largest bucket, or a dtype
        other than float16 / bfloat16.
        """
        return cls.for_call(inputs.head_dim, inputs.dtype, inputs.attn_mask is not None,
                            inputs.attn_bias is not None,
                            packed=hasattr(inputs, "cu_seqlens_q"))

    @classmethod
    def for_call(cls, head_dim: int, dtype: torch.dtype, has_mask: bool,
                 has_bias: bool, packed: bool = False) -> "KernelSpec":
        """The spec for a call with these properties: the smallest bucket >= ``head_dim``."""
        bucket = next((b for b in HEAD_DIM_BUCKETS if b >= head_dim), None)
        if bucket is None:
            raise ValueError(f"head_dim {head_dim} > {HEAD_DIM_BUCKETS[-1]}")
        names = {v: k for k, v in DTYPES.items()}
        if dtype not in names:
            raise ValueError(f"dtype {dtype} is not supported (float16, bfloat16)")
        return cls(bucket, names[dtype], has_mask, has_bias, packed)

    def defines(self) -> List[str]:
        """Preprocessor definitions that select this specialisation in ``csrc``."""
        return [
            f"-DFLASH_DMATTN_HEADDIM={self.head_dim}",
            f"-DFLASH_DMATTN_IS_BF16={int(self.dtype == 'bf16')}",
            f"-DFLASH_DMATTN_HAS_MASK={int(self.has_mask)}",
            f"-DFLASH_DMATTN_HAS_BIAS={int(self.has_bias)}",
            f"-DFLASH_DMATTN_PACKED={int(self.packed)}",
        ]


def all_specs() -> List[KernelSpec]:
    """Every specialisation (what ``python -m flash_dmattn build --all`` builds)."""
    return [
        KernelSpec(d, dt, m, b, packed)
        for packed in (False, True)
        for d in HEAD_DIM_BUCKETS
        for dt in DTYPES
        for m in (False, True)
        for b in (False, True)
    ]
