"""Build on first use: compile one operation of one kernel specialisation, cache it on disk,
load it.

Each specialisation (:class:`~.spec.KernelSpec`) is built as one extension module per
operation (:data:`OPS`): ``fwd`` (the forward, its gathered and key-interval variants),
``bwd`` (the backward) and ``decode`` (the split-KV decode), each from its own binding and
kernel sources (:data:`OP_SOURCES`). A call loads the module of the operation it runs, so a
forward-only or decode-only caller never compiles backward kernels, and the operations of
one spec build side by side.

Layout: ``<root>/<flash_dmattn version>/<sm_XX>/<spec name>-<op>-<key[:16]>/`` where ``<root>``
is ``$FLASH_DMATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/flash_dmattn``, else
``~/.cache/flash_dmattn``. ``key`` is a sha256 over the operation, its sources and the headers
they include, the spec name, the nvcc and torch versions and the full compiler flags (which
include the arch), so any change to what the binary depends on gives a new entry instead of
loading a stale one, and an edit to one operation's sources leaves the others' entries valid.

An entry is complete when its ``manifest.json`` names a built extension that exists; the
manifest is written (atomically) only after a successful build, so a crashed build is simply
redone. Processes that race to build one entry serialise on an ``fcntl.flock`` of a lock file
in the entry (released by the OS if the holder dies); the loser then finds the manifest and
loads the winner's build without compiling. Loaded modules are cached per process.
"""
from __future__ import annotations

import contextlib
import concurrent.futures
import hashlib
import importlib.util
import json
import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from ... import envs
from ..._version import __version__
from . import toolchain as _toolchain
from .spec import KernelSpec
from .toolchain import Toolchain

logger = logging.getLogger("flash_dmattn")

# What each operation of a specialisation compiles (relative to the csrc dir): its binding
# (``flash_<op>_api.cpp``, the module ``TORCH_EXTENSION_NAME`` with the op's Python entry
# points, e.g. ``fwd(q, k, v, mask, bias, out, softmax_scale, is_causal, softcap, ...) ->
# [out, lse]``) and its kernels, one translation unit each so that ninja compiles them in
# parallel. The Hopper forward is a dispatcher (``flash_fwd_sm90.cu``, no CuTe) and one unit per
# kernel -- walk, dropout and soft-cap setting: ``flash_fwd_sm90_<walk>[_dropout][_softcap].cu``
# -- since the slowest unit sets the operation's build time; those units parse CuTe in nvcc's
# device pass only (csrc/flash_dmattn/fwd_sm90_kernel.cuh). The spec is selected with the macros
# of :meth:`KernelSpec.defines`; the sm_90a sources compile to nothing for other archs, and a
# kernel unit to nothing in the modules without its kernel (no mask, packed, no dropout). On
# sm_90a, ``flash_fwd.cu`` only answers the module's questions (its kernel is for other archs).
OP_SOURCES: Dict[str, Tuple[str, ...]] = {
    "fwd": ("flash_fwd_api.cpp", "flash_fwd.cu", "flash_fwd_sm90.cu",
            "flash_fwd_sm90_dense.cu", "flash_fwd_sm90_dense_softcap.cu",
            "flash_fwd_sm90_dense_dropout.cu", "flash_fwd_sm90_dense_dropout_softcap.cu",
            "flash_fwd_sm90_gather.cu", "flash_fwd_sm90_gather_softcap.cu",
            "flash_fwd_sm90_gather_dropout.cu", "flash_fwd_sm90_gather_dropout_softcap.cu",
            "flash_fwd_sm90_intervals.cu", "flash_fwd_sm90_intervals_softcap.cu",
            "flash_fwd_sm90_intervals_dropout.cu",
            "flash_fwd_sm90_intervals_dropout_softcap.cu"),
    "bwd": ("flash_bwd_api.cpp", "flash_bwd.cu", "flash_bwd_sm90.cu",
            "flash_dq_gathered_sm90.cu"),
    "decode": ("flash_decode_api.cpp", "flash_decode.cu"),
}
OPS: Tuple[str, ...] = tuple(OP_SOURCES)
# Every source of every operation (what a csrc dir must hold).
KERNEL_SOURCES: Tuple[str, ...] = tuple(s for srcs in OP_SOURCES.values() for s in srcs)
# ``#include "..."`` lines, followed from an operation's sources to the headers it compiles.
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)

MANIFEST = "manifest.json"
# Not "lock": torch.utils.cpp_extension.load keeps its own baton file of that name in the
# build directory, and deletes it when done.
LOCK_FILE = ".flash_dmattn.lock"
_LIB_EXT = ".pyd" if sys.platform == "win32" else ".so"

