"""The backend registry and the dispatch rules of docs/contract.md §6.

Environment:

* ``FLASH_DMATTN_BACKEND=<name>`` forces that backend for auto-dispatched calls;
* ``FLASH_DMATTN_DISABLE=a,b`` removes backends from both auto-dispatch and explicit use.

Auto-dispatch tries backends in the order :mod:`flash_dmattn.policy` gives for the call (one
table: GPU generation and call features -> preference, each with its reason and measurement)
and runs the first that is available and supports the inputs; backends the policy passes over
still run when no preferred one can. When none can, one ``RuntimeError`` lists every
backend's reasons. An explicitly requested backend never falls back: it raises
``ValueError`` with its own reasons. :func:`explain` says, for one call, what auto takes and
why each other backend was not taken (``python -m flash_dmattn info --explain``).

Auto-dispatch makes that decision once per call signature and keeps it in :data:`DISPATCH_MEMO`
(:class:`DispatchMemo`): a decoding loop asks the same question for every layer of every token.
A plain call (no mask, bias, soft cap, KV cache, dropout or probabilities) on CPU or CUDA
tensors whose signature the memo already holds skips the rest as well: :func:`run_plain`.
"""
from __future__ import annotations

import logging
import math
import warnings
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Tuple, Union

import torch

from . import envs, policy
from .inputs import AttentionInputs, VarlenInputs

if TYPE_CHECKING:  # the backends package registers its backends here: no import back
    from .backends.base import Backend

logger = logging.getLogger("flash_dmattn")

PRIORITY = policy.PRIORITY

# Devices on which landing on the reference is a performance problem worth a warning.
ACCELERATED_DEVICE_TYPES = {"cuda"}

NOT_BUILT = "not part of this version of flash_dmattn yet"

_BACKENDS: Dict[str, Backend] = {}
_logged_choices: set = set()
_warned_fallbacks: set = set()


class BackendUnavailableError(RuntimeError):
    """A backend was requested by name but cannot run in this environment."""


class BackendDeclined(RuntimeError):
    """Raised by a backend's entry point when the call turns out to be beyond it before
    anything was computed (e.g. its kernels failed to compile for these shapes): auto-dispatch
    then runs the next backend (:func:`run_auto`), and the backend
    declines such calls up front from then on. An explicitly chosen backend raises it to the
    caller, with the reason."""

    def __init__(self, backend: str, reason: str) -> None:
        super().__init__(f"backend {backend!r} cannot run this call: {reason}")
        self.backend = backend
        self.reason = reason


# Exception types by which a compiler reports that it could not build a call's kernels
# (Inductor, Triton; names, so that versions lacking one still import this module). Raised
# when a backend first runs a call of a new shape, before anything was computed.
_COMPILE_FAILURES = ("InductorError", "LoweringException", "NoValidChoicesError",
                     "BackendCompilerFailed", "OutOfResources", "CompilationError")


def is_compile_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it wraps) is a compile failure (:data:`_COMPILE_FAILURES`)."""
    seen = 0
    while exc is not None and seen < 8:
        if any(t.__name__ in _COMPILE_FAILURES for t in type(exc).__mro__):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def failure_reason(exc: BaseException) -> str:
    """A one-line reason from a compile failure: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"


# (backend name, call_key) -> why that backend could not run such a call when it tried: the
# backend declines calls with that key from then on (auto-dispatch and explicit use).
_runtime_declines: Dict[Tuple[str, tuple], str] = {}


def call_key(inputs: Inputs) -> tuple:
    """What one compiled entry of a backend is specialised on: device, dtype, shapes, which
    mask / bias / cache / dropout arguments and which gradients. Calls with equal keys compile
    alike."""

    def shape(t):
        return None if t is None else (tuple(t.shape), t.dtype)

    return (type(inputs).__name__, inputs.device, inputs.dtype, tuple(inputs.query.shape),
            tuple(inputs.key.shape), shape(inputs.attn_mask), shape(inputs.attn_bias),
            shape(getattr(inputs, "key_intervals", None)),
            getattr(inputs, "cache_seqlens", None) is not None,
            shape(getattr(inputs, "block_table", None)), inputs.is_causal, inputs.softcap > 0.0,
            getattr(inputs, "dropout_p", 0.0) > 0.0, inputs.deterministic, inputs.needs_grad,
            inputs.bias_needs_grad)


