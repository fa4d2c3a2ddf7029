"""Build on first use: compile one kernel specialisation, cache it on disk, load it.

Layout: ``<root>/<flash_dmattn version>/<sm_XX>/<spec name>-<key[:16]>/`` where ``<root>`` is
``$FLASH_DMATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/flash_dmattn``, else
``~/.cache/flash_dmattn``. ``key`` is a sha256 over the kernel sources, the spec name, the nvcc
and torch versions and the full compiler flags (which include the arch), so any change to
what the binary depends on gives a new entry instead of loading a stale one.

An entry is complete when its ``manifest.json`` names a built extension that exists; the
manifest is written (atomically) only after a successful build, so a crashed build is simply
redone. Processes that race to build one entry serialise on an ``fcntl.flock`` of a lock file
in the entry (released by the OS if the holder dies); the loser then finds the manifest and
loads the winner's build without compiling. Loaded modules are cached per process.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

from ... import envs
from ..._version import __version__
from . import toolchain as _toolchain
from .spec import KernelSpec
from .toolchain import Toolchain

logger = logging.getLogger("flash_dmattn")

# What every specialisation compiles (relative to the csrc dir). Forward and backward are
# separate translation units so ninja compiles them in parallel (backward is the slow one).
# ``flash_dmattn_api.cpp`` binds ``fwd(q, k, v, mask, bias, out, softmax_scale, is_causal,
# softcap, ...) -> [out, lse]``, ``bwd(...)`` and ``decode(...)`` as module ``TORCH_EXTENSION_NAME``; the spec is
# selected with the macros of :meth:`KernelSpec.defines`.
KERNEL_SOURCES = (
    "flash_dmattn_api.cpp", "flash_fwd.cu", "flash_fwd_sm90.cu", "flash_bwd.cu", "flash_bwd_sm90.cu",
    "flash_dq_gathered_sm90.cu", "flash_decode.cu",
)
# Headers may be included by any source, so all of them are hashed into the key.
_HASHED_SUFFIXES = {".cpp", ".cu", ".cuh", ".h", ".hpp", ".inl"}

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


def hashed_files(csrc_dir: Path) -> List[Path]:
    """The files whose content goes into the key: the sources and every header under csrc."""
    csrc_dir = Path(csrc_dir)
    missing = [s for s in KERNEL_SOURCES if not (csrc_dir / s).is_file()]
    if missing:
        raise FileNotFoundError(f"kernel sources missing from {csrc_dir}: {', '.join(missing)}")
    files = {csrc_dir / s for s in KERNEL_SOURCES}
    files.update(p for p in csrc_dir.rglob("*") if p.is_file() and p.suffix in _HASHED_SUFFIXES)
    return sorted(files)


def source_digest(csrc_dir: Path) -> str:
    """sha256 over the relative paths and contents of :func:`hashed_files`."""
    h = hashlib.sha256()
    for path in hashed_files(csrc_dir):
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


def cache_key(spec: KernelSpec, tc: Toolchain, csrc_dir: Path) -> str:
    """sha256 hex over sources, spec name, nvcc and torch versions and all compiler flags."""
    h = hashlib.sha256()
    for part in (
        source_digest(csrc_dir),
        spec.name,
        f"nvcc {tc.nvcc_version}",
        f"torch {tc.torch_version}",
        " ".join(cuda_flags(spec, tc)),
        " ".join(cxx_flags(spec)),
    ):
        h.update(part.encode() + b"\n")
    return h.hexdigest()


def entry_dir(spec: KernelSpec, tc: Toolchain, key: str, root: Optional[Path] = None) -> Path:
    """``<root>/<version>/<sm_XX>/<spec>-<key[:16]>`` (the spec name keeps listings readable)."""
    root = cache_root() if root is None else Path(root)
    return root / __version__ / tc.arch / f"{spec.name}-{key[:16]}"


def module_name(spec: KernelSpec, key: str) -> str:
    """Extension module name; unique per key so two builds never clash in one process."""
    return f"flash_dmattn_cuda_{spec.ident}_{key[:12]}"


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


def read_manifest(entry: Path, key: str) -> Optional[dict]:
    """The entry's manifest if it is complete for ``key`` (its artifact exists), else None."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("key") != key:
        return None
    artifact = entry / str(manifest.get("artifact", ""))
    return manifest if manifest.get("artifact") and artifact.is_file() else None