CXX_FLAGS = ["-O3", "-std=c++17"]
NVCC_FLAGS = [
    "-O3",
    "-std=c++17",
    "--use_fast_math",
    # torch's extension builder disables the half/bf16 operators CuTe relies on.
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
]

_LOADED: Dict[str, object] = {}
_BY_CALL: Dict[tuple, object] = {}  # load_kernel's arguments -> module
# A call's raw attributes -> module (extension.kernel_module's memo; emptied with _BY_CALL).
BY_ATTRIBUTES: Dict[tuple, object] = {}


def package_csrc_dirs() -> List[Path]:
    """Where the kernel sources may be: inside the package (an installed wheel would ship them
    there), then the repository's top-level ``csrc`` (source checkouts, editable installs)."""
    pkg = Path(__file__).resolve().parents[2]  # .../flash_dmattn
    return [pkg / "csrc", pkg.parent / "csrc"]


def find_csrc_dir() -> Optional[Path]:
    """The first csrc dir that has every file of :data:`KERNEL_SOURCES`, else None."""
    for d in package_csrc_dirs():
        if all((d / s).is_file() for s in KERNEL_SOURCES):
            return d
    return None


def missing_kernel_sources() -> List[str]:
    """The :data:`KERNEL_SOURCES` missing from the best csrc candidate (empty = all present)."""
    if find_csrc_dir() is not None:
        return []
    # Report against the directory that exists (or the repository one) for a useful message.
    dirs = package_csrc_dirs()
    d = next((d for d in dirs if d.is_dir()), dirs[-1])
    return [str(d / s) for s in KERNEL_SOURCES if not (d / s).is_file()]


def cache_root() -> Path:
    """Root of the on-disk kernel cache (see the module docstring for the precedence)."""
    override = envs.cache_dir()
    if override is not None:
        return override
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "flash_dmattn"


def check_op(op: str) -> str:
    """``op`` if it names an operation of :data:`OPS`, else ``ValueError`` listing them."""
    if op not in OP_SOURCES:
        raise ValueError(f"unknown kernel operation {op!r}; operations are {', '.join(OPS)}")
    return op


def hashed_files(csrc_dir: Path, op: str) -> List[Path]:
    """The files whose content goes into ``op``'s key: its sources and, transitively, the
    headers under ``csrc_dir`` they include (``#include "..."``, resolved as nvcc does: beside
    the including file, then in ``csrc_dir``; includes inside ``#if`` blocks count too).
    Headers found outside ``csrc_dir`` (CUTLASS) are not followed."""
    csrc_dir = Path(csrc_dir).resolve()
    sources = OP_SOURCES[check_op(op)]
    missing = [s for s in sources if not (csrc_dir / s).is_file()]
    if missing:
        raise FileNotFoundError(f"kernel sources missing from {csrc_dir}: {', '.join(missing)}")
    todo = [csrc_dir / s for s in sources]
    files = set(todo)
    while todo:
        path = todo.pop()
        for name in _INCLUDE.findall(path.read_text(errors="replace")):
            found = next((base / name for base in (path.parent, csrc_dir)
                          if (base / name).is_file()), None)
            if found is None:
                continue
            found = found.resolve()
            if found.is_relative_to(csrc_dir) and found not in files:
                files.add(found)
                todo.append(found)
    return sorted(files)