def remember_decline(name: str, inputs: Inputs, reason: str) -> None:
    """Backend ``name`` failed to run a call like ``inputs`` (``reason``): decline such calls."""
    _runtime_declines[(name, call_key(inputs))] = reason
    DISPATCH_MEMO.clear()  # decisions made before the decline may name this backend


def forget_declines() -> None:
    """Forget every remembered run-time decline (tests; after upgrading a compiler)."""
    _runtime_declines.clear()
    DISPATCH_MEMO.clear()


def register_backend(backend: Backend) -> Backend:
    if backend.name not in PRIORITY:
        raise ValueError(f"unknown backend name {backend.name!r}; expected one of {PRIORITY}")
    _BACKENDS[backend.name] = backend
    DISPATCH_MEMO.clear()
    return backend


def registered_backends() -> List[Backend]:
    """Every registered backend in priority order, available or not."""
    return [_BACKENDS[n] for n in PRIORITY if n in _BACKENDS]


def disabled_names() -> set:
    return envs.disabled_backends()


def forced_name() -> Optional[str]:
    return envs.forced_backend()


def unavailable_reason(backend: Backend) -> Optional[str]:
    if backend.name in disabled_names():
        return "disabled by FLASH_DMATTN_DISABLE"
    return backend.unavailable_reason()


def get_available_backends() -> List[str]:
    """Names of the backends usable in this environment, in priority order.

    Example: ``["triton", "flex", "torch-reference"]`` on a GPU machine without nvcc.
    """
    return [b.name for b in registered_backends() if unavailable_reason(b) is None]


def get_backend(name: str) -> Backend:
    """The backend called ``name``, or an error that says why it cannot be used."""
    if name not in PRIORITY:
        raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(PRIORITY)}")
    if name not in _BACKENDS:
        raise BackendUnavailableError(f"backend {name!r} is unavailable: {NOT_BUILT}")
    backend = _BACKENDS[name]
    reason = unavailable_reason(backend)
    if reason is not None:
        raise BackendUnavailableError(f"backend {name!r} is unavailable: {reason}")
    return backend


Inputs = Union[AttentionInputs, VarlenInputs]


def can_run(name: str, inputs: Inputs) -> bool:
    """Whether backend ``name`` is available and supports ``inputs`` (preferences ignored)."""
    backend = _BACKENDS.get(name)
    if backend is None or unavailable_reason(backend) is not None:
        return False
    return not _reasons(backend, inputs)


def _reasons(backend: Backend, inputs: Inputs) -> List[str]:
    if isinstance(inputs, VarlenInputs):
        reasons = list(backend.varlen_not_supported_reasons(inputs))
    else:
        reasons = list(backend.not_supported_reasons(inputs))
    if _runtime_declines:
        failed = _runtime_declines.get((backend.name, call_key(inputs)))
        if failed is not None:
            reasons.append(f"it failed to compile a call like this one: {failed}")
    return reasons


def check_explicit(backend: Backend, inputs: Inputs) -> Backend:
    """Raise ValueError when an explicitly chosen backend cannot run ``inputs``."""
    reasons = _reasons(backend, inputs)
    if reasons:
        raise ValueError(
            f"backend {backend.name!r} cannot run these inputs ({inputs.describe()}): "
            + "; ".join(reasons)
        )
    return backend


def select_backend(inputs: Inputs) -> Backend:
    """The backend auto-dispatch runs for ``inputs`` (docs/contract.md §6, :mod:`flash_dmattn.policy`).

    The first call of a signature (:func:`dispatch_signature`) ranks the backends, asks each
    in turn why it cannot run the call, logs the choice and warns about a slow fallback; the
    choice is kept in :data:`DISPATCH_MEMO`, which answers later calls of the signature."""
    forced = forced_name()
    if forced is not None:
        return check_explicit(get_backend(forced), inputs)
    compiling = torch.compiler.is_compiling()  # traced once per graph: no memo to guard on
    key = None if compiling else dispatch_signature(inputs)
    if key is not None:
        try:
            backend = DISPATCH_MEMO.get(key)
        except TypeError:  # symbolic sizes (tracing outside torch.compile) have no hash
            key = backend = None
        if backend is not None:
            return backend
    ranking = policy.rank(inputs)
    declined: List[Tuple[str, List[str]]] = []
    for name in ranking.order:
        reasons = _decline_reasons(name, inputs)
        if reasons:
            declined.append((name, reasons))
            continue
        backend = _BACKENDS[name]
        if not compiling:
            _note_choice(backend, inputs, ranking)
            if key is not None:
                DISPATCH_MEMO.put(key, backend)
        return backend
    raise RuntimeError(
        f"no flash_dmattn backend can run these inputs ({inputs.describe()}):\n"
        + _format_declines(declined)
    )