def _write_manifest(entry: Path, manifest: dict) -> None:
    tmp = entry / f".{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    os.replace(tmp, entry / MANIFEST)  # atomic: readers see no manifest or a whole one


def is_built(spec: KernelSpec, tc: Optional[Toolchain] = None, csrc_dir: Optional[Path] = None,
             cache_dir: Optional[Path] = None) -> bool:
    """Whether ``spec`` has a complete cache entry for this toolchain and these sources."""
    tc = _toolchain.detect() if tc is None else tc
    csrc_dir = _require_csrc() if csrc_dir is None else Path(csrc_dir)
    key = cache_key(spec, tc, csrc_dir)
    return read_manifest(entry_dir(spec, tc, key, cache_dir), key) is not None


def _require_csrc() -> Path:
    d = find_csrc_dir()
    if d is None:
        raise FileNotFoundError(
            "the CUDA kernel sources are not present in this version of flash_dmattn: missing "
            + ", ".join(missing_kernel_sources())
        )
    return d


def load_kernel(
    spec: KernelSpec,
    tc: Optional[Toolchain] = None,
    *,
    csrc_dir: Optional[Path] = None,
    cache_dir: Optional[Path] = None,
    builder: Optional[Callable[[BuildRequest], object]] = None,
    loader: Optional[Callable[[str, Path], object]] = None,
):
    """The extension module for ``spec``: from this process's cache, from disk, or compiled now.

    ``tc`` defaults to the current device's toolchain (:func:`toolchain.detect`), ``csrc_dir``
    to the package's kernel sources, ``cache_dir`` to :func:`cache_root`. ``builder`` compiles a
    :class:`BuildRequest` and returns the loaded module (default :func:`torch_builder`);
    ``loader(name, path)`` loads an already built one (default :func:`import_extension`).
    Tests inject both to exercise caching and locking without nvcc.
    """
    tc = _toolchain.detect() if tc is None else tc
    # Per-call fast path: hashing the sources for the cache key reads every file under csrc/,
    # a cost comparable to a whole attention call on the GPU. The sources of a running
    # process are taken as fixed (clear_loaded() forgets this).
    call_key = (spec, tc, csrc_dir, cache_dir, builder, loader,
                tuple(envs.cuda_extra_flags()), envs.cache_dir())
    module = _BY_CALL.get(call_key)
    if module is not None:
        return module
    module = _load_kernel(spec, tc, csrc_dir, cache_dir, builder, loader)
    _BY_CALL[call_key] = module
    return module


def _load_kernel(spec, tc, csrc_dir, cache_dir, builder, loader):
    csrc_dir = _require_csrc() if csrc_dir is None else Path(csrc_dir)
    builder = torch_builder if builder is None else builder
    loader = import_extension if loader is None else loader

    key = cache_key(spec, tc, csrc_dir)
    if key in _LOADED:
        return _LOADED[key]
    entry = entry_dir(spec, tc, key, cache_dir)
    name = module_name(spec, key)

    manifest = read_manifest(entry, key)
    if manifest is None:
        entry.mkdir(parents=True, exist_ok=True)
        with file_lock(entry / LOCK_FILE):
            # Another process may have finished this build while we waited for the lock.
            manifest = read_manifest(entry, key)
            if manifest is None:
                module = _build(spec, tc, csrc_dir, entry, key, name, builder)
                _LOADED[key] = module
                return module
    module = loader(manifest["module"], entry / manifest["artifact"])
    _LOADED[key] = module
    return module


def _build(spec, tc, csrc_dir, entry, key, name, builder):
    logger.info(
        "flash_dmattn: compiling cuda kernel %s for %s (first use, cached in %s)",
        spec.name, tc.arch, entry,
    )
    artifact = entry / f"{name}{_LIB_EXT}"
    req = BuildRequest(
        name=name,
        sources=[str(Path(csrc_dir) / s) for s in KERNEL_SOURCES],
        build_dir=entry,
        artifact=artifact,
        extra_cflags=cxx_flags(spec),
        extra_cuda_cflags=cuda_flags(spec, tc),
        extra_include_paths=[tc.cutlass_include, str(csrc_dir)],
    )
    start = time.time()
    module = builder(req)
    if not artifact.is_file():
        raise RuntimeError(f"building {spec.name} produced no {artifact.name} in {entry}")
    _write_manifest(entry, {
        "key": key,
        "spec": spec.name,
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
