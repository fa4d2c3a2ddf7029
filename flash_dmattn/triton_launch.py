"""Launching small hot Triton kernels without Triton's per-launch argument specialisation.

``kernel[grid](*args, **meta)`` runs ``JITFunction.run`` on every launch: it binds every
argument, specialises each one (its type; for an int whether it is 1, divisible by 16 and
fits 32 bits; for a tensor its dtype and whether its address is 16-byte aligned), turns that
into a cache-key string, looks the compiled kernel up, checks the globals the kernel read
and only then calls the compiled kernel's launcher. For a decode step's kernels (20-45
arguments, several launches per layer, every layer of every generated token) and for the
planner's (a top-W selection and its interval lists, mask summaries, tile and gather lists:
about a dozen small launches per attention call) that Python work costs more host time than
the launch itself.

The module imports no backend: the triton backend and the backend-neutral planner
(:mod:`flash_dmattn.planning`, which the cuda and flex backends use too) launch through it.

:func:`launch` does Triton's work once per *launch signature* and from then on calls the
``CompiledKernel``'s launcher directly, exactly as ``JITFunction.run`` ends. The signature
holds everything Triton specialises a launch on:

* the device the launch goes to (Triton's current device);
* ``meta``: constexprs and launch options (``num_warps``, ``num_stages``, ``maxnreg``, ...),
  by name, value and type; and Triton's debug switch;
* per positional argument: a tensor's dtype and its address modulo 16 (Triton reads whether
  it is 16-byte aligned); an int's width (32 / 64 bits signed, 64 unsigned), whether it is 1
  (Triton makes it a constant) and whether it is divisible by 16 (:func:`_arg_spec`); the
  type of a float, a bool or None.

The first launch of a signature goes through Triton's normal path (compiling if needed, with
every check Triton makes), which returns the compiled kernel that later launches of the
signature reuse. A signature this module does not model (an argument of another type, a
parameter left to its default) keeps the normal path for every launch, and so does every
launch under Triton's interpreter (its kernels are not ``JITFunction``\\ s), with
pre-run hooks on the kernel, or with launch hooks installed (profilers such as proton read
the launch metadata, which only the normal path builds), and every launch with a Triton older
than 3.4 (whose launcher takes other arguments).
"""
from __future__ import annotations

import operator
from typing import Dict, Optional

import torch

try:  # Triton 3.4 and later: the launcher convention below (every parameter, hooks in knobs)
    from triton import knobs
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction
except ImportError:  # an older Triton: every launch takes its normal path
    knobs = driver = JITFunction = None

_I32 = (-(1 << 31), (1 << 31) - 1)
_I64 = (-(1 << 63), (1 << 63) - 1)


def _arg_spec(args: tuple) -> Optional[tuple]:
    """What Triton specialises ``args`` on, as a hashable tuple (at least as fine as Triton's
    own specialisation: two argument lists Triton compiles differently never share it); None
    for an argument type this module does not model."""
    spec = []
    add = spec.append
    for a in args:
        t = type(a)
        if t is int:
            if a == 1:
                add(1)  # a constant in the compiled kernel
            elif _I32[0] <= a <= _I32[1]:
                add(2 if a & 15 else 3)  # i32, then divisible by 16 or not
            elif _I64[0] <= a <= _I64[1]:
                add(4 if a & 15 else 5)  # i64
            else:
                add(6 if a & 15 else 7)  # u64
        elif isinstance(a, torch.Tensor):
            add((a.dtype, not (a.data_ptr() & 15)))
        elif t is float:
            add(8)
        elif t is bool:
            add(9)
        elif a is None:
            add(0)
        else:
            return None
    return tuple(spec)


def _hooks_idle() -> bool:
    """Whether no launch hook is installed (Triton keeps them in hook chains, or None)."""
    rt = knobs.runtime
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


class _Entry:
    """One launch signature's compiled kernel, with the constexpr values that follow the
    positional arguments in its parameter list (the launcher takes every parameter)."""

    __slots__ = ("compiled", "tail")

    def __init__(self, compiled, tail: tuple) -> None:
        self.compiled = compiled
        self.tail = tail


_PLAIN_SCALARS = frozenset((int, float, bool, type(None)))
_DTYPE = operator.attrgetter("dtype")
_DATA_PTR = torch.Tensor.data_ptr
_LOW_BITS = (15).__and__  # an address's offset from 16-byte alignment


class _KernelLaunches:
    """One kernel's launch signatures, and its last launch's arguments as seen by
    :meth:`LaunchCache.launch`'s quick check."""

    __slots__ = ("kernel", "entries", "tensors", "last_probe", "last_scalars", "last_entry")

    def __init__(self, kernel) -> None:
        self.kernel = kernel  # held, so that the id the cache files it under stays its own
        self.entries: Dict[tuple, Optional[_Entry]] = {}
        self.tensors: Optional[int] = None  # leading tensor arguments of its first launch
        self.last_probe = self.last_scalars = self.last_entry = None