def dispatch_signature(inputs: Inputs) -> Optional[tuple]:
    """What auto-dispatch's decision for ``inputs`` depends on, as a hashable key (None: a
    call whose decision is not memoised, i.e. packed sequences, whose reasons read more of
    the call).

    The decision reads the call's :class:`~flash_dmattn.policy.CallFeatures`, each backend's
    availability and ``not_supported_reasons``, and the configuration. The key holds every
    property of the call those read: device, dtype, the shapes of query and key (value's
    equals key's), of the mask (and its dtype) and bias (dtype, whether it requires grad), of
    key intervals and their window, of the page table, whether there is a KV cache, the
    flags (causal, softcap, deterministic, attention probs, dropout), whether autograd will
    ask for a gradient, and a simulated compute capability; and the configuration:
    ``FLASH_DMATTN_DISABLE``, ``FLASH_DMATTN_CUDA_AUTO``, ``TRITON_INTERPRET`` and
    ``FLASH_DMATTN_BACKEND`` as set now (:func:`flash_dmattn.envs.dispatch_environment`).
    Strides and values are not in it: no backend's answer reads them.

    A plain call (:func:`run_plain`) has a shorter key that :func:`run_plain` builds from
    the call's arguments alike: on CPU, :data:`PLAIN_CPU` first, then the shapes of query and
    key, the dtype, the causal and deterministic flags, the two gradient flags above and the
    configuration (the rest is fixed for such calls, and a simulated capability is one of
    CUDA devices only, :func:`flash_dmattn.policy.device_capability`); on CUDA,
    :data:`PLAIN_CUDA` first, then the device, the same items and the simulated capability
    before the configuration."""
    if type(inputs) is not AttentionInputs:
        return None
    q, k = inputs.query, inputs.key
    mask, bias = inputs.attn_mask, inputs.attn_bias
    intervals, table = inputs.key_intervals, inputs.block_table
    grad_mode = torch.is_grad_enabled()
    if inputs.plain:
        device = inputs.device
        if device.type in ("cpu", "cuda"):
            grad = grad_mode and (q.requires_grad or k.requires_grad
                                  or inputs.value.requires_grad)
            return _plain_signature(None if device.type == "cpu" else device, q.shape, k.shape,
                                    q.dtype, inputs.is_causal, inputs.deterministic, grad_mode,
                                    grad, envs.dispatch_environment())
    return (
        inputs.device, q.dtype, q.shape, k.shape,
        None if mask is None else (mask.shape, mask.dtype),
        None if bias is None else (bias.shape, bias.dtype, bias.requires_grad),
        None if intervals is None else (intervals.shape, inputs.key_window),
        None if table is None else (table.shape, table.dtype),
        inputs.cache_seqlens is not None, inputs.is_causal, inputs.softcap,
        inputs.deterministic, inputs.return_attn_probs, inputs.dropout_p, grad_mode,
        grad_mode and (q.requires_grad or k.requires_grad or inputs.value.requires_grad),
        policy.simulated(), envs.dispatch_environment(),
    )


