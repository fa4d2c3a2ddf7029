"""Random attention problems covering the contract's shapes (docs/contract.md), broadcasts and special rows."""
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch
from hypothesis import strategies as st


@dataclass
class Case:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    kv_heads: int
    head_dim: int
    mask_shape: Optional[Tuple[int, ...]]
    bias_shape: Optional[Tuple[int, ...]]
    causal: bool
    softcap: float
    empty_rows: bool = False      # force some fully masked query rows
    neg_inf_bias: bool = False    # put -inf entries (and a whole -inf row) in the bias
    scale: Optional[float] = None
    seed: int = 0
    extras: dict = field(default_factory=dict)

    def tensors(self, dtype=torch.float64, device="cpu", requires_grad=False):
        g = torch.Generator().manual_seed(self.seed)

        def randn(*shape):
            return torch.randn(*shape, generator=g, dtype=torch.float64)

        q = randn(self.batch, self.seqlen_q, self.heads, self.head_dim)
        k = randn(self.batch, self.seqlen_k, self.kv_heads, self.head_dim)
        v = randn(self.batch, self.seqlen_k, self.kv_heads, self.head_dim)
        mask = bias = None
        if self.mask_shape is not None:
            mask = torch.rand(*self.mask_shape, generator=g) > 0.35
            if self.empty_rows and mask.dim() >= 2 and mask.shape[-2] > 1:
                mask[..., 0, :] = False
        if self.bias_shape is not None:
            bias = randn(*self.bias_shape)
            if self.neg_inf_bias:
                bias = bias.masked_fill(torch.rand(*self.bias_shape, generator=g) < 0.2, float("-inf"))
                if bias.dim() >= 2 and bias.shape[-2] > 1:
                    bias[..., -1, :] = float("-inf")
        out = []
        for t in (q, k, v):
            t = t.to(device=device, dtype=dtype)
            out.append(t.requires_grad_(requires_grad))
        if mask is not None:
            mask = mask.to(device)
        if bias is not None:
            bdtype = dtype if dtype != torch.float64 else torch.float64
            bias = bias.to(device=device, dtype=bdtype).requires_grad_(requires_grad)
        return (*out, mask, bias)


def _aux_shape(draw, b, h, hkv, lq, lk):
    rank = draw(st.integers(1, 4))
    dims = (
        draw(st.sampled_from(sorted({1, b}))),
        draw(st.sampled_from(sorted({1, hkv, h}))),
        draw(st.sampled_from(sorted({1, lq}))),
        draw(st.sampled_from(sorted({1, lk}))),
    )
    # Fewer than 4 dims are left-padded by the library; only drop leading size-1 dims.
    shape = list(dims)
    while len(shape) > rank and shape[0] == 1:
        shape.pop(0)
    return tuple(shape)


@st.composite
def cases(draw, max_len=40, head_dims=(8, 16, 24)):
    b = draw(st.integers(1, 2))
    hkv = draw(st.sampled_from([1, 2]))
    h = hkv * draw(st.sampled_from([1, 2, 3]))
    lq = draw(st.integers(1, max_len))
    lk = draw(st.integers(1, max_len))
    d = draw(st.sampled_from(head_dims))
    mask_shape = draw(st.none() | st.just(0))
    bias_shape = draw(st.none() | st.just(0))
    if mask_shape is not None:
        mask_shape = _aux_shape(draw, b, h, hkv, lq, lk)
    if bias_shape is not None:
        bias_shape = _aux_shape(draw, b, h, hkv, lq, lk)
    return Case(
        batch=b, seqlen_q=lq, seqlen_k=lk, heads=h, kv_heads=hkv, head_dim=d,
        mask_shape=mask_shape, bias_shape=bias_shape,
        causal=draw(st.booleans()),
        softcap=draw(st.sampled_from([0.0, 0.0, 3.0])),
        empty_rows=draw(st.booleans()),
        neg_inf_bias=draw(st.booleans()),
        scale=draw(st.sampled_from([None, None, 0.0, 0.3])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


# Hand-picked shapes every backend test runs in addition to the random ones.
FIXED = [
    Case(2, 63, 65, 4, 2, 16, (2, 2, 63, 65), (2, 2, 1, 65), True, 0.0, empty_rows=True),
    Case(1, 65, 129, 4, 1, 32, (1, 1, 1, 129), (1, 4, 65, 129), True, 0.0),          # Lq < Lk causal
    Case(1, 129, 63, 2, 2, 16, None, (1, 1, 129, 63), True, 0.0),                       # Lq > Lk: empty rows
    Case(2, 17, 33, 6, 2, 16, (2, 1, 1, 33), None, False, 5.0),                           # key padding mask
    Case(1, 33, 33, 2, 1, 8, (1, 1, 33, 33), (1, 1, 33, 33), False, 0.0, neg_inf_bias=True),
    Case(2, 1, 40, 4, 2, 16, (2, 2, 1, 40), (2, 2, 1, 40), True, 0.0),                  # decode row
]
