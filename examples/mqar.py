"""Multi-query associative recall (MQAR) with Dynamic Mask Attention: a training demo.

MQAR (Arora et al., "Zoology", 2023) asks a model to recall, for many queries in one
sequence, the value that was paired with a key much earlier. It is the synthetic task that
best separates attention from sub-quadratic mixers, and it is a natural test of DMA's key
selection: with ``window_size`` smaller than the sequence, each query only attends to the
``window_size`` keys with the largest learned bias, so the model must learn to keep the
key-value pairs (and not the filler) inside its window.

Sequence layout (``L = seq_len``, ``N = num_pairs``, ``Q = num_queries``, default ``Q = N``)::

    position  0 .. 2N-1        k_1 v_1 k_2 v_2 ... k_N v_N     the key-value pairs
    position  2N .. L-2Q-1     f f f ... f                     filler / noise tokens
    position  L-2Q .. L-1      k_a f k_b f ...                 Q queries: keys seen above,
                                                               each followed by a filler token

Token ids come from three disjoint ranges: keys ``[0, key_vocab)``, values
``[key_vocab, key_vocab + value_vocab)``, filler after that. The keys of one sequence are
distinct (so every query has one answer); values are drawn with replacement; the queried
keys are a random subset (in random order) of the sequence's keys.

As in Zoology, the answers are labels only: the position holding a query key is trained to
predict the value paired with that key, and that value does not appear in the query part of
the input (the token after each query key is filler). Every other position has target
``-100`` (ignored), so the loss and the accuracy only cover the ``Q`` query positions.
Accuracy is the fraction of those positions whose argmax prediction is exactly the paired
value. (An earlier version put each answer after its query as the next token; that let a
model score ~H_N / N, 0.34 for 8 pairs, without any recall, by guessing among the pair values
not yet given in the query part, and models with MLPs stayed on that shortcut.)

The model is a small pre-norm transformer: token embedding, rotary positions (passed to
the attention layer as ``position_embeddings=(cos, sin)``), 2 attention-only blocks
``RMSNorm -> attention -> residual`` (Zoology's MQAR models have no MLP either;
``--mlp-ratio`` adds ``RMSNorm -> MLP -> residual``), a final RMSNorm and an LM head. The
q/k projections start at std ``d_model ** -0.5`` (not GPT-2's 0.02) and the rotary base is
1e6 (not 10000); examples/README.md ("CPU checks") has the measurements behind both. The
attention is :class:`flash_dmattn.modules.DynamicMaskAttention` (causal, GQA optional) with the chosen ``window_size``; ``full`` uses ``window_size = seq_len`` (DMA bias,
no key selection) and ``dense`` swaps in plain causal attention through
``torch.nn.functional.scaled_dot_product_attention`` (same projections and rotary, no DMA
bias) as the time-per-step baseline.

Window warm-up (``--window-warmup FRAC``, default 0.2; 0 disables it): a fixed window smaller
than the sequence must select the needed keys before the recall circuit exists, yet the bias
that ranks the keys learns to favour the pair values only once recall works (it gets gradient
only through the keys it selected), so a fixed small window learns in some seeds and stays at
chance in others. With the warm-up every DMA layer trains the first ``FRAC`` of the steps with
the full window (``window_size = seq_len``: bias on, no key dropped), then the window shrinks
geometrically to its target over the next ``--window-decay`` of the steps (default ``FRAC``),
then stays there. Evaluations always use the target window; the JSON history records the
window each step trained with, and :func:`window_coverage` (the ``coverage`` columns) measures
how often a layer's selection holds the queried pair's value. ``full`` and ``dense`` are not
affected. Measurements: examples/README.md, "Window warm-up".

Run::

    python -m examples.mqar --smoke --device cpu --out /tmp/mqar        # seconds, on CPU
    python -m examples.mqar --device cpu --seq-len 64 --num-pairs 8 --d-model 64 --num-heads 2 \\
        --windows dense --steps 1500 --batch-size 64 --eval-every 250     # solves it: ~1.0

One model is trained per window setting, from the same initialisation (same seed) on the
same stream of batches; the script reports the final eval accuracy and the median training
step time, and writes ``mqar.json``, ``mqar.md`` and (with matplotlib) ``mqar.png`` to
``--out``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import platform
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from flash_dmattn.modules import DynamicMaskAttention, apply_rotary_pos_emb
from flash_dmattn.utils.dynamic import dynamic_mask_bias
from flash_dmattn.utils.mask import topk_intervals

__all__ = [
    "IGNORE_INDEX",
    "MQARConfig",
    "ModelConfig",
    "TrainConfig",
    "MQARModel",
    "DenseAttention",
    "generate_batch",
    "query_positions",
    "rotary_tables",
    "parse_windows",
    "window_schedule",
    "window_warmup_steps",
    "check_window_warmup",
    "window_coverage",
    "train_model",
    "evaluate",
    "main",
]

IGNORE_INDEX = -100

# Where results go when --out is not given: examples/results/<device-slug>/.
DEFAULT_RESULTS = Path(__file__).resolve().parent / "results"


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------
@dataclass
class MQARConfig:
    """Shape of the synthetic task (see the module docstring for the layout).

    Args:
        seq_len: tokens per sequence ``L``.
        num_pairs: key-value pairs per sequence ``N``.
        num_queries: queries per sequence ``Q`` (``None``: ``N``, every key queried once).
        key_vocab: number of distinct key tokens (``>= num_pairs``: keys of a sequence are distinct).
        value_vocab: number of distinct value tokens.
        filler_vocab: number of distinct filler tokens.
    """

    seq_len: int = 1024
    num_pairs: int = 64
    num_queries: Optional[int] = None
    key_vocab: int = 256
    value_vocab: int = 256
    filler_vocab: int = 64

    def __post_init__(self) -> None:
        for name in ("seq_len", "num_pairs", "key_vocab", "value_vocab", "filler_vocab"):
            _check_positive(name, getattr(self, name))
        if self.num_queries is None:
            self.num_queries = self.num_pairs
        _check_positive("num_queries", self.num_queries)
        if self.num_queries > self.num_pairs:
            raise ValueError(
                f"num_queries ({self.num_queries}) must be <= num_pairs ({self.num_pairs}): "
                "each query asks for a distinct key of the sequence"
            )
        if self.key_vocab < self.num_pairs:
            raise ValueError(
                f"key_vocab ({self.key_vocab}) must be >= num_pairs ({self.num_pairs}) so the keys "
                "of a sequence can be distinct"
            )
        needed = 2 * self.num_pairs + 2 * self.num_queries
        if self.seq_len < needed:
            raise ValueError(
                f"seq_len ({self.seq_len}) is too short for {self.num_pairs} pairs and "
                f"{self.num_queries} queries: needs at least 2*num_pairs + 2*num_queries = {needed}"
            )

    @property
    def value_offset(self) -> int:
        return self.key_vocab

    @property
    def filler_offset(self) -> int:
        return self.key_vocab + self.value_vocab

    @property
    def vocab_size(self) -> int:
        return self.key_vocab + self.value_vocab + self.filler_vocab

    @property
    def query_start(self) -> int:
        """Position of the first query key."""
        return self.seq_len - 2 * self.num_queries


def _check_positive(name: str, value) -> int:
    # bool is an int subclass; True silently meaning 1 would hide a caller bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def query_positions(cfg: MQARConfig, device=None) -> torch.Tensor:
    """The ``Q`` positions (the same in every sequence) whose target is a paired value."""
    return torch.arange(cfg.query_start, cfg.seq_len, 2, device=device)


def generate_batch(
    cfg: MQARConfig,
    batch_size: int,
    generator: torch.Generator,
    device=None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Draw ``batch_size`` MQAR sequences.

    Args:
        cfg: the task's shape.
        batch_size: number of sequences ``B``.
        generator: a ``torch.Generator`` on ``device``; the batch is a deterministic
            function of its state, so a seeded generator gives reproducible data.
        device: where the tensors are built (default: the generator's device).

    Returns:
        ``(tokens, targets)``, both ``(B, L)`` int64 on ``device``. ``targets`` is
        ``IGNORE_INDEX`` everywhere except at :func:`query_positions`, where it holds the
        value paired with the query key found at that position of ``tokens``.
    """
    _check_positive("batch_size", batch_size)
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    device = torch.device(generator.device if device is None else device)
    if device.type != generator.device.type:
        # torch samples on the generator's device only; a mismatch fails deep inside torch.
        raise ValueError(f"generator is on {generator.device} but device is {device}")
    n, q, length = cfg.num_pairs, cfg.num_queries, cfg.seq_len

    # Distinct keys per row: the first N entries of a per-row random permutation (argsort of
    # uniform noise), which stays vectorised over the batch, unlike randperm.
    keys = torch.rand(batch_size, cfg.key_vocab, generator=generator, device=device).argsort(-1)[:, :n]
    values = cfg.value_offset + torch.randint(
        cfg.value_vocab, (batch_size, n), generator=generator, device=device
    )
    tokens = cfg.filler_offset + torch.randint(
        cfg.filler_vocab, (batch_size, length), generator=generator, device=device
    )
    tokens[:, 0 : 2 * n : 2] = keys
    tokens[:, 1 : 2 * n : 2] = values

    # Which pairs are asked for, and in which order: a random subset per row.
    picked = torch.rand(batch_size, n, generator=generator, device=device).argsort(-1)[:, :q]
    query_keys = keys.gather(1, picked)
    query_values = values.gather(1, picked)
    start = cfg.query_start
    tokens[:, start::2] = query_keys
    # The answers are labels only (as in Zoology): the token after each query key stays
    # filler. Writing the value there, as text would, lets later queries be guessed by
    # elimination among the pair values not yet given, a shortcut that needs no recall.

    targets = torch.full_like(tokens, IGNORE_INDEX)
    targets[:, start::2] = query_values
    return tokens, targets


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------
@dataclass
class ModelConfig:
    """Model shape. ``window`` is an int (DMA ``window_size``), ``"full"`` (DMA with
    ``window_size = seq_len``) or ``"dense"`` (plain SDPA attention).

    ``mlp_ratio = 0`` (the default) builds attention-only blocks, as Zoology's MQAR models
    (``state_mixer = Identity``); ``> 0`` adds an MLP of width ``mlp_ratio * d_model``.
    ``qk_init_std`` is the init std of the q/k projections (``None``: ``d_model ** -0.5``);
    see ``MQARModel.__init__`` for why it is not the 0.02 of the other weights.
    ``rope_base`` defaults to 1e6: with 10000 most rotary frequencies turn the q.k product
    several times over a few hundred positions, leaving few head dims for matching a key far
    back by content; on CPU, seq 128 / 16 pairs / d_model 64 stalled at 0.07 accuracy for
    2000 steps with 10000 and solved it (1.0) by step 750 with 1e6.
    ``dma_a_init`` (``None``: the library's ``A_INIT``) re-initialises every DMA layer's ``A``,
    the per-head scale of the bias ``exp(A * softplus(dt_proj(v)))``; nonzero.
    """

    vocab_size: int
    seq_len: int
    d_model: int = 128
    num_heads: int = 4
    num_kv_heads: Optional[int] = None
    num_layers: int = 2
    mlp_ratio: int = 0
    window: object = "full"
    backend: Optional[str] = None
    rope_base: float = 1e6
    qk_init_std: Optional[float] = None
    dma_a_init: Optional[float] = None