class DispatchMemo:
    """Auto-dispatch's decisions, by :func:`dispatch_signature`.

    A decision is a function of the signature as long as each backend's availability and
    ``not_supported_reasons`` are functions of it (they read shapes, dtypes and flags, never
    tensor values or strides). What the key cannot see empties the memo: a backend
    registered (:func:`register_backend`), a run-time decline remembered or forgotten
    (:func:`remember_decline`, :func:`forget_declines`), the dispatch notes reset
    (:func:`reset_dispatch_notes`: the memo's answers are not logged again). Code that
    changes a backend's answers in place (tests with fake backends) calls :meth:`clear`.

    Lifetime: the process, at most :attr:`MAX_ENTRIES` signatures; a decoding loop adds one
    per generated token (its key length grows), so the oldest are dropped first.
    """

    MAX_ENTRIES = 512

    def __init__(self) -> None:
        self._chosen: Dict[tuple, Backend] = {}
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple) -> Optional[Backend]:
        backend = self._chosen.get(key)
        if backend is None:
            self.misses += 1
        else:
            self.hits += 1
        return backend

    def peek(self, key: tuple) -> Optional[Backend]:
        """The decision for ``key`` (None: none yet), counted by the caller: :func:`run_plain`
        counts a hit when it serves the call, and leaves the rest to the full dispatch."""
        return self._chosen.get(key)

    def put(self, key: tuple, backend: Backend) -> None:
        chosen = self._chosen
        if len(chosen) >= self.MAX_ENTRIES:
            del chosen[next(iter(chosen))]  # the oldest (dicts keep insertion order)
        chosen[key] = backend

    def clear(self) -> None:
        self._chosen.clear()

    def __len__(self) -> int:
        return len(self._chosen)


#: The memo :func:`select_backend` keeps its decisions in.
DISPATCH_MEMO = DispatchMemo()

#: First item of a plain CPU call's memo key (:func:`dispatch_signature`, :func:`run_plain`).
PLAIN_CPU = "plain cpu call"
#: First item of a plain CUDA call's memo key (:func:`dispatch_signature`, :func:`run_plain`).
PLAIN_CUDA = "plain cuda call"

_grad_enabled = torch.is_grad_enabled  # read by run_plain on every call


def _plain_signature(device, q_shape, k_shape, dtype, is_causal: bool, deterministic: bool,
                     grad_mode: bool, needs_grad: bool, env: tuple) -> tuple:
    """The memo key of a plain call (:func:`dispatch_signature` and :func:`run_plain` build it
    alike): ``device`` None for CPU tensors, else the CUDA device, whose key also holds the
    simulated capability."""
    if device is None:
        return (PLAIN_CPU, q_shape, k_shape, dtype, is_causal, deterministic, grad_mode,
                needs_grad, env)
    return (PLAIN_CUDA, device, q_shape, k_shape, dtype, is_causal, deterministic, grad_mode,
            needs_grad, policy.simulated(), env)