class LaunchCache:
    """Compiled kernels by launch signature, for :func:`launch`.

    Lifetime: the process, like Triton's own cache of compiled kernels (the entries are those
    very ``CompiledKernel`` objects, which Triton keeps alive anyway). At most
    :attr:`MAX_ENTRIES` signatures are kept per kernel (a decode step or a plan adds none
    once its shapes have been seen: strides and lengths change the key only through the
    properties Triton specialises on); beyond that the kernel's entries are dropped and refilled from
    Triton's cache. :meth:`clear` empties it (tests; after changing Triton's knobs, which the
    cached kernels do not see).

    Per launch, the leading tensor arguments (as many as the kernel's first launch had) are
    read for their dtypes and address alignment; the other arguments and ``meta`` are
    compared with the kernel's previous launch (values and types): every layer of a decoding
    step, or of a model's forward, repeats the previous layer's lengths and strides, so their
    specialisation is worked out once a step, not once a launch.
    """

    MAX_ENTRIES = 256

    def __init__(self) -> None:
        self._kernels: Dict[int, _KernelLaunches] = {}

    def clear(self) -> None:
        self._kernels.clear()

    def entries(self, kernel) -> dict:
        """The signatures of ``kernel`` seen so far (tests)."""
        found = self._kernels.get(id(kernel))
        return dict(found.entries) if found is not None else {}

    def launch(self, kernel, grid: tuple, args: tuple, meta: dict) -> None:
        """``kernel[grid](*args, **meta)``; see :func:`launch`."""
        if (JITFunction is None or type(kernel) is not JITFunction or kernel.pre_run_hooks
                or not _hooks_idle()):
            kernel[grid](*args, **meta)
            return
        st = self._kernels.get(id(kernel))
        if st is None:
            st = self._kernels[id(kernel)] = _KernelLaunches(kernel)
        drv = driver.active
        device = drv.get_current_device()
        entry = None
        n = st.tensors
        if n is not None:
            head, scalars = args[:n], args[n:]
            try:
                low_bits = tuple(map(_LOW_BITS, map(_DATA_PTR, head)))
            except TypeError:  # not a tensor where the first launch had one
                low_bits = None
            if low_bits is not None:
                values = tuple(meta.values())
                probe = (device, knobs.runtime.debug, tuple(map(_DTYPE, head)), low_bits,
                         tuple(map(type, scalars)), tuple(map(type, values)), tuple(meta),
                         values)
                # Types are compared before values (the probe's order), so the scalars
                # compared are plain numbers like the last ones.
                if probe == st.last_probe and scalars == st.last_scalars:
                    entry = st.last_entry
                else:
                    entry = self._lookup(st, probe, scalars)
        if entry is None:
            self._first_launch(st, kernel, grid, args, meta)
            return
        compiled = entry.compiled
        g = len(grid)
        compiled.run(grid[0], grid[1] if g > 1 else 1, grid[2] if g > 2 else 1,
                     drv.get_current_stream(device), compiled.function, compiled.packed_metadata,
                     None, None, None, *args, *entry.tail)

    def _lookup(self, st: _KernelLaunches, probe: tuple, scalars: tuple) -> Optional[_Entry]:
        """The entry of a launch the quick check did not recognise (None: a first launch of
        its signature, or one that keeps Triton's path), remembered as the kernel's last."""
        spec = _arg_spec(scalars)
        if spec is None:
            return None
        entry = st.entries.get(probe[:4] + probe[5:] + (spec,))
        if entry is not None and _PLAIN_SCALARS.issuperset(probe[4]):
            st.last_probe, st.last_scalars, st.last_entry = probe, scalars, entry
        return entry

    def _first_launch(self, st: _KernelLaunches, kernel, grid: tuple, args: tuple,
                      meta: dict) -> None:
        """Triton's normal launch, and the entry of its signature for the launches after."""
        compiled = kernel[grid](*args, **meta)
        n = 0
        while n < len(args) and isinstance(args[n], torch.Tensor):
            n += 1
        if st.tensors is None:
            st.tensors = n
        n = st.tensors
        head = args[:n]
        if len(head) < n or not all(isinstance(a, torch.Tensor) for a in head):
            return
        spec = _arg_spec(args[n:])
        if spec is None:
            return
        values = tuple(meta.values())
        key = (driver.active.get_current_device(), knobs.runtime.debug,
               tuple(map(_DTYPE, head)), tuple(map(_LOW_BITS, map(_DATA_PTR, head))),
               tuple(map(type, values)), tuple(meta), values, spec)
        if key in st.entries:
            return
        if len(st.entries) >= self.MAX_ENTRIES:
            st.entries.clear()
            st.last_probe = st.last_scalars = st.last_entry = None
        st.entries[key] = _entry_for(kernel, compiled, args, meta)


def _entry_for(kernel, compiled, args: tuple, meta: dict) -> Optional[_Entry]:
    """The cache entry of a first launch that returned ``compiled``; None where later
    launches must take the normal path too (a parameter left to its default, or a run that
    returned no compiled kernel)."""
    if compiled is None or not all(hasattr(compiled, a) for a in
                                   ("run", "function", "packed_metadata")):
        return None
    rest = kernel.arg_names[len(args):]
    if any(name not in meta for name in rest):
        return None
    return _Entry(compiled, tuple(meta[name] for name in rest))


#: The cache :func:`launch` uses.
LAUNCHES = LaunchCache()


def launch(kernel, grid: tuple, args: tuple, meta: dict) -> None:
    """Launch ``kernel`` (a ``@triton.jit`` function) like ``kernel[grid](*args, **meta)``.

    ``args``: the positional arguments (every runtime argument, in parameter order); ``meta``:
    the constexprs that follow them and the launch options, by keyword. The compiled kernel
    is only called directly when every parameter is given so: a parameter left to its default
    keeps Triton's path, and a constexpr passed positionally would be told apart only by the
    properties of a runtime int (two values sharing them would share a compiled kernel). A
    launch signature's first launch takes Triton's normal path; the next ones call its
    compiled kernel directly (:data:`LAUNCHES`, the module docstring says when the normal
    path is kept)."""
    LAUNCHES.launch(kernel, grid, args, meta)