def rotary_tables(
    seq_len: int, head_dim: int, base: float = 10000.0, device=None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Llama-style rotary ``(cos, sin)``, each ``(seq_len, head_dim)`` float32, with the
    ``head_dim / 2`` frequencies repeated over both halves (what ``rotate_half`` expects)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class DenseAttention(nn.Module):
    """Plain causal GQA self-attention (SDPA) with the same projections and rotary handling
    as :class:`DynamicMaskAttention`, minus the DMA bias and key selection: the baseline."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: Optional[int] = None) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads != 0 or hidden_size % num_heads != 0:
            raise ValueError(
                f"need num_heads % num_kv_heads == 0 and hidden_size % num_heads == 0, got "
                f"hidden_size={hidden_size}, num_heads={num_heads}, num_kv_heads={num_kv_heads}"
            )
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_embeddings=None) -> torch.Tensor:
        if attention_mask is not None:
            # MQAR batches are never padded; refusing beats silently ignoring a mask.
            raise ValueError("DenseAttention does not take a padding mask")
        b, length, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, length, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(b, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(b, length, self.num_kv_heads, self.head_dim)
        if position_embeddings is not None:
            q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.num_kv_heads != self.num_heads:
            # repeat instead of enable_gqa=True: SDPA's fused kernels do not all take GQA.
            g = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, length, -1))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then (``mlp_ratio > 0``)
    ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model)
        if cfg.window == "dense":
            self.attn = DenseAttention(cfg.d_model, cfg.num_heads, cfg.num_kv_heads)
        else:
            window_size = cfg.seq_len if cfg.window == "full" else int(cfg.window)
            self.attn = DynamicMaskAttention(
                cfg.d_model,
                cfg.num_heads,
                num_kv_heads=cfg.num_kv_heads,
                window_size=window_size,
                is_causal=True,
                backend=cfg.backend,
            )
        self.mlp_norm = self.mlp = None
        if cfg.mlp_ratio:
            self.mlp_norm = nn.RMSNorm(cfg.d_model)
            self.mlp = nn.Sequential(
                nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False),
                nn.GELU(),
                nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False),
            )

    def forward(self, x: torch.Tensor, rope: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), position_embeddings=rope)
        if self.mlp is None:
            return x
        return x + self.mlp(self.mlp_norm(x))


class MQARModel(nn.Module):
    """Token embedding + rotary positions -> ``num_layers`` blocks -> RMSNorm -> LM head.

    ``forward(tokens (B, L) int64) -> logits (B, L, vocab_size)``;
    ``forward(tokens, positions (P,) int64) -> logits (B, P, vocab_size)`` only at ``positions``
    (training and evaluation only need the query positions; this skips the LM head elsewhere).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.num_heads != 0:
            raise ValueError(f"d_model ({cfg.d_model}) must be divisible by num_heads ({cfg.num_heads})")
        if isinstance(cfg.mlp_ratio, bool) or not isinstance(cfg.mlp_ratio, int) or cfg.mlp_ratio < 0:
            raise ValueError(f"mlp_ratio must be an int >= 0, got {cfg.mlp_ratio!r}")
        self.cfg = cfg
        self.head_dim = cfg.d_model // cfg.num_heads
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.seq_len, self.head_dim, cfg.rope_base)
        # Buffers follow .to(device); non-persistent since they are a pure function of the config.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        # The q/k projections are re-initialised with std d_model ** -0.5 (PyTorch's default
        # Linear scale). With GPT-2's 0.02 at these small widths (tuned for d_model >= 768) the
        # attention logits start near 0.03: every head is uniform, and the gradient that would
        # grow the bilinear q.k form is itself scaled by the tiny weights. The 2-layer recall
        # circuit (a previous-token head in layer 1, a key-matching head in layer 2) then does
        # not form: on CPU (seq 64, 8 pairs, d_model 64) the dense baseline sat at the
        # "copy a value that has not been answered yet" plateau (accuracy ~0.32) for 4000 steps
        # with 0.02, and reached 1.0 by step 500 with std 0.125 (examples/README.md).
        qk_std = cfg.d_model ** -0.5 if cfg.qk_init_std is None else cfg.qk_init_std
        for block in self.blocks:
            for proj in (block.attn.q_proj, block.attn.k_proj):
                nn.init.normal_(proj.weight, std=qk_std)
        if cfg.dma_a_init is not None:
            a = cfg.dma_a_init
            if isinstance(a, bool) or not isinstance(a, (int, float)):
                raise TypeError(f"dma_a_init must be a number or None, got {type(a).__name__}")
            if not math.isfinite(a) or a == 0:
                # A == 0 makes the bias the constant 1: no key ranking and no gradient to dt_proj.
                raise ValueError(f"dma_a_init must be finite and nonzero, got {a}")
            for block in self.blocks:
                if isinstance(block.attn, DynamicMaskAttention):
                    nn.init.constant_(block.attn.A, float(a))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2-style small init for everything but q/k (see __init__); PyTorch's default
        # Embedding init (std 1) makes the residual stream large relative to the blocks'
        # outputs and slows early training.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.cfg.seq_len:
            raise ValueError(f"sequence length {length} exceeds the model's seq_len {self.cfg.seq_len}")
        rope = (self.rope_cos[:length], self.rope_sin[:length])
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, rope)
        if positions is not None:
            x = x[:, positions]
        return self.lm_head(self.norm(x))


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    """Optimisation and measurement settings."""

    steps: int = 2000
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.1
    warmup_frac: float = 0.05  # linear LR warm-up, then cosine decay to 10 %
    eval_size: int = 1024
    eval_every: int = 0  # 0: evaluate only at the end
    timing_warmup: int = 20  # steps excluded from the ms/step median (compile, autotune, caches)
    seed: int = 0
    dtype: str = "fp32"  # "bf16": autocast (CUDA); "fp32": no autocast
    # DMA window warm-up (see window_schedule): the fraction of the steps trained with the
    # full window (window_size = seq_len), then the fraction over which the window shrinks
    # geometrically to its target (None: the same as window_warmup). 0: no warm-up.
    window_warmup: float = 0.0
    window_decay: Optional[float] = None

    def __post_init__(self) -> None:
        check_window_warmup(self.window_warmup, self.window_decay)