def run_plain(query, key, value, softmax_scale, is_causal, deterministic):
    """A plain call of :func:`flash_dmattn.flash_dmattn_func` (no mask, bias, soft cap, KV
    cache, dropout or attention probabilities; the caller checks those) on CPU or CUDA
    tensors, run without building :class:`AttentionInputs`: its output, or None when the full
    path must run it.

    It runs only where :data:`DISPATCH_MEMO` holds the call's signature (:func:`dispatch_signature`):
    an earlier call with that signature passed :meth:`AttentionInputs.from_args`, whose checks
    of ranks, batch, heads and head dims read nothing else, and auto-dispatch chose a backend
    for it. What the signature leaves out is checked here on every call: the types, key and
    value alike (dtype, device, shape), last dims contiguous (else the full path copies them),
    the flags and a finite ``softmax_scale``. Anything else takes the full path, which raises
    the usual errors; so does a forced backend (``FLASH_DMATTN_BACKEND``), a compiled graph,
    and a backend with no plain entry for the device (:meth:`Backend.plain_attention` for CPU
    tensors, :meth:`Backend.plain_cuda_attention` for CUDA tensors: a decoding step of a
    model with no mask, on the triton backend's split-KV decode kernel).

    A CUDA call with ``deterministic=True`` that needs a gradient is never served here, whatever
    the memo holds for its signature: the plain CUDA entries take no ``deterministic`` flag,
    and torch-reference's (one SDPA call, which auto-dispatch may have chosen for the signature
    as a fallback) would differentiate it with SDPA's backward, which accumulates with atomics.
    The full path runs it instead, on the backend auto-dispatch chose, which reads the flag
    (torch-reference then computes it without SDPA). Forward-only deterministic calls and CPU
    calls are served as any other."""
    tensor = torch.Tensor
    if not (isinstance(query, tensor) and isinstance(key, tensor)
            and isinstance(value, tensor)):
        return None
    if query.is_cpu:
        if not (key.is_cpu and value.is_cpu):
            return None
        device = None
    elif query.is_cuda:
        device = query.device
        if key.device != device or value.device != device:
            return None
    else:
        return None
    if torch.compiler.is_compiling():
        return None
    if is_causal is None:
        is_causal = False
    elif is_causal.__class__ is not bool:
        return None
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    elif deterministic.__class__ is not bool:
        return None
    if softmax_scale is not None and (softmax_scale.__class__ is not float
                                      or not math.isfinite(softmax_scale)):
        return None
    dtype = query.dtype
    if key.dtype is not dtype or value.dtype is not dtype:
        return None
    q_shape, k_shape = query.shape, key.shape
    if value.shape != k_shape:
        return None
    # A last dim with another stride the full path copies (_last_dim_contiguous): SDPA would
    # take its math kernel on it instead of the fused one.
    if not (query.is_contiguous() or query.stride(-1) == 1) or not (
            key.is_contiguous() or key.stride(-1) == 1) or not (
            value.is_contiguous() or value.stride(-1) == 1):
        return None
    env = envs.dispatch_environment()
    if env[3] is not None:  # FLASH_DMATTN_BACKEND: select_backend reads it
        return None
    grad = _grad_enabled()
    needs = grad and (query.requires_grad or key.requires_grad or value.requires_grad)
    if needs and deterministic and device is not None:
        return None  # a deterministic backward on CUDA: never SDPA's (see above)
    signature = _plain_signature(device, q_shape, k_shape, dtype, is_causal, deterministic, grad,
                                 needs, env)
    try:
        backend = DISPATCH_MEMO._chosen.get(signature)  # DispatchMemo.peek, one call less
    except TypeError:  # symbolic sizes (tracing outside torch.compile) have no hash
        return None
    if backend is None:
        return None
    entry = backend.plain_attention if device is None else backend.plain_cuda_attention
    out = entry(query, key, value, softmax_scale, is_causal, q_shape[1], k_shape[1])
    if out is not None:
        DISPATCH_MEMO.hits += 1
    return out


def run_auto(inputs: Inputs):
    """Run ``inputs`` on the backend auto-dispatch selects. A backend that finds the call beyond
    it only when it runs (:class:`BackendDeclined`, or its kernels fail to compile,
    :func:`is_compile_failure`) declines calls like it from then on (:func:`remember_decline`),
    and the next backend runs this one."""
    varlen = isinstance(inputs, VarlenInputs)
    for _ in range(len(PRIORITY)):
        backend = select_backend(inputs)
        entry = backend.varlen_attention if varlen else backend.attention
        if torch.compiler.is_compiling():
            return entry(inputs)
        try:
            return entry(inputs)
        except Exception as exc:
            if isinstance(exc, BackendDeclined) and exc.backend == backend.name:
                reason = exc.reason
            elif is_compile_failure(exc):
                reason = failure_reason(exc)
            else:
                raise
            remember_decline(backend.name, inputs, reason)
            logger.warning("flash_dmattn: backend %r cannot run this call (%s); running the "
                           "next backend", backend.name, reason)
    raise RuntimeError(f"every backend declined these inputs while running ({inputs.describe()})")


def auto_backend_name(inputs: Inputs) -> Optional[str]:
    """The name of the backend auto-dispatch would run for ``inputs`` (None: none can), without
    logging or warning."""
    forced = forced_name()
    if forced is not None:
        return forced
    for name in policy.rank(inputs).order:
        if not _decline_reasons(name, inputs):
            return name
    return None


def _decline_reasons(name: str, inputs: Inputs) -> List[str]:
    """Why backend ``name`` cannot run ``inputs`` here (unavailable, or unsupported inputs)."""
    backend = _BACKENDS.get(name)
    if backend is None:
        return [f"unavailable: {NOT_BUILT}"]
    reason = unavailable_reason(backend)
    if reason is not None:
        return [f"unavailable: {reason}"]
    return _reasons(backend, inputs)


