"""Auto-dispatch's preference: one table from what a call is to the order backends are tried in.

Each :class:`Rule` names the GPU generation it holds for, the calls it covers, the order it
prefers, why, and the measurement behind it (a file under ``benchmarks/results/``; the rows
are summarised with their numbers in ``benchmarks/results/POLICY.md``). The first rule that
matches a call decides. The registry (:func:`flash_dmattn.registry.select_backend`) tries the
rule's ``prefer`` backends in that order and runs the first that is available and supports
the call; backends the rule leaves out are *passed over*: they run only when every preferred
one declines, in :data:`PRIORITY` order, and ``python -m flash_dmattn info --explain`` prints
the rule's reason for each.

Only Hopper (compute capability 9.0) has been measured. On other GPU generations
the cuda backend is passed over (its kernels were built and timed on sm_90 only) and flex,
then triton, run as before any measurement; ``FLASH_DMATTN_CUDA_AUTO=1`` puts cuda first on
every GPU.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Tuple

import torch

from . import envs
from .planning.decode import DECODE_MAX_ROWS, DECODE_MIN_SEQLEN_K
from .reference.sdpa_cpu import SDPA_SETS_PRIORITY, sdpa_computes

# Every backend name, in the order passed-over backends are tried when nothing preferred runs.
PRIORITY = ("cuda", "triton", "flex", "torch-reference")

HOPPER = (9, 0)
CUDA_AUTO_ENV = envs.CUDA_AUTO

_simulated: contextvars.ContextVar = contextvars.ContextVar("flash_dmattn_capability",
                                                            default=None)


@contextlib.contextmanager
def simulated_capability(capability: Tuple[int, int]) -> Iterator[None]:
    """Within the block, :func:`device_capability` answers ``capability`` for every CUDA
    device: ``info --explain --capability`` and the policy tests describe calls on a GPU
    generation this machine does not have."""
    token = _simulated.set(tuple(capability))
    try:
        yield
    finally:
        _simulated.reset(token)


def simulated() -> Optional[Tuple[int, int]]:
    """The capability :func:`simulated_capability` makes every CUDA device answer now (None:
    the real one)."""
    return _simulated.get()


def device_capability(device: torch.device) -> Optional[Tuple[int, int]]:
    """``(major, minor)`` of a CUDA ``device`` (or the simulated one), None for other devices.
    A device with an index is asked once (:func:`_capability_of`); one without (the current
    device, which may change) every time."""
    if device.type != "cuda":
        return None
    simulated = _simulated.get()
    if simulated is not None:
        return simulated
    if device.index is None:
        return tuple(torch.cuda.get_device_capability(device))
    return _capability_of(device.index)


@functools.lru_cache(maxsize=None)
def _capability_of(index: int) -> Tuple[int, int]:
    """The compute capability of CUDA device ``index``, asked once: it is fixed for the
    process, and the query (the device's properties) costs microseconds where dispatch and
    the backends' checks ask it."""
    return tuple(torch.cuda.get_device_capability(index))


def cuda_auto_everywhere() -> bool:
    """``$FLASH_DMATTN_CUDA_AUTO`` set (not 0): cuda first on every GPU, measured or not."""
    return envs.cuda_auto()


# ---------------------------------------------------------------------------------------------
# What a call is, as far as the preference goes
# ---------------------------------------------------------------------------------------------

class CallFeatures(NamedTuple):
    """The properties of a call the rules read.

    ``mask``: ``none``, ``per-key`` (one row for every query: a mask of shape
    ``(Bx, Hx, 1, Lk)``), ``per-query`` (``(Bx, Hx, Lq, Lk)``, Lq > 1) or ``intervals`` (a
    :class:`~flash_dmattn.masks.KeyIntervals`). ``bias``: ``none``, ``per-key`` or ``per-query``
    alike. ``decode``: few query rows per kv head against a long key range or a KV cache's
    used lengths (the shape the split-KV decode kernels take). ``kv_cache``: ``cache_seqlens``
    or paged K/V. ``training``: some input needs a gradient. ``plain``: a dense batch with no
    mask, bias, soft cap, KV cache, dropout or attention probabilities that one SDPA call
    computes exactly (:func:`~flash_dmattn.reference.sdpa_cpu.sdpa_computes`).
    ``kv_bytes``: the bytes of K and V it reads. ``deterministic``: the call asked for a
    deterministic backward. ``cudnn_shape``: a shape and dtype cuDNN's SDPA attention takes
    (:func:`cudnn_attention_shape`).
    """

    device: str = "cuda"
    capability: Optional[Tuple[int, int]] = None
    packed: bool = False
    decode: bool = False
    kv_cache: bool = False
    mask: str = "none"
    bias: str = "none"
    training: bool = False
    bias_grad: bool = False
    plain: bool = False
    kv_bytes: int = 0
    deterministic: bool = False
    cudnn_shape: bool = False

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def hopper(self) -> bool:
        return self.capability == HOPPER

    def describe(self) -> str:
        where = self.device
        if self.capability is not None:
            where = f"cuda sm_{self.capability[0]}{self.capability[1]}"
        parts = [where, "packed sequences" if self.packed else "dense batch"]
        if self.decode:
            parts.append("decode shape")
        if self.kv_cache:
            parts.append("KV cache")
        parts.append(f"mask {self.mask}")
        parts.append(f"bias {self.bias}")
        parts.append("forward + backward" if self.training else "forward only")
        if self.bias_grad:
            parts.append("bias gradient")
        if self.plain:
            parts.append(f"plain ({self.kv_bytes / 2**20:.1f} MiB of K/V)")
            if self.cudnn_shape:
                parts.append("a cuDNN attention shape")
        if self.deterministic:
            parts.append("deterministic")
        return ", ".join(parts)


def _aux_kind(t: Optional[torch.Tensor]) -> str:
    if t is None:
        return "none"
    # Dense masks / biases are 4-D (Bx, Hx, Qx, Kx); packed ones 2-D (Hx, total_k): per key.
    return "per-query" if t.dim() == 4 and t.shape[2] > 1 else "per-key"


def _decode_shape(inputs) -> bool:
    """Whether the split-KV decode kernels take the call (the triton backend's rule, which the
    cuda backend shares: few rows per kv head and a long key range, or a KV cache)."""
    lq, heads, kv_heads = inputs.query.shape[1], inputs.query.shape[2], inputs.key.shape[2]
    if lq == 0 or (heads // max(kv_heads, 1)) * lq > DECODE_MAX_ROWS:
        return False
    return inputs.cache_seqlens is not None or inputs.seqlen_k >= DECODE_MIN_SEQLEN_K


# The largest head dim torch's cuDNN attention takes whatever the cuDNN version (up to 256 on
# Hopper needs cuDNN 9.10 or newer), and the dtypes it takes.
CUDNN_MAX_HEAD_DIM = 128
_CUDNN_DTYPES = (torch.float16, torch.bfloat16)


def cudnn_attention_shape(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether SDPA runs a plain call with these properties on cuDNN's attention when asked to
    try it first: float16 / bfloat16, one kv head per query head, a head dim of at most
    :data:`CUDNN_MAX_HEAD_DIM` and a multiple of 8. Outside it SDPA takes its flash kernel
    (or, for grouped heads, possibly its math one) instead."""
    return (dtype in _CUDNN_DTYPES and heads == kv_heads
            and head_dim <= CUDNN_MAX_HEAD_DIM and head_dim % 8 == 0)


def features_of(inputs) -> CallFeatures:
    """The :class:`CallFeatures` of validated ``inputs`` (AttentionInputs or VarlenInputs)."""
    packed = hasattr(inputs, "cu_seqlens_q")
    intervals = getattr(inputs, "key_intervals", None) is not None
    cache = getattr(inputs, "cache_seqlens", None) is not None
    paged = getattr(inputs, "block_table", None) is not None
    bias = inputs.attn_bias
    device = inputs.device
    grad = torch.is_grad_enabled()
    plain = not packed and inputs.plain and sdpa_computes(
        inputs.dtype, inputs.seqlen_q, inputs.seqlen_k, inputs.is_causal, inputs.softmax_scale)
    query, key = inputs.query, inputs.key
    # Heads and head dim are the last two dims of dense (B, L, H, D) and packed (T, H, D) alike.
    cudnn_shape = cudnn_attention_shape(inputs.dtype, query.shape[-2], key.shape[-2],
                                        max(query.shape[-1], inputs.value.shape[-1]))
    # Positionally, in CallFeatures' field order (asked on every dispatched call).
    return _make_features((
        device.type,                                                  # device
        device_capability(device),                                    # capability
        packed,                                                       # packed
        not packed and _decode_shape(inputs),                         # decode
        cache or paged,                                               # kv_cache
        "intervals" if intervals else _aux_kind(inputs.attn_mask),    # mask
        _aux_kind(bias),                                              # bias
        grad and inputs.needs_grad,                                   # training
        grad and bias is not None and bias.requires_grad,             # bias_grad
        plain,                                                        # plain
        2 * key.numel() * key.element_size() if plain else 0,         # kv_bytes
        bool(inputs.deterministic),                                   # deterministic
        cudnn_shape,                                                  # cudnn_shape
    ))


_make_features = CallFeatures._make


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    """One row of the table: on ``arch`` (``any``, ``cpu``, ``sm_90`` or ``other GPUs``), calls
    that ``when`` describes (``test`` decides) try ``prefer`` in order; ``reason`` says why,
    ``evidence`` where it was measured, ``passed_over`` why a backend left out of ``prefer``
    runs only as a fallback (a backend with no entry gets :data:`NOT_PREFERRED`).
    ``reference_fast``: torch-reference runs this rule's calls at full speed (one SDPA call),
    so running them there is the rule's choice, not a slow fallback worth a warning."""

    key: str
    arch: str
    when: str
    test: Callable[[CallFeatures], bool]
    prefer: Tuple[str, ...]
    reason: str
    evidence: str
    passed_over: Mapping[str, str] = field(default_factory=dict)
    reference_fast: bool = False

    def applies(self, f: CallFeatures) -> bool:
        if self.arch == "cpu" and f.gpu:
            return False
        if self.arch == "sm_90" and not (f.gpu and f.hopper):
            return False
        if self.arch == "other GPUs" and not (f.gpu and not f.hopper):
            return False
        return self.test(f)


NOT_PREFERRED = "ranked after the rule's preferred backends"

_CUDA_UNMEASURED = ("the cuda kernels were built, tested and timed on sm_90 (Hopper) only; "
                    "on this GPU generation auto-dispatch leaves them to explicit use "
                    f"(backend='cuda', or {CUDA_AUTO_ENV}=1 to prefer them)")
_REFERENCE_ON_GPU = "plain PyTorch: the fallback when no kernel backend runs the call"
# Where each rule's measurements are written out, with the logs they come from.
_EVIDENCE = "benchmarks/results/POLICY.md"


def _always(f: CallFeatures) -> bool:
    return True


def _per_query_bias_training(f: CallFeatures) -> bool:
    return f.training and f.bias == "per-query"


# A plain decoding step over at most this much K/V runs as one SDPA call (rule "gpu-plain-decode").
PLAIN_DECODE_SDPA_MAX_BYTES = 32 * 2**20


def _small_plain_decode(f: CallFeatures) -> bool:
    return (f.gpu and f.decode and f.plain and not (f.training or f.kv_cache or f.packed)
            and f.mask == "none" and f.bias == "none"
            and f.kv_bytes <= PLAIN_DECODE_SDPA_MAX_BYTES)


def _plain_training_on_cudnn(f: CallFeatures) -> bool:
    """Rule ``hopper-plain-training``: a plain training call that asked for no deterministic
    backward (SDPA's accumulates with atomics), of a shape cuDNN's attention takes, with a torch
    whose ``sdpa_kernel`` can put cuDNN's attention first (the torch-reference backend asks for
    it: :func:`~flash_dmattn.reference.sdpa_cpu.sdpa_plain_cuda`)."""
    return (f.training and f.plain and f.cudnn_shape and not f.deterministic
            and SDPA_SETS_PRIORITY)


RULES: Tuple[Rule, ...] = (
    Rule(
        "cpu", "cpu", "any call on CPU tensors", _always,
        prefer=("torch-reference",),
        reason="the chunked reference (PyTorch's fused SDPA where exact) is the fast CPU path",
        evidence="benchmarks/results/cpu-2core/cpu_sdpa.txt",
        passed_over={
            "triton": "on CPU the Triton interpreter is a testing aid, far slower than "
                      "torch-reference",
            "flex": "on CPU FlexAttention runs eagerly, materialises the score matrix and has "
                    "no backward; the chunked torch-reference is preferred",
            "cuda": "needs a CUDA device",
        },
    ),
    Rule(
        "gpu-plain-decode", "any",
        f"a decoding step (forward only) with no mask, bias, soft cap, dropout or KV cache "
        f"over at most {PLAIN_DECODE_SDPA_MAX_BYTES // 2**20} MiB of K/V, on a GPU",
        _small_plain_decode,
        prefer=("torch-reference", "triton"),
        reason="host bound: torch-reference runs such a call as one PyTorch SDPA call, whose "
               "host time per call measured under half of the split-KV decode kernels' two "
               "Triton launches; over this little K/V the device time of either is a few "
               "microseconds (about 10 at 3 TB/s), less than the host time one launch costs",
        evidence=_EVIDENCE + " (gpu-plain-decode)",
        passed_over={
            "cuda": "its decode kernels measured slower than triton's (hopper-decode), and "
                    "launch from Python as triton's do",
            "flex": "compiled per shape; a decoding step's key length changes every step",
        },
        reference_fast=True,
    ),
    Rule(
        "hopper-packed-forward", "sm_90", "packed sequences, forward only",
        lambda f: f.packed and not f.training,
        prefer=("cuda", "triton", "torch-reference"),
        reason="the cuda varlen forward measured faster than triton's on the varlen benchmark",
        evidence=_EVIDENCE + " (hopper-packed-forward / hopper-packed-training)",
    ),
    Rule(
        "hopper-packed-training", "sm_90", "packed sequences, forward + backward",
        lambda f: f.packed,
        prefer=("triton", "cuda", "torch-reference"),
        reason="triton's varlen backward measured faster than cuda's (fwd+bwd) on the varlen "
               "benchmark",
        evidence=_EVIDENCE + " (hopper-packed-forward / hopper-packed-training)",
    ),
    Rule(
        "hopper-key-intervals", "sm_90", "a key-interval mask (KeyIntervals)",
        lambda f: f.mask == "intervals",
        prefer=("cuda", "triton", "flex", "torch-reference"),
        reason="cuda's key-interval kernels measured ahead of triton's on the dma_long rows "
               "(all but one, within a few percent); flex visits whole 128-key blocks, which a "
               "scattered selection keeps live",
        evidence=_EVIDENCE + " (hopper-key-intervals)",
    ),
    Rule(
        "hopper-decode", "sm_90", "decoding: few query rows per kv head, long keys or a KV cache",
        lambda f: f.decode or f.kv_cache,
        prefer=("triton", "cuda", "flex", "torch-reference"),
        reason="triton's split-KV decode kernel measured faster than cuda's on every row, and "
               "both far faster than flex",
        evidence=_EVIDENCE + " (hopper-decode)",
    ),
    Rule(
        "hopper-per-query-bias-training", "sm_90",
        "forward + backward with a per-query bias (Bx, Hx, Lq, Lk)",
        _per_query_bias_training,
        prefer=("flex", "triton", "cuda", "torch-reference"),
        reason="not measured: cuda's backward with a per-query bias has no timing against flex "
               "or triton yet, so the order before any measurement stays",
        evidence="(none yet)",
        passed_over={},
    ),
    Rule(
        "hopper-plain-training", "sm_90",
        "forward + backward with no mask, bias, soft cap, dropout or KV cache (causal or not), "
        "not deterministic, in float16 / bfloat16 with one kv head per query head and a head "
        f"dim of at most {CUDNN_MAX_HEAD_DIM}, a multiple of 8 (decoding shapes excepted: "
        "hopper-decode)",
        _plain_training_on_cudnn,
        prefer=("torch-reference", "cuda", "flex", "triton"),
        reason="torch-reference runs such a call as one PyTorch SDPA call with cuDNN's "
               "attention first: its forward + backward measured faster than cuda's, its "
               "forward level with cuda's. SDPA's own order takes its flash kernel, measured "
               "far slower than both, so the other shapes (grouped heads, larger head dims, "
               "float32) keep hopper-dense's order, as does a deterministic call (SDPA's "
               "backward accumulates with atomics)",
        evidence=_EVIDENCE + " (hopper-plain-training)",
        reference_fast=True,
    ),
    Rule(
        "hopper-dense", "sm_90",
        "every other call: forward only, or training without a bias, with a per-key bias, "
        "or with a per-query mask",
        _always,
        prefer=("cuda", "flex", "triton", "torch-reference"),
        reason="cuda measured fastest: forward with every mask kind; forward + backward dense, "
               "with a per-key mask, a per-query mask + per-key bias and a per-key mask + "
               "per-key bias",
        evidence=_EVIDENCE + " (hopper-dense)",
    ),
    Rule(
        "gpu-packed", "other GPUs", "packed sequences",
        lambda f: f.packed,
        prefer=("triton", "torch-reference"),
        reason="flex has no packed path; triton's kernels run on sm80+",
        evidence="(not measured on this generation)",
        passed_over={"cuda": _CUDA_UNMEASURED},
    ),
    Rule(
        "gpu-key-intervals", "other GPUs", "a key-interval mask (KeyIntervals)",
        lambda f: f.mask == "intervals",
        prefer=("triton", "flex", "torch-reference"),
        reason="triton's key-interval kernels visit only the selected keys (measured on "
               "Hopper; cuda's are built for sm_90 only)",
        evidence=_EVIDENCE + " (hopper-key-intervals)",
        passed_over={"cuda": _CUDA_UNMEASURED},
    ),
    Rule(
        "gpu-decode", "other GPUs", "decoding: few query rows per kv head, long keys or a KV cache",
        lambda f: f.decode or f.kv_cache,
        prefer=("triton", "flex", "torch-reference"),
        reason="triton's split-KV decode kernel measured faster than flex at every cache "
               "length on Hopper",
        evidence=_EVIDENCE + " (hopper-decode)",
        passed_over={"cuda": _CUDA_UNMEASURED},
    ),
    Rule(
        "gpu-dense", "other GPUs", "every other call",
        _always,
        prefer=("flex", "triton", "torch-reference"),
        reason="no measurement on this GPU generation: FlexAttention (compiled by PyTorch for "
               "the GPU at hand) first, then triton",
        evidence="(not measured on this generation)",
        passed_over={"cuda": _CUDA_UNMEASURED},
    ),
)


@dataclass(frozen=True)
class Ranking:
    """The order auto-dispatch tries backends in for one call, and why."""

    rule: Rule
    features: CallFeatures
    prefer: Tuple[str, ...]
    fallback: Tuple[str, ...]
    passed_over: Dict[str, str]

    @property
    def order(self) -> Tuple[str, ...]:
        return self.prefer + self.fallback


def rule_for(f: CallFeatures) -> Rule:
    for rule in RULES:
        if rule.applies(f):
            return rule
    raise AssertionError(f"no dispatch rule covers {f.describe()}")  # RULES ends in catch-alls


def rank_features(f: CallFeatures) -> Ranking:
    """The :class:`Ranking` of a call with features ``f`` (shared: do not modify it)."""
    key = (f, f.gpu and cuda_auto_everywhere())
    if torch.compiler.is_compiling():  # traced once per graph: no cache to guard on
        return _rank(*key)
    ranking = _RANKINGS.get(key)
    if ranking is None:
        if len(_RANKINGS) >= _MAX_RANKINGS:
            _RANKINGS.clear()
        ranking = _RANKINGS[key] = _rank(*key)
    return ranking


# Rankings by (features, cuda first): a call's ranking is a dictionary look-up after the first.
_RANKINGS: Dict[tuple, "Ranking"] = {}
_MAX_RANKINGS = 1024


def _rank(f: CallFeatures, cuda_first: bool) -> Ranking:
    rule = rule_for(f)
    prefer = rule.prefer
    if cuda_first and prefer[0] != "cuda":
        prefer = ("cuda",) + tuple(n for n in prefer if n != "cuda")
    fallback = tuple(n for n in PRIORITY if n not in prefer)
    passed = {n: rule.passed_over.get(n, NOT_PREFERRED) for n in fallback}
    return Ranking(rule, f, prefer, fallback, passed)


def rank(inputs) -> Ranking:
    """The :class:`Ranking` of validated ``inputs``."""
    return rank_features(features_of(inputs))


def passed_over_reasons(name: str, inputs) -> List[str]:
    """Why auto-dispatch ranks backend ``name`` after the preferred ones for ``inputs`` (empty:
    it is among them)."""
    ranking = rank(inputs)
    reason = ranking.passed_over.get(name)
    return [f"{reason} (dispatch rule {ranking.rule.key!r})"] if reason else []


def table() -> str:
    """The rules as text, in the order they are tried (``info --explain`` prints it)."""
    lines = []
    for rule in RULES:
        lines.append(f"{rule.key} [{rule.arch}] {rule.when}")
        lines.append(f"    prefer: {' > '.join(rule.prefer)}")
        lines.append(f"    why: {rule.reason}")
        lines.append(f"    measured: {rule.evidence}")
        for name, why in rule.passed_over.items():
            lines.append(f"    {name} passed over: {why}")
    return "\n".join(lines)