def source_digest(csrc_dir: Path, op: str) -> str:
    """sha256 over the relative paths and contents of ``op``'s :func:`hashed_files`."""
    csrc_dir = Path(csrc_dir).resolve()
    h = hashlib.sha256()
    for path in hashed_files(csrc_dir, op):
        h.update(path.relative_to(csrc_dir).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def cuda_flags(spec: KernelSpec, tc: Toolchain) -> List[str]:
    """nvcc flags for ``spec`` on ``tc``'s arch, plus ``$FLASH_DMATTN_CUDA_FLAGS`` (kernel
    development, e.g. ``-lineinfo``; part of the cache key)."""
    extra = envs.cuda_extra_flags()
    return NVCC_FLAGS + tc.gencode_flags() + spec.defines() + extra


def cxx_flags(spec: KernelSpec) -> List[str]:
    return CXX_FLAGS + spec.defines()


def cache_key(spec: KernelSpec, op: str, tc: Toolchain, csrc_dir: Path) -> str:
    """sha256 hex over the operation, its sources and headers, the spec name, the nvcc and
    torch versions and all compiler flags."""
    h = hashlib.sha256()
    for part in (
        f"op {check_op(op)}",
        source_digest(csrc_dir, op),
        spec.name,
        f"nvcc {tc.nvcc_version}",
        f"torch {tc.torch_version}",
        " ".join(cuda_flags(spec, tc)),
        " ".join(cxx_flags(spec)),
    ):
        h.update(part.encode() + b"\n")
    return h.hexdigest()


def entry_dir(spec: KernelSpec, op: str, tc: Toolchain, key: str,
              root: Optional[Path] = None) -> Path:
    """``<root>/<version>/<sm_XX>/<spec>-<op>-<key[:16]>`` (spec and operation keep listings
    readable)."""
    root = cache_root() if root is None else Path(root)
    return root / __version__ / tc.arch / f"{spec.name}-{check_op(op)}-{key[:16]}"


def module_name(spec: KernelSpec, op: str, key: str) -> str:
    """Extension module name; unique per key so two builds never clash in one process."""
    return f"flash_dmattn_cuda_{check_op(op)}_{spec.ident}_{key[:12]}"


@dataclass(frozen=True)
class BuildRequest:
    """What a builder compiles: ``sources`` into ``artifact`` (inside ``build_dir``)."""

    name: str
    sources: List[str]
    build_dir: Path
    artifact: Path
    extra_cflags: List[str]
    extra_cuda_cflags: List[str]
    extra_include_paths: List[str]


def torch_builder(req: BuildRequest):
    """Compile and load through ``torch.utils.cpp_extension.load`` (ninja, quiet)."""
    from torch.utils.cpp_extension import load

    return load(
        name=req.name,
        sources=req.sources,
        extra_cflags=req.extra_cflags,
        extra_cuda_cflags=req.extra_cuda_cflags,
        extra_include_paths=req.extra_include_paths,
        build_directory=str(req.build_dir),
        with_cuda=True,
        verbose=False,
    )


def import_extension(name: str, path: Path):
    """Load a built extension module from ``path`` without compiling anything."""
    import torch  # noqa: F401  (the extension links libtorch: load it first)

    spec = importlib.util.spec_from_file_location(name, str(path))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load extension {name} from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive cross-process lock on ``path`` (created if needed).

    ``fcntl.flock`` is released by the OS when the holder exits, so a build that crashes never
    leaves a stale lock. Windows has no fcntl: there we skip locking (two racing processes may
    then both compile; the manifest is still replaced atomically).
    """
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def read_manifest(entry: Path, key: Optional[str]) -> Optional[dict]:
    """The entry's manifest if it is complete for ``key`` (any key if None) and its artifact
    exists, else None."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or (key is not None and manifest.get("key") != key):
        return None
    artifact = entry / str(manifest.get("artifact", ""))
    return manifest if manifest.get("artifact") and artifact.is_file() else None


def _write_manifest(entry: Path, manifest: dict) -> None:
    tmp = entry / f".{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    os.replace(tmp, entry / MANIFEST)  # atomic: readers see no manifest or a whole one


def is_built(spec: KernelSpec, op: str, tc: Optional[Toolchain] = None,
             csrc_dir: Optional[Path] = None, cache_dir: Optional[Path] = None) -> bool:
    """Whether operation ``op`` of ``spec`` has a complete cache entry for this toolchain and
    its current sources."""
    tc = _toolchain.detect() if tc is None else tc
    csrc_dir = _require_csrc() if csrc_dir is None else Path(csrc_dir)
    key = cache_key(spec, op, tc, csrc_dir)
    return read_manifest(entry_dir(spec, op, tc, key, cache_dir), key) is not None


def cached_entries(root: Optional[Path] = None) -> List[dict]:
    """The complete entries of this flash_dmattn version's cache, every arch: their manifests
    (``spec``, ``op``, ``arch``, ``build_seconds``, ...) with ``path`` added, sorted by arch,
    spec and operation. Whether an entry matches the current sources is not checked here
    (:func:`is_built` does)."""
    root = cache_root() if root is None else Path(root)
    found = []
    for manifest_path in sorted((root / __version__).glob(f"*/*/{MANIFEST}")):
        entry = manifest_path.parent
        manifest = read_manifest(entry, None)
        if manifest is not None and manifest.get("op") in OP_SOURCES:
            found.append(dict(manifest, path=str(entry)))
    return sorted(found, key=lambda m: (m["arch"], m["spec"], OPS.index(m["op"])))


def _require_csrc() -> Path:
    d = find_csrc_dir()
    if d is None:
        raise FileNotFoundError(
            "the CUDA kernel sources are not present in this version of flash_dmattn: missing "
            + ", ".join(missing_kernel_sources())
        )
    return d


def _call_key(spec, op, tc, csrc_dir=None, cache_dir=None, builder=None, loader=None):
    return (spec, op, tc, csrc_dir, cache_dir, builder, loader, tuple(envs.cuda_extra_flags()),
            envs.cache_dir())


def load_kernel(
    spec: KernelSpec,
    op: str,
    tc: Optional[Toolchain] = None,
    *,
    csrc_dir: Optional[Path] = None,
    cache_dir: Optional[Path] = None,
    builder: Optional[Callable[[BuildRequest], object]] = None,
    loader: Optional[Callable[[str, Path], object]] = None,
):
    """The extension module of operation ``op`` (one of :data:`OPS`) of ``spec``: from this
    process's cache, from disk, or compiled now.

    ``tc`` defaults to the current device's toolchain (:func:`toolchain.detect`), ``csrc_dir``
    to the package's kernel sources, ``cache_dir`` to :func:`cache_root`. ``builder`` compiles a
    :class:`BuildRequest` and returns the loaded module (default :func:`torch_builder`);
    ``loader(name, path)`` loads an already built one (default :func:`import_extension`).
    Tests inject both to exercise caching and locking without nvcc.
    """
    tc = _toolchain.detect() if tc is None else tc
    # Per-call fast path: hashing the sources for the cache key reads the op's files under
    # csrc/, a cost comparable to a whole attention call on the GPU. The sources of a running
    # process are taken as fixed (clear_loaded() forgets this).
    call_key = _call_key(spec, op, tc, csrc_dir, cache_dir, builder, loader)
    module = _BY_CALL.get(call_key)
    if module is not None:
        return module
    module = _load_kernel(spec, check_op(op), tc, csrc_dir, cache_dir, builder, loader)
    _BY_CALL[call_key] = module
    return module


def load_kernels(spec: KernelSpec, ops: Sequence[str], tc: Optional[Toolchain] = None,
                 **kwargs) -> Dict[str, object]:
    """``{op: module}`` for several operations of ``spec`` (:func:`load_kernel`'s keyword
    arguments apply to each). Those that must be built are built side by side, each by its own
    ninja, so that a first training step waits for the slower of its forward and backward
    builds rather than for both in turn."""
    tc = _toolchain.detect() if tc is None else tc
    pending = [op for op in ops if _call_key(spec, op, tc, **kwargs) not in _BY_CALL]
    if len(pending) < 2:
        return {op: load_kernel(spec, op, tc, **kwargs) for op in ops}
    with concurrent.futures.ThreadPoolExecutor(len(ops)) as pool:
        futures = {op: pool.submit(load_kernel, spec, op, tc, **kwargs) for op in ops}
        return {op: future.result() for op, future in futures.items()}


def _load_kernel(spec, op, tc, csrc_dir, cache_dir, builder, loader):
    csrc_dir = _require_csrc() if csrc_dir is None else Path(csrc_dir)
    builder = torch_builder if builder is None else builder
    loader = import_extension if loader is None else loader

    key = cache_key(spec, op, tc, csrc_dir)
    if key in _LOADED:
        return _LOADED[key]
    entry = entry_dir(spec, op, tc, key, cache_dir)
    name = module_name(spec, op, key)

    manifest = read_manifest(entry, key)
    if manifest is None:
        entry.mkdir(parents=True, exist_ok=True)
        with file_lock(entry / LOCK_FILE):
            # Another process may have finished this build while we waited for the lock.
            manifest = read_manifest(entry, key)
            if manifest is None:
                module = _build(spec, op, tc, csrc_dir, entry, key, name, builder)
                _LOADED[key] = module
                return module
    module = loader(manifest["module"], entry / manifest["artifact"])
    _LOADED[key] = module
    return module


def _build(spec, op, tc, csrc_dir, entry, key, name, builder):
    logger.info(
        "flash_dmattn: compiling cuda kernel %s %s for %s (first use, cached in %s)",
        spec.name, op, tc.arch, entry,
    )
    artifact = entry / f"{name}{_LIB_EXT}"
    req = BuildRequest(
        name=name,
        sources=[str(Path(csrc_dir) / s) for s in OP_SOURCES[op]],
        build_dir=entry,
        artifact=artifact,
        extra_cflags=cxx_flags(spec),
        extra_cuda_cflags=cuda_flags(spec, tc),
        extra_include_paths=[tc.cutlass_include, str(csrc_dir)],
    )
    start = time.time()
    module = builder(req)
    if not artifact.is_file():
        raise RuntimeError(f"building {spec.name} {op} produced no {artifact.name} in {entry}")
    _write_manifest(entry, {
        "key": key,
        "spec": spec.name,
        "op": op,
        "module": name,
        "artifact": artifact.name,
        "arch": tc.arch,
        "nvcc_version": tc.nvcc_version,
        "torch_version": tc.torch_version,
        "flash_dmattn_version": __version__,
        "build_seconds": round(time.time() - start, 3),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })
    return module


def clear_loaded() -> None:
    """Forget the modules loaded in this process (tests; the disk cache is untouched)."""
    _LOADED.clear()
    _BY_CALL.clear()
    BY_ATTRIBUTES.clear()