class Explanation:
    """What auto-dispatch does with one call: the policy's :class:`~flash_dmattn.policy.Ranking`,
    the backend it takes (None: none can) and, per backend, why it was or was not taken."""

    def __init__(self, ranking, taken: Optional[str], rows: List[Tuple[str, str, List[str]]]):
        self.ranking = ranking
        self.taken = taken
        self.rows = rows  # (name, status, reasons); status: taken/declined/passed over/not reached

    def lines(self) -> List[str]:
        rule = self.ranking.rule
        out = [f"call: {self.ranking.features.describe()}",
               f"dispatch rule: {rule.key} [{rule.arch}] {rule.when}",
               f"  why: {rule.reason}",
               f"  measured: {rule.evidence}",
               f"order: {' > '.join(self.ranking.prefer)}"
               + (f" (fallback: {' > '.join(self.ranking.fallback)})" if self.ranking.fallback
                  else ""),
               f"auto takes: {self.taken or 'nothing (every backend declines)'}"]
        for name, status, reasons in self.rows:
            out.append(f"  {name}: {status}" + (f": {'; '.join(reasons)}" if reasons else ""))
        return out


def explain(inputs: Inputs, assume_available: bool = False) -> Explanation:
    """Which backend auto-dispatch takes for ``inputs`` and why each other one was not: it
    declined (unavailable, or the inputs are beyond it), the policy passed it over, or a
    backend ranked before it was taken. ``FLASH_DMATTN_BACKEND`` is ignored (it is no choice).
    ``assume_available``: judge every registered backend by the inputs alone, as on a machine
    where it is installed (a call described for a GPU this machine does not have)."""
    ranking = policy.rank(inputs)
    taken = None
    rows: List[Tuple[str, str, List[str]]] = []
    for name in ranking.order:
        if assume_available and name in _BACKENDS:
            reasons = _reasons(_BACKENDS[name], inputs)
        else:
            reasons = _decline_reasons(name, inputs)
        passed = ranking.passed_over.get(name)
        if reasons:
            rows.append((name, "declined", reasons))
        elif taken is None:
            taken = name
            rows.append((name, "taken", [passed] if passed else []))
        elif passed:
            rows.append((name, "passed over", [passed]))
        else:
            rows.append((name, "not reached", [f"ranked after {taken}"]))
    return Explanation(ranking, taken, rows)


def _format_declines(declined: Iterable[Tuple[str, List[str]]]) -> str:
    return "\n".join(f"  {name}: {'; '.join(reasons)}" for name, reasons in declined)


def _note_choice(backend: Backend, inputs: Inputs, ranking) -> None:
    key = (backend.name, inputs.device.type, type(inputs).__name__)
    if key not in _logged_choices:
        _logged_choices.add(key)
        logger.info("flash_dmattn: using backend %r for %s inputs (dispatch rule %r)",
                    backend.name, inputs.device.type, ranking.rule.key)
    if (backend.name == "torch-reference" and inputs.device.type in ACCELERATED_DEVICE_TYPES
            and not ranking.rule.reference_fast):
        # A slow fallback (not a rule's fast SDPA route, e.g. small plain decoding steps): why
        # every other backend did not run, its own reasons where it cannot run the call, else
        # the policy's reason for passing it over.
        declined = []
        for name in PRIORITY:
            if name == backend.name:
                continue
            reasons = _decline_reasons(name, inputs) or (
                [ranking.passed_over[name]] if name in ranking.passed_over else [])
            if reasons:
                declined.append((name, reasons))
        wkey = (inputs.device.type, tuple((n, tuple(r)) for n, r in declined))
        if wkey not in _warned_fallbacks:
            _warned_fallbacks.add(wkey)
            warnings.warn(
                "flash_dmattn fell back to the slow torch-reference backend on "
                f"{inputs.device.type} ({inputs.describe()}) because the faster backends "
                "declined:\n" + _format_declines(declined),
                RuntimeWarning,
                stacklevel=4,
            )


def reset_dispatch_notes() -> None:
    """Forget which choices were logged / warned, and the memoised decisions (their answers
    are not logged again); tests use this."""
    _logged_choices.clear()
    _warned_fallbacks.clear()
    DISPATCH_MEMO.clear()