def parse_windows(text: str) -> List[object]:
    """``"32,64,full,dense"`` -> ``[32, 64, "full", "dense"]`` (ints > 0, ``full``, ``dense``).

    An int at or above the sequence length behaves like ``full`` (DMA only selects keys
    when the sequence is longer than its window) and is kept under its own label."""
    out: List[object] = []
    for raw in text.split(","):
        item = raw.strip().lower()
        if not item:
            continue
        if item in ("full", "dense"):
            out.append(item)
            continue
        try:
            value = int(item)
        except ValueError:
            raise ValueError(f"window {raw!r} is not an int, 'full' or 'dense'") from None
        if value <= 0:
            raise ValueError(f"window sizes must be > 0, got {value}")
        out.append(value)
    if not out:
        raise ValueError("no window settings given")
    if len(set(map(str, out))) != len(out):
        raise ValueError(f"duplicate window settings in {text!r}")
    return out


def check_window_warmup(warmup_frac, decay_frac=None) -> Tuple[float, float]:
    """Validate a window warm-up schedule; returns ``(warmup_frac, decay_frac)`` with the
    default ``decay_frac = warmup_frac`` filled in.

    Both fractions must be real numbers ``>= 0`` with ``warmup_frac + decay_frac < 1``, so
    that the last steps train at the target window (the one the final evaluation uses).
    Raises ``TypeError`` for non-numbers (and bools) and ``ValueError`` for bad values.
    """
    if decay_frac is None:
        decay_frac = warmup_frac
    for name, value in (("window_warmup", warmup_frac), ("window_decay", decay_frac)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {type(value).__name__}")
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite fraction >= 0, got {value}")
    if warmup_frac + decay_frac >= 1:
        raise ValueError(
            f"window_warmup + window_decay must be < 1 so the last steps train at the target "
            f"window, got {warmup_frac} + {decay_frac}"
        )
    return float(warmup_frac), float(decay_frac)


def window_warmup_steps(total_steps: int, warmup_frac: float, decay_frac: Optional[float] = None) -> Tuple[int, int]:
    """``(full_steps, decay_steps)`` of a window warm-up over ``total_steps``: the fractions
    rounded down (the step counts are stated in logs and reports), so at least the last step
    trains at the target window."""
    _check_positive("total_steps", total_steps)
    warmup_frac, decay_frac = check_window_warmup(warmup_frac, decay_frac)
    # The 1e-9 keeps e.g. 0.29 * 100 = 28.999999999999996 from rounding down to 28.
    full_steps = min(total_steps - 1, int(warmup_frac * total_steps + 1e-9))
    decay_steps = min(total_steps - 1 - full_steps, int(decay_frac * total_steps + 1e-9))
    return full_steps, decay_steps


def window_schedule(
    step: int,
    total_steps: int,
    target: int,
    seq_len: int,
    warmup_frac: float,
    decay_frac: Optional[float] = None,
) -> int:
    """The DMA ``window_size`` for training step ``step`` (0-based) of ``total_steps``.

    The window warm-up: for the first ``full_steps`` steps the layer attends with the full
    window ``seq_len`` (the DMA bias is on, no key is dropped), so the recall circuit can form
    with every key visible; over the next ``decay_steps`` steps the window shrinks
    geometrically from ``seq_len`` to ``target`` (a constant ratio per step, so the selection
    tightens as gently at small windows as at large ones); after that it is ``target``.
    ``(full_steps, decay_steps)`` are the fractions ``warmup_frac`` and ``decay_frac`` (default
    ``warmup_frac``) of ``total_steps``, rounded down (:func:`window_warmup_steps`).

    The result is non-increasing in ``step``, is ``seq_len`` at step 0 when ``full_steps > 0``
    and ``target`` on the last step. ``warmup_frac = decay_frac = 0`` (and any
    ``target >= seq_len``) gives ``target`` throughout. Raises ``TypeError`` / ``ValueError``
    for non-int or out-of-range arguments (see :func:`check_window_warmup` for the fractions).
    """
    for name, value in (("step", step), ("total_steps", total_steps), ("target", target), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if step < 0 or step >= total_steps:
        raise ValueError(f"step must be in [0, total_steps={total_steps}), got {step}")
    _check_positive("target", target)
    _check_positive("seq_len", seq_len)
    warmup_frac, decay_frac = check_window_warmup(warmup_frac, decay_frac)
    if target >= seq_len:
        return target
    full_steps, decay_steps = window_warmup_steps(total_steps, warmup_frac, decay_frac)
    if step < full_steps:
        return seq_len
    if step < full_steps + decay_steps:
        t = (step - full_steps + 1) / decay_steps  # in (0, 1]: reaches the target on its last step
        return max(target, min(seq_len, int(round(seq_len * (target / seq_len) ** t))))
    return target


def _autocast(device: torch.device, dtype: str):
    if dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return torch.autocast(device_type=device.type, enabled=False)


def _sync(device: torch.device) -> None:
    # CUDA kernels run asynchronously; without a sync the timer measures launch time only.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _lr_factor(step: int, total: int, warmup_frac: float) -> float:
    warmup = max(1, int(total * warmup_frac))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _loss(sel_logits: torch.Tensor, sel_targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``(B, Q, V)`` logits at the query positions against their ``(B, Q)`` targets.

    Only the query positions carry targets, so the model computes logits there only (the LM
    head and the float32 cross-entropy over Q positions instead of L)."""
    sel_logits = sel_logits.float()
    return F.cross_entropy(sel_logits.reshape(-1, sel_logits.shape[-1]), sel_targets.reshape(-1))


def _dma_layers(model: nn.Module) -> List[DynamicMaskAttention]:
    return [m for m in model.modules() if isinstance(m, DynamicMaskAttention)]


def _set_window(model: nn.Module, window_size: int) -> None:
    # window_size is a plain attribute read by every DynamicMaskAttention.forward.
    for layer in _dma_layers(model):
        layer.window_size = window_size


@torch.no_grad()
def window_coverage(model: nn.Module, task: MQARConfig, tokens: torch.Tensor) -> Dict[str, List[float]]:
    """How often each DMA layer's key selection holds what recall needs, on one batch.

    For every query of ``tokens`` (``(B, L)``, laid out as :func:`generate_batch` makes them)
    the needed key is the position of the queried pair's *value* (``2 * i + 1`` for pair
    ``i``): there the value token sits and, through a previous-token head of an earlier
    layer, its key. The selection is recomputed exactly as ``DynamicMaskAttention`` does it
    (the bias ``exp(A * softplus(dt_proj(v)))`` of the layer's input in this forward pass, the
    causal top-``window_size`` by :func:`flash_dmattn.utils.mask.topk_intervals`, at each
    layer's current ``window_size``).

    For the 2-layer recall circuit the last layer's numbers are the ones that matter. They
    are a lower bound on what recall can use: an earlier layer can also copy a pair into the
    token after its value, which the last layer may read instead (on CPU some windowed models
    scored above their last layer's ``coverage_any``).

    Returns ``{"coverage": [...], "coverage_any": [...]}`` with one entry per DMA layer (in
    model order): the fraction of (query, kv head) pairs whose window holds the needed value
    position, and the fraction of queries for which at least one kv head's window does. Both
    are 1.0 for a layer whose window is at least the sequence length (no key is dropped).
    Call it under the same autocast as the model's forward so the bias dtype matches.
    """
    return _forward_with_coverage(model, task, tokens)[1]


def _forward_with_coverage(
    model: nn.Module, task: MQARConfig, tokens: torch.Tensor
) -> Tuple[torch.Tensor, Dict[str, List[float]]]:
    # One forward pass gives both the logits at the query positions and (through hooks that
    # keep each DMA layer's input) the coverage of window_coverage.
    positions = query_positions(task, tokens.device)
    layers = _dma_layers(model)
    inputs: Dict[int, torch.Tensor] = {}
    hooks = [
        layer.register_forward_pre_hook(lambda mod, args, i=i: inputs.__setitem__(i, args[0]))
        for i, layer in enumerate(layers)
    ]
    try:
        logits = model(tokens, positions)
    finally:
        for h in hooks:
            h.remove()
    keys = tokens[:, 0 : 2 * task.num_pairs : 2]  # (B, N)
    pair = (tokens[:, positions, None] == keys[:, None, :]).float().argmax(-1)  # (B, Q)
    needed = 2 * pair + 1
    cov, cov_any = [], []
    for i, layer in enumerate(layers):
        hidden = inputs[i]
        b, length, _ = hidden.shape
        if length <= layer.window_size:
            cov.append(1.0)
            cov_any.append(1.0)
            continue
        v = layer.v_proj(hidden).view(b, length, layer.num_kv_heads, layer.head_dim)
        bias = dynamic_mask_bias(v, layer.dt_proj, layer.A)  # (B, Hkv, 1, L)
        # Query p keeps key j iff start[j] <= p < end[j] (O(L) numbers, no (L, L) mask).
        window = topk_intervals(bias, layer.window_size)
        idx = needed[:, None, :].expand(-1, window.shape[1], -1)  # (B, Hkv, Q)
        p = positions.view(1, 1, -1)
        held = (window.start.gather(-1, idx) <= p) & (p < window.end.gather(-1, idx))
        cov.append(held.float().mean().item())
        cov_any.append(held.any(1).float().mean().item())
    return logits, {"coverage": cov, "coverage_any": cov_any}


@torch.no_grad()
def evaluate(
    model: nn.Module,
    task: MQARConfig,
    eval_size: int,
    batch_size: int,
    seed: int,
    device: torch.device,
    dtype: str = "fp32",
    coverage: bool = False,
) -> Dict[str, object]:
    """Accuracy and loss on ``eval_size`` fresh sequences drawn with ``seed``, at the DMA
    layers' current ``window_size``.

    Returns ``{"accuracy": correct / (eval_size * Q), "loss": mean cross-entropy}``; with
    ``coverage=True`` and DMA layers in the model, also ``"coverage"`` and ``"coverage_any"``
    (see :func:`window_coverage`), averaged over the evaluation batches.
    """
    was_training = model.training
    model.eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    positions = query_positions(task, device)
    coverage = coverage and bool(_dma_layers(model))
    correct = total = 0
    loss_sum = 0.0
    done = 0
    cov_sums: Dict[str, List[float]] = {}
    while done < eval_size:
        b = min(batch_size, eval_size - done)
        tokens, targets = generate_batch(task, b, gen, device)
        with _autocast(device, dtype):
            if coverage:
                logits, cov = _forward_with_coverage(model, task, tokens)
                for key, vals in cov.items():
                    acc = cov_sums.setdefault(key, [0.0] * len(vals))
                    for j, val in enumerate(vals):
                        acc[j] += val * b
            else:
                logits = model(tokens, positions)
        sel_targets = targets[:, positions]
        loss_sum += _loss(logits, sel_targets).item() * b
        pred = logits.argmax(-1)
        correct += (pred == sel_targets).sum().item()
        total += pred.numel()
        done += b
    model.train(was_training)
    out: Dict[str, object] = {"accuracy": correct / total, "loss": loss_sum / eval_size}
    for key, sums in cov_sums.items():
        out[key] = [x / eval_size for x in sums]
    return out


def train_model(
    task: MQARConfig,
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    device,
    progress: bool = False,
    label: str = "",
) -> Dict[str, object]:
    """Train one fresh model on ``task`` and evaluate it.

    The initialisation (``torch.manual_seed(seed)``) and the training batches (a generator
    seeded with ``seed``) are the same for every call with the same ``seed``, so runs that
    differ only in the attention setting see identical data. The evaluation set uses
    ``seed + 1``: a stream of its own, not the training one.

    With ``train_cfg.window_warmup`` / ``window_decay`` (see :func:`window_schedule`) every
    DMA layer's ``window_size`` is set before each step: the full sequence first, then a
    geometric shrink to the model's window, then that window. ``full``/``dense`` models and
    windows ``>= seq_len`` are unaffected. Every evaluation (interim and final) that gives
    ``accuracy`` uses the model's own (target) window; during the warm-up an interim eval also
    reports the accuracy at the window training used at that step.

    Returns a dict with ``accuracy``, ``eval_loss``, ``coverage`` / ``coverage_any`` (DMA
    models, final eval; see :func:`window_coverage`), ``ms_per_step`` (median over the steps
    after ``timing_warmup`` that trained at the target window, or over all of them if none
    did; the step is forward + backward + optimizer, not data generation), ``losses`` (per
    step), ``history`` (periodic evals: ``step``, ``window`` (the target window the eval
    used), ``train_window`` (the window of that training step), ``accuracy``, ``loss``,
    coverage, and during the warm-up ``train_window_accuracy`` / ``train_window_loss``),
    ``window_schedule`` (``None`` without a warm-up) and ``params``.
    """
    device = torch.device(device)
    torch.manual_seed(train_cfg.seed)
    model = MQARModel(model_cfg).to(device)
    model.train()
    # The usual GPT recipe: decay matrices and embeddings, not the 1-D parameters (norm
    # weights, DMA's per-head A), whose scale is meaningful and which decay would pull to 0.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": train_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=train_cfg.lr,
        betas=(0.9, 0.98),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: _lr_factor(s, train_cfg.steps, train_cfg.warmup_frac)
    )
    gen = torch.Generator(device=device).manual_seed(train_cfg.seed)
    positions = query_positions(task, device)
    timing_warmup = min(train_cfg.timing_warmup, max(0, train_cfg.steps - 1))
    layers = _dma_layers(model)
    target = layers[0].window_size if layers else None
    schedule = None
    if layers and target < task.seq_len:
        full_steps, decay_steps = window_warmup_steps(train_cfg.steps, train_cfg.window_warmup, train_cfg.window_decay)
        if full_steps + decay_steps:
            schedule = {
                "start": task.seq_len, "target": target, "full_steps": full_steps, "decay_steps": decay_steps,
                "shape": "geometric",
            }
            msg = (f"[{label}] window warm-up: window {task.seq_len} for steps 1-{full_steps}, "
                   f"geometric shrink to {target} over steps {full_steps + 1}-{full_steps + decay_steps}, "
                   f"then {target}")
            print(msg, flush=True)

    def window_at(step: int) -> Optional[int]:
        if schedule is None:
            return target
        return window_schedule(step, train_cfg.steps, target, task.seq_len,
                               train_cfg.window_warmup, train_cfg.window_decay)

    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm

            bar = tqdm(total=train_cfg.steps, desc=label or "train", leave=True, dynamic_ncols=True)
        except ImportError:
            bar = None
    print_every = max(1, train_cfg.steps // 10)

    losses: List[float] = []
    step_ms: List[float] = []
    target_ms: List[float] = []
    history: List[Dict[str, object]] = []
    for step in range(train_cfg.steps):
        window = window_at(step)
        if schedule is not None:
            _set_window(model, window)
        tokens, targets = generate_batch(task, train_cfg.batch_size, gen, device)
        _sync(device)
        t0 = time.perf_counter()
        with _autocast(device, train_cfg.dtype):
            logits = model(tokens, positions)
        loss = _loss(logits, targets[:, positions])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        # Clipping keeps the occasional large early step (before the recall circuit forms)
        # from knocking the run off course; it costs little.
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        _sync(device)
        elapsed = (time.perf_counter() - t0) * 1e3
        if step >= timing_warmup:
            step_ms.append(elapsed)
            if window == target:
                target_ms.append(elapsed)
        loss_value = loss.item()
        losses.append(loss_value)

        if train_cfg.eval_every and (step + 1) % train_cfg.eval_every == 0 and step + 1 < train_cfg.steps:
            def interim() -> Dict[str, object]:
                return evaluate(model, task, min(train_cfg.eval_size, 256), train_cfg.batch_size,
                                train_cfg.seed + 1, device, train_cfg.dtype, coverage=True)

            entry: Dict[str, object] = {"step": step + 1, "window": target, "train_window": window}
            if window != target:
                train_ev = interim()
                entry["train_window_accuracy"], entry["train_window_loss"] = train_ev["accuracy"], train_ev["loss"]
                _set_window(model, target)
            ev = interim()
            if window != target:
                _set_window(model, window)
            entry.update(ev)
            history.append(entry)
            # Printed even without progress bars: interim evals are asked for explicitly.
            msg = f"[{label}] step {step + 1}: eval accuracy {ev['accuracy']:.4f}, eval loss {ev['loss']:.4f}"
            if ev.get("coverage"):
                msg += f", coverage {_coverage_text(ev)}"
            if window != target:
                msg += (f" (at window {target}; training window {window}: accuracy "
                        f"{entry['train_window_accuracy']:.4f})")
            (bar.write if bar is not None else print)(msg)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}", ms=f"{elapsed:.1f}")
        elif progress and ((step + 1) % print_every == 0 or step + 1 == train_cfg.steps):
            print(f"[{label}] step {step + 1}/{train_cfg.steps} loss {loss_value:.4f} ({elapsed:.1f} ms)", flush=True)
    if bar is not None:
        bar.close()

    if layers:
        _set_window(model, target)  # the schedule always ends there; this makes it explicit
    final = evaluate(model, task, train_cfg.eval_size, train_cfg.batch_size, train_cfg.seed + 1, device,
                     train_cfg.dtype, coverage=True)
    history.append({"step": train_cfg.steps, "window": target, "train_window": window_at(train_cfg.steps - 1),
                    **final})
    tail = losses[-max(1, len(losses) // 10):]
    timed = target_ms or step_ms
    return {
        "accuracy": final["accuracy"],
        "eval_loss": final["loss"],
        "coverage": final.get("coverage"),
        "coverage_any": final.get("coverage_any"),
        "final_train_loss": sum(tail) / len(tail),
        "ms_per_step": statistics.median(timed) if timed else None,
        "timed_steps": len(timed),
        "losses": losses,
        "history": history,
        "window_schedule": schedule,
        "params": sum(p.numel() for p in model.parameters()),
    }


# --------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------
def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def _environment(device: torch.device) -> Dict[str, object]:
    try:
        from flash_dmattn import registry

        available = registry.get_available_backends()
    except Exception as exc:  # informational only: a report must not fail on it
        available = [f"unknown ({exc.__class__.__name__})"]
    try:
        from flash_dmattn import __version__ as version
    except ImportError:
        version = None
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "flash_dmattn": version,
        "device": str(device),
        "gpu_name": gpu,
        "available_backends": available,
        "argv": sys.argv[1:],
    }


def _window_label(window: object) -> str:
    return str(window)


def _previous_rows(path: Path, config: Dict[str, object], env: Dict[str, object]) -> List[dict]:
    """The result rows of an earlier run stored in ``path`` (for ``--merge``), or ``[]``.

    Called before any training so that a mismatch costs nothing: rows are only merged when
    the task/model/training configuration and the device are the same, otherwise the
    combined table would compare unlike runs.
    """
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    old_cfg = {k: v for k, v in old.get("config", {}).items() if k != "windows"}
    if old_cfg != config:
        raise ValueError(f"{path} was written with a different configuration; use another --out")
    if old.get("environment", {}).get("gpu_name") != env["gpu_name"]:
        raise ValueError(f"{path} was measured on another device; use another --out")
    return list(old.get("results", []))


def _markdown(doc: Dict[str, object]) -> str:
    env, cfg = doc["environment"], doc["config"]
    lines = [
        "# MQAR: accuracy and step time per attention window",
        "",
        f"- device: {env['gpu_name'] or env['device']}; torch {env['torch']}; date {env['date']}",
        f"- task: seq_len {cfg['task']['seq_len']}, {cfg['task']['num_pairs']} pairs, "
        f"{cfg['task']['num_queries']} queries, vocab {cfg['vocab_size']}",
        f"- model: d_model {cfg['model']['d_model']}, {cfg['model']['num_layers']} layers, "
        f"{cfg['model']['num_heads']} heads / {cfg['model']['num_kv_heads'] or cfg['model']['num_heads']} kv heads, "
        + (f"MLP ratio {cfg['model']['mlp_ratio']}" if cfg["model"].get("mlp_ratio") else "attention-only (no MLP)"),
        f"- training: {cfg['train']['steps']} steps, batch {cfg['train']['batch_size']}, lr {cfg['train']['lr']}, "
        f"{cfg['train']['dtype']}; eval on {cfg['train']['eval_size']} sequences",
        "- ms/step: median forward+backward+optimizer time after "
        f"{cfg['train']['timing_warmup']} warm-up steps (with a window warm-up: of the steps at the target window)",
        "- window schedule: `full N → W` trains the first N steps at window seq_len, then shrinks "
        "the window geometrically to W; the accuracy is always measured at the target window W",
        "- coverage: per DMA layer (`layer 1/layer 2/...`), the fraction of (query, kv head) whose "
        "window holds the queried pair's value position, and in brackets the fraction of queries "
        "for which some kv head's window holds it (recall needs it in the last layer)",
        "",
        "| window | attention | window schedule | accuracy | eval loss | coverage | ms/step | params |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["results"]:
        ms = "-" if r["ms_per_step"] is None else f"{r['ms_per_step']:.2f}"
        cov = _coverage_text(r) if r.get("coverage") else "-"
        lines.append(
            f"| {r['window']} | {r['attention']} | {_schedule_text(r.get('window_schedule'))} | "
            f"{r['accuracy']:.4f} | {r['eval_loss']:.4f} | {cov} | {ms} | {r['params']:,} |"
        )
    if any(len(r.get("history", [])) > 1 for r in doc["results"]):
        lines += ["", "Accuracy by step (at the target window; `w` = the window training used at that step):", ""]
        for r in doc["results"]:
            parts = []
            for h in r.get("history", []):
                tw = h.get("train_window")
                note = f" (w {tw})" if tw is not None and tw != h.get("window") else ""
                parts.append(f"{h['accuracy']:.3f} @{h['step']}{note}")
            lines.append(f"- {r['window']}: " + ", ".join(parts))
    return "\n".join(lines) + "\n"


def _coverage_text(res: Dict[str, object]) -> str:
    cov = "/".join(f"{c:.2f}" for c in res["coverage"])
    any_head = res.get("coverage_any")
    return cov + (f" (any head {'/'.join(f'{c:.2f}' for c in any_head)})" if any_head else "")


def _schedule_text(schedule: Optional[dict]) -> str:
    if not schedule:
        return "fixed"
    return (f"full {schedule['full_steps']} → {schedule['target']} "
            f"(shrink over {schedule['decay_steps']})")


def _plot(doc: Dict[str, object], path: Path) -> Optional[str]:
    """Write the accuracy / ms-per-step figure; returns a note instead when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on servers / CI
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not importable; skipped the plot"
    rows = doc["results"]
    labels = [r["window"] for r in rows]
    xs = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(list(xs), [r["accuracy"] for r in rows], marker="o")
    ax1.set_xticks(list(xs), labels)
    ax1.set_ylim(-0.02, 1.02)
    ax1.set_xlabel("window")
    ax1.set_ylabel("eval accuracy")
    ax1.set_title("MQAR recall accuracy")
    ax1.grid(alpha=0.3)
    ax2.bar(list(xs), [r["ms_per_step"] or 0.0 for r in rows])
    ax2.set_xticks(list(xs), labels)
    ax2.set_xlabel("window")
    ax2.set_ylabel("median ms / training step")
    ax2.set_title("step time")
    ax2.grid(alpha=0.3, axis="y")
    env = doc["environment"]
    fig.suptitle(f"MQAR, seq_len {doc['config']['task']['seq_len']}, {env['gpu_name'] or env['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
# The window warm-up default (see window_schedule and examples/README.md, "Window warm-up").
DEFAULT_WINDOW_WARMUP = 0.2

SMOKE = dict(
    seq_len=64, num_pairs=4, key_vocab=16, value_vocab=16, filler_vocab=8, d_model=32, num_heads=2,
    num_kv_heads=None, steps=3, windows="8,full", batch_size=4, eval_size=8, timing_warmup=1,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m examples.mqar",
        description="Train a 2-layer model on multi-query associative recall (MQAR) for several "
        "Dynamic Mask Attention window sizes; report accuracy and ms/step.",
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="bf16 autocast or fp32 (auto: bf16 on CUDA, fp32 elsewhere)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--num-pairs", type=int, default=64)
    p.add_argument("--num-queries", type=int, default=None, help="default: --num-pairs")
    p.add_argument("--key-vocab", type=int, default=256)
    p.add_argument("--value-vocab", type=int, default=256)
    p.add_argument("--filler-vocab", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=None, help="GQA: fewer kv heads (default: --num-heads)")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--mlp-ratio", type=int, default=0,
                   help="MLP width / d_model per block; 0 (default): attention-only blocks, as Zoology's MQAR models")
    p.add_argument("--rope-base", type=float, default=1e6,
                   help="rotary base (theta); the default 1e6 keeps more of the head dims slowly rotating, "
                   "which long-distance key matching needs (10000 stalled recall at seq 128 on CPU)")
    p.add_argument("--qk-init-std", type=float, default=None,
                   help="init std of the q/k projections (default: d_model ** -0.5; the other weights use 0.02)")
    p.add_argument("--dma-a-init", type=float, default=None,
                   help="initial value of every DMA layer's A (default: the library's A_INIT, -0.1)")
    p.add_argument("--windows", default="32,64,128,256,512,full",
                   help="comma list of DMA window sizes, 'full' (window = seq_len) and/or 'dense' (SDPA)")
    p.add_argument("--window-size", type=int, default=None, help="train a single DMA window (overrides --windows)")
    p.add_argument("--attention", choices=("dma", "dense"), default="dma",
                   help="dense: a single run with plain SDPA attention (overrides --windows)")
    p.add_argument("--backend", default=None, help="flash_dmattn backend for DMA (default: auto-dispatch)")
    p.add_argument("--window-warmup", type=float, default=DEFAULT_WINDOW_WARMUP, metavar="FRAC",
                   help="DMA window warm-up: train the first FRAC of the steps with the full window "
                   "(window_size = seq_len), then shrink it geometrically to the target over the next "
                   "--window-decay of the steps; 0 disables it (unless --window-decay is given). Evaluation always "
                   f"uses the target window; full and dense are unaffected (default {DEFAULT_WINDOW_WARMUP})")
    p.add_argument("--window-decay", type=float, default=None, metavar="FRAC",
                   help="fraction of the steps over which the window shrinks after the warm-up "
                   "(default: the same as --window-warmup)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-size", type=int, default=1024, help="eval sequences")
    p.add_argument("--eval-every", type=int, default=0, help="steps between (small) interim evals; 0: none")
    p.add_argument("--timing-warmup", type=int, default=20, help="steps left out of the ms/step median")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output folder (default: examples/results/<device-slug>)")
    p.add_argument("--merge", action="store_true",
                   help="add to (or replace windows in) an existing mqar.json in --out from the same configuration")
    p.add_argument("--no-progress", action="store_true", help="no progress bars / periodic prints")
    p.add_argument("--smoke", action="store_true",
                   help="tiny CPU-friendly run (seq 64, 4 pairs, d_model 32, 2 heads, 3 steps, windows 8,full, batch 4)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda requested but CUDA is not available")
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")

    try:
        task = MQARConfig(
            seq_len=args.seq_len, num_pairs=args.num_pairs, num_queries=args.num_queries,
            key_vocab=args.key_vocab, value_vocab=args.value_vocab, filler_vocab=args.filler_vocab,
        )
        if args.attention == "dense":
            windows = ["dense"]
        elif args.window_size is not None:
            windows = parse_windows(str(args.window_size))
        else:
            windows = parse_windows(args.windows)
        for name in ("steps", "batch_size", "eval_size", "d_model", "num_heads", "num_layers"):
            _check_positive(name.replace("_", "-"), getattr(args, name))
        if args.mlp_ratio < 0:
            raise ValueError(f"mlp-ratio must be >= 0, got {args.mlp_ratio}")
        if not args.rope_base > 1:
            raise ValueError(f"rope-base must be > 1, got {args.rope_base}")
        if args.qk_init_std is not None and not args.qk_init_std > 0:
            raise ValueError(f"qk-init-std must be > 0, got {args.qk_init_std}")
        if args.dma_a_init is not None and not (math.isfinite(args.dma_a_init) and args.dma_a_init != 0):
            raise ValueError(f"dma-a-init must be finite and nonzero, got {args.dma_a_init}")
        try:
            check_window_warmup(args.window_warmup, args.window_decay)
        except (TypeError, ValueError) as exc:
            raise ValueError(str(exc).replace("window_warmup", "window-warmup").replace("window_decay", "window-decay")) from None
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))

    train_cfg = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
        eval_size=args.eval_size, eval_every=args.eval_every, timing_warmup=args.timing_warmup,
        seed=args.seed, dtype=dtype, window_warmup=args.window_warmup, window_decay=args.window_decay,
    )
    env = _environment(device)
    out_dir = Path(args.out) if args.out else DEFAULT_RESULTS / (_slug(env["gpu_name"]) if env["gpu_name"] else "cpu")
    out_dir.mkdir(parents=True, exist_ok=True)

    model_template = ModelConfig(
        vocab_size=task.vocab_size, seq_len=task.seq_len, d_model=args.d_model, num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads, num_layers=args.num_layers, mlp_ratio=args.mlp_ratio,
        qk_init_std=args.qk_init_std, rope_base=args.rope_base, backend=args.backend,
        dma_a_init=args.dma_a_init,
    )
    config = {
        "task": asdict(task),
        "vocab_size": task.vocab_size,
        "model": {k: v for k, v in asdict(model_template).items() if k != "window"},
        "train": asdict(train_cfg),
    }
    previous: List[dict] = []
    if args.merge:
        try:
            previous = _previous_rows(out_dir / "mqar.json", config, env)
        except ValueError as exc:
            parser.error(f"--merge: {exc}")
    print(f"MQAR on {env['gpu_name'] or device}: seq_len {task.seq_len}, {task.num_pairs} pairs, "
          f"{task.num_queries} queries, vocab {task.vocab_size}, {dtype}, windows {windows}", flush=True)

    results = []
    for window in windows:
        model_cfg = ModelConfig(**{**asdict(model_template), "window": window})
        label = f"window={window}"
        try:
            res = train_model(task, model_cfg, train_cfg, device, progress=not args.no_progress, label=label)
        except (TypeError, ValueError) as exc:
            # Bad shape combinations (e.g. d_model / heads) surface here; report them as usage errors.
            parser.error(f"{label}: {exc}")
        attention = "sdpa" if window == "dense" else "dma"
        window_size = None if window == "dense" else (task.seq_len if window == "full" else int(window))
        row = {"window": _window_label(window), "attention": attention, "window_size": window_size, **res}
        results.append(row)
        ms = "-" if row["ms_per_step"] is None else f"{row['ms_per_step']:.2f}"
        cov = f", coverage {_coverage_text(row)}" if row.get("coverage") else ""
        print(f"{label}: accuracy {row['accuracy']:.4f}, eval loss {row['eval_loss']:.4f}{cov}, {ms} ms/step",
              flush=True)

    if args.merge:
        # A window run again replaces its earlier row; the others are kept in their order.
        new_windows = {r["window"] for r in results}
        results = [r for r in previous if r["window"] not in new_windows] + results
    config["windows"] = [r["window"] for r in results]
    doc = {"environment": env, "config": config, "results": results}
    (out_dir / "mqar.json").write_text(json.dumps(doc, indent=2))
    md = _markdown(doc)
    (out_dir / "mqar.md").write_text(md)
    note = _plot(doc, out_dir / "mqar.png")
    print()
    print(md)
    if note:
        print(f"note: {note}")
    print(f"wrote {out_dir}/mqar.json, mqar.md" + ("" if note else ", mqar.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
