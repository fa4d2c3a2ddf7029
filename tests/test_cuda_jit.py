"""The cuda backend's build plumbing (issue: build on first use), tested without nvcc or a GPU.

Kernel specs, cache keys and layout (one module per operation of a spec, keyed by what that
operation compiles), the cross-process lock (with a fake builder injected into
jit.load_kernel), which operations a call loads, the probe's reasons, the CLI's ``info`` /
``build`` and import hygiene.
"""
import json
import logging
import multiprocessing
import os
import re
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from flash_dmattn import BackendUnavailableError, get_available_backends, registry
from flash_dmattn.__main__ import main as cli_main
from flash_dmattn._version import __version__
from flash_dmattn.backends.cuda import backend as cuda_backend
from flash_dmattn.backends.cuda import jit, toolchain
from flash_dmattn.backends.cuda.spec import HEAD_DIM_BUCKETS, KernelSpec, all_specs
from flash_dmattn.backends.cuda.toolchain import Toolchain
from flash_dmattn.inputs import AttentionInputs
from cuda_stand_in import DenseKernelModule
from interpreter_only import needs_triton

TC = Toolchain(nvcc="/opt/cuda/bin/nvcc", nvcc_version="12.4.131", cutlass_include="/opt/inc",
               capability=(9, 0), torch_version="2.6.0")
SPEC = KernelSpec(64, "bf16", has_mask=True, has_bias=True)


def _source(name: str) -> str:
    """A stand-in source: every one includes the shared header, the backward's also its own
    (as csrc/ does: kernel_common.cuh for all, bwd_sm90_config.cuh for the backward)."""
    text = f'// {name}\n#include "kernels/common.h"\n'
    if name in jit.OP_SOURCES["bwd"]:
        text += '#if FLASH_DMATTN_SM90_BWD\n#include "kernels/bwd_only.h"\n#endif\n'
    return text


@pytest.fixture
def csrc(tmp_path):
    d = tmp_path / "csrc"
    (d / "kernels").mkdir(parents=True)
    for name in jit.KERNEL_SOURCES:
        (d / name).write_text(_source(name))
    # Headers found beside the including file, in csrc, or (not followed) elsewhere.
    (d / "kernels" / "common.h").write_text('#include "tile.h"\n#include <cute/tensor.hpp>\n'
                                            '#include "cutlass/cutlass.h"\n')
    (d / "kernels" / "tile.h").write_text("// header\n")
    (d / "kernels" / "bwd_only.h").write_text('#include "kernels/tile.h"\n')
    (d / "kernels" / "unused.h").write_text("// included by nothing\n")
    return d


@pytest.fixture(autouse=True)
def _fresh_jit(monkeypatch):
    jit.clear_loaded()
    yield
    jit.clear_loaded()


# Specs --------------------------------------------------------------------------------------
def test_spec_names_round_trip():
    specs = all_specs()
    assert len(specs) == len(HEAD_DIM_BUCKETS) * 2 * 4 * 2  # x2: dense and packed (varlen)
    assert len({s.name for s in specs}) == len(specs)
    for spec in specs:
        assert KernelSpec.parse(spec.name) == spec
        assert str(spec) == spec.name
    assert SPEC.name == "d64-bf16-mask-bias"
    assert KernelSpec(256, "fp16").name == "d256-fp16"
    assert KernelSpec(64, "bf16", False, True, packed=True).name == "d64-bf16-bias-varlen"
    # Flags in any order and any case parse to the canonical name.
    assert KernelSpec.parse(" D64-BF16-bias-mask ").name == "d64-bf16-mask-bias"


@pytest.mark.parametrize("text", [
    "", "bf16", "128-bf16", "d-bf16", "dx-bf16", "d128", "d80-bf16", "d512-fp16",
    "d128-fp32", "d128-bf16-foo", "d128-bf16-mask-mask", "d128-bf16-causal",
])
def test_bad_spec_strings_rejected(text):
    with pytest.raises(ValueError, match="bad kernel spec"):
        KernelSpec.parse(text)


@pytest.mark.parametrize("args", [(80, "bf16"), (128, "fp32"), (True, "bf16"), ("128", "bf16"),
                                  (128, "bf16", 1), (128, "bf16", False, None)])
def test_bad_spec_fields_rejected(args):
    with pytest.raises(ValueError):
        KernelSpec(*args)


def test_spec_from_inputs():
    q = torch.zeros(1, 4, 2, 80, dtype=torch.float16)
    k = torch.zeros(1, 4, 1, 80, dtype=torch.float16)
    assert KernelSpec.from_inputs(AttentionInputs.from_args(q, k, k)).name == "d96-fp16"
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    bias = torch.zeros(1, 1, 1, 4, dtype=torch.float16)
    inputs = AttentionInputs.from_args(q, k, k, mask, bias, is_causal=True)
    assert KernelSpec.from_inputs(inputs).name == "d96-fp16-mask-bias"
    with pytest.raises(ValueError, match="dtype"):
        KernelSpec.from_inputs(AttentionInputs.from_args(q.float(), k.float(), k.float()))
    from flash_dmattn.inputs import VarlenInputs
    cu = torch.tensor([0, 4], dtype=torch.int32)
    packed = VarlenInputs.from_args(q[0], k[0], k[0], cu, cu, 4, 4, attn_bias=bias[0, 0, 0])
    assert KernelSpec.from_inputs(packed).name == "d96-fp16-bias-varlen"
    big_q, big_k = torch.zeros(1, 2, 1, 300, dtype=torch.bfloat16), torch.zeros(1, 2, 1, 300, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim 300"):
        KernelSpec.from_inputs(AttentionInputs.from_args(big_q, big_k, big_k))


# Cache key and layout -----------------------------------------------------------------------
def test_cache_key_tracks_what_the_binary_depends_on(csrc):
    key = jit.cache_key(SPEC, "fwd", TC, csrc)
    assert key == jit.cache_key(SPEC, "fwd", TC, csrc)  # stable
    assert re.fullmatch(r"[0-9a-f]{64}", key)
    (csrc / "README.md").write_text("not a source")  # not compiled, not hashed
    assert jit.cache_key(SPEC, "fwd", TC, csrc) == key

    changed = {
        "op": jit.cache_key(SPEC, "bwd", TC, csrc),
        "spec": jit.cache_key(KernelSpec(64, "bf16", True), "fwd", TC, csrc),
        "dtype": jit.cache_key(KernelSpec(64, "fp16", True, True), "fwd", TC, csrc),
        "packed": jit.cache_key(KernelSpec(64, "bf16", True, True, True), "fwd", TC, csrc),
        "nvcc": jit.cache_key(SPEC, "fwd", Toolchain(TC.nvcc, "12.6.20", TC.cutlass_include,
                                                     TC.capability, TC.torch_version), csrc),
        "torch": jit.cache_key(SPEC, "fwd", Toolchain(TC.nvcc, TC.nvcc_version,
                                                      TC.cutlass_include, TC.capability,
                                                      "2.7.0"), csrc),
        "arch": jit.cache_key(SPEC, "fwd", Toolchain(TC.nvcc, TC.nvcc_version,
                                                     TC.cutlass_include, (8, 0),
                                                     TC.torch_version), csrc),
    }
    fwd_source = jit.OP_SOURCES["fwd"][1]
    (csrc / fwd_source).write_text("// edited kernel\n")
    changed["source"] = jit.cache_key(SPEC, "fwd", TC, csrc)
    (csrc / fwd_source).write_text(_source(fwd_source))
    assert jit.cache_key(SPEC, "fwd", TC, csrc) == key  # content, not mtime
    (csrc / "kernels" / "tile.h").write_text("// edited header\n")
    changed["header"] = jit.cache_key(SPEC, "fwd", TC, csrc)
    for what, other in changed.items():
        assert other != key, what
    assert len(set(changed.values())) == len(changed)


def test_each_operation_is_keyed_by_its_own_sources_and_headers(csrc):
    def keys():
        return {op: jit.cache_key(SPEC, op, TC, csrc) for op in jit.OPS}

    rel = {op: sorted(p.relative_to(csrc.resolve()).as_posix()
                      for p in jit.hashed_files(csrc, op)) for op in jit.OPS}
    headers = ["kernels/common.h", "kernels/tile.h"]
    assert rel["fwd"] == sorted(list(jit.OP_SOURCES["fwd"]) + headers)
    assert rel["decode"] == sorted(list(jit.OP_SOURCES["decode"]) + headers)
    # An include inside #if counts; CUTLASS's headers (not under csrc) are not followed.
    assert rel["bwd"] == sorted(list(jit.OP_SOURCES["bwd"]) + headers + ["kernels/bwd_only.h"])
    before = keys()
    assert len(set(before.values())) == len(jit.OPS)

    def edit(path, text):
        (csrc / path).write_text(text)
        after = keys()
        return sorted(op for op in jit.OPS if after[op] != before[op])

    assert edit("kernels/unused.h", "// still included by nothing\n") == []
    # Backward code: only the backward's key (forward and decode builds stay valid).
    assert edit(jit.OP_SOURCES["bwd"][-1], _source(jit.OP_SOURCES["bwd"][-1]) + "// dQ\n") == [
        "bwd"]
    before = keys()
    assert edit("kernels/bwd_only.h", '#include "kernels/tile.h"\n// edited\n') == ["bwd"]
    before = keys()
    assert edit("flash_decode.cu", _source("flash_decode.cu") + "// edited\n") == ["decode"]
    before = keys()
    assert edit("flash_fwd_api.cpp", _source("flash_fwd_api.cpp") + "// edited\n") == ["fwd"]
    before = keys()
    # A header every operation includes, through another header: every key.
    assert edit("kernels/tile.h", "// edited shared header\n") == sorted(jit.OPS)


def test_the_real_sources_split_by_operation():
    # csrc/ as shipped: each operation compiles its own binding and kernels, and headers only
    # the backward includes do not key the forward.
    csrc = jit.find_csrc_dir()
    assert csrc is not None
    files = {op: {p.name for p in jit.hashed_files(csrc, op)} for op in jit.OPS}
    assert set(jit.KERNEL_SOURCES) == {s for op in jit.OPS for s in jit.OP_SOURCES[op]}
    assert len(jit.KERNEL_SOURCES) == len(set(jit.KERNEL_SOURCES))  # one operation each
    for op in jit.OPS:
        assert f"flash_{op}_api.cpp" in files[op] and "binding.h" in files[op]
        others = set(jit.KERNEL_SOURCES) - set(jit.OP_SOURCES[op])
        assert not files[op] & others, op
    # The bindings are compiled without the arch's macros (nvcc flags only): they must ask
    # the kernel sources what depends on it.
    assert not any("SM90" in flag for flag in jit.cxx_flags(SPEC))
    for path in [csrc / f"flash_{op}_api.cpp" for op in jit.OPS] + [
            csrc / "flash_dmattn" / "binding.h"]:
        code = [line.split("//")[0] for line in path.read_text().splitlines()]
        assert not any("FLASH_DMATTN_SM90" in line for line in code), path.name
    assert "bwd_sm90_config.cuh" in files["bwd"]
    assert "bwd_sm90_config.cuh" not in files["fwd"] | files["decode"]
    assert {"fwd_sm90_config.cuh", "fwd_sm90_kernel.cuh", "fwd_sm90_launch.h"} <= files["fwd"]
    assert not {"fwd_sm90_config.cuh", "fwd_sm90_kernel.cuh", "fwd_sm90_launch.h"} & (
        files["bwd"] | files["decode"])
    assert "wgmma.cuh" not in files["decode"]


def test_each_sm90_forward_kernel_is_compiled_once():
    # The Hopper forward's dispatcher (flash_fwd_sm90.cu) sees only the launcher's declaration;
    # every launcher it may call -- soft cap x walk (dense, gathered, key intervals) x dropout --
    # is instantiated by exactly one of the forward's sources, under its guard, and by none of
    # the other sources.
    csrc = jit.find_csrc_dir()
    inst = re.compile(r"^template cudaError_t launch_fwd_sm90<(\w+), (\w+), (\w+), (\w+)>\(",
                      re.MULTILINE)
    found = {}
    for name in jit.KERNEL_SOURCES:
        for args in inst.findall((csrc / name).read_text()):
            assert name in jit.OP_SOURCES["fwd"], name
            found.setdefault(tuple(a == "true" for a in args), []).append(name)
    walks = [(False, False), (True, False), (True, True)]
    assert sorted(found) == sorted((s, g, i, d) for s in (False, True) for g, i in walks
                                   for d in (False, True))
    for (softcap, gather, intervals, dropout), names in found.items():
        walk = "intervals" if intervals else "gather" if gather else "dense"
        assert names == [f"flash_fwd_sm90_{walk}{'_dropout' if dropout else ''}"
                         f"{'_softcap' if softcap else ''}.cu"]
        text = (csrc / names[0]).read_text()
        guard = re.search(r"^#if (.+)$", text, re.MULTILINE).group(1)
        assert ("FLASH_DMATTN_FWD_GATHER" in guard) == gather, names
        assert ("FLASH_DMATTN_DROPOUT" in guard) == dropout, names
        # One kernel a unit: the slowest unit sets the forward's build time.
        assert len(inst.findall(text)) == 1, names
    # Every unit of the forward with sm90 kernels is one of these.
    assert sorted(n for names in found.values() for n in names) == sorted(
        s for s in jit.OP_SOURCES["fwd"] if s.startswith("flash_fwd_sm90_"))
    # The dispatcher and flash_fwd.cu (on sm_90a) see the kernel's CuTe-free shape and
    # launcher declaration only.
    included = jit._INCLUDE.findall((csrc / "flash_fwd_sm90.cu").read_text())
    assert "flash_dmattn/fwd_sm90_launch.h" in included
    assert not {"flash_dmattn/fwd_sm90_config.cuh", "flash_dmattn/fwd_sm90_kernel.cuh",
                "flash_dmattn/kernel_common.cuh"} & set(included)
    launch_h = jit._INCLUDE.findall((csrc / "flash_dmattn" / "fwd_sm90_launch.h").read_text())
    assert set(launch_h) == {"params.h", "spec.h"}
    spec_h = jit._INCLUDE.findall((csrc / "flash_dmattn" / "spec.h").read_text())
    assert spec_h == ["params.h"] and "<cute" not in (csrc / "flash_dmattn" / "spec.h").read_text()
    # The kernel units' host pass: the launcher and the launch stub, without the kernel's
    # configuration (CuTe) unless FLASH_DMATTN_FWD_HOST_CUTE asks for it.
    kernel_h = (csrc / "flash_dmattn" / "fwd_sm90_kernel.cuh").read_text()
    device_only = kernel_h[kernel_h.index(
        "#if defined(__CUDA_ARCH__) || FLASH_DMATTN_FWD_HOST_CUTE\n"):kernel_h.index("#else")]
    assert "fwd_sm90_config.cuh" in device_only and "wgmma.cuh" in device_only
    assert jit._INCLUDE.findall(kernel_h)[0] == "fwd_sm90_launch.h"
    fwd_cu = (csrc / "flash_fwd.cu").read_text()
    sm90_part = fwd_cu[fwd_cu.index("#if FLASH_DMATTN_SM90"):fwd_cu.index("#else")]
    assert jit._INCLUDE.findall(sm90_part) == ["flash_dmattn/spec.h"]


def test_unknown_operation_rejected(csrc):
    with pytest.raises(ValueError, match="unknown kernel operation 'both'; operations are "
                                         "fwd, bwd, decode"):
        jit.cache_key(SPEC, "both", TC, csrc)


def test_cache_key_needs_the_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="kernel sources missing"):
        jit.cache_key(SPEC, "fwd", TC, tmp_path)


def test_cache_dir_layout_and_override(monkeypatch, tmp_path, csrc):
    monkeypatch.delenv("FLASH_DMATTN_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert jit.cache_root() == tmp_path / "home" / ".cache" / "flash_dmattn"
    monkeypatch.setenv("FLASH_DMATTN_CACHE_DIR", str(tmp_path / "mine"))
    assert jit.cache_root() == tmp_path / "mine"
    key = jit.cache_key(SPEC, "bwd", TC, csrc)
    entry = jit.entry_dir(SPEC, "bwd", TC, key)
    assert entry == (tmp_path / "mine" / __version__ / "sm_90"
                     / f"d64-bf16-mask-bias-bwd-{key[:16]}")
    assert jit.module_name(SPEC, "bwd", key).isidentifier()
    assert jit.module_name(SPEC, "bwd", key) != jit.module_name(SPEC, "fwd", key)


def test_build_flags():
    flags = jit.cuda_flags(SPEC, TC)
    for f in ("-O3", "-std=c++17", "--use_fast_math", "-DFLASH_DMATTN_HEADDIM=64",
              "-DFLASH_DMATTN_IS_BF16=1", "-DFLASH_DMATTN_HAS_MASK=1", "-DFLASH_DMATTN_HAS_BIAS=1"):
        assert f in flags
    i = flags.index("-gencode")
    assert flags[i + 1] == "arch=compute_90a,code=sm_90a" and "-DFLASH_DMATTN_SM90=1" in flags


# Build on first use (fake builder) ------------------------------------------------------------
def fake_builder(req, calls=None, sleep=0.0, record=None):
    """Stands in for nvcc: writes the artifact, returns a 'module'."""
    start = time.time()
    if calls is not None:
        calls.append(req)
    time.sleep(sleep)
    req.artifact.write_text(json.dumps({"built_by": os.getpid()}))
    if record is not None:
        with open(record, "a") as fh:
            fh.write(f"build {os.getpid()} {start} {time.time()}\n")
    return {"module": req.name, "fresh": True}


def fake_loader(name, path, record=None):
    if record is not None:
        with open(record, "a") as fh:
            fh.write(f"load {os.getpid()} {time.time()}\n")
    return {"module": name, "fresh": False, **json.loads(Path(path).read_text())}


def test_first_use_builds_once_then_loads(tmp_path, csrc, caplog):
    calls = []
    builder = partial(fake_builder, calls=calls)
    kw = dict(csrc_dir=csrc, cache_dir=tmp_path / "cache", builder=builder, loader=fake_loader)
    with caplog.at_level(logging.INFO, logger="flash_dmattn"):
        mod = jit.load_kernel(SPEC, "fwd", TC, **kw)
    assert mod["fresh"] and len(calls) == 1
    req = calls[0]
    key = jit.cache_key(SPEC, "fwd", TC, csrc)
    entry = jit.entry_dir(SPEC, "fwd", TC, key, tmp_path / "cache")
    assert req.build_dir == entry and req.artifact.parent == entry
    # The forward's binding and kernels only.
    assert req.sources == [str(csrc / s) for s in jit.OP_SOURCES["fwd"]]
    assert req.sources == [str(csrc / s) for s in (
        "flash_fwd_api.cpp", "flash_fwd.cu", "flash_fwd_sm90.cu",
        "flash_fwd_sm90_dense.cu", "flash_fwd_sm90_dense_softcap.cu",
        "flash_fwd_sm90_dense_dropout.cu", "flash_fwd_sm90_dense_dropout_softcap.cu",
        "flash_fwd_sm90_gather.cu", "flash_fwd_sm90_gather_softcap.cu",
        "flash_fwd_sm90_gather_dropout.cu", "flash_fwd_sm90_gather_dropout_softcap.cu",
        "flash_fwd_sm90_intervals.cu", "flash_fwd_sm90_intervals_softcap.cu",
        "flash_fwd_sm90_intervals_dropout.cu", "flash_fwd_sm90_intervals_dropout_softcap.cu")]
    assert TC.cutlass_include in req.extra_include_paths
    lines = [r.getMessage() for r in caplog.records if "compiling" in r.getMessage()]
    assert lines == [f"flash_dmattn: compiling cuda kernel d64-bf16-mask-bias fwd for sm_90 "
                     f"(first use, cached in {entry})"]
    manifest = json.loads((entry / jit.MANIFEST).read_text())
    assert manifest["key"] == key and manifest["spec"] == SPEC.name and manifest["op"] == "fwd"
    assert manifest["arch"] == "sm_90" and manifest["nvcc_version"] == "12.4.131"
    assert jit.is_built(SPEC, "fwd", TC, csrc, tmp_path / "cache")
    assert not jit.is_built(SPEC, "bwd", TC, csrc, tmp_path / "cache")

    assert jit.load_kernel(SPEC, "fwd", TC, **kw) is mod  # in-process cache
    jit.clear_loaded()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flash_dmattn"):
        again = jit.load_kernel(SPEC, "fwd", TC, **kw)  # from disk, as a new process would
    assert again["fresh"] is False and len(calls) == 1
    assert not [r for r in caplog.records if "compiling" in r.getMessage()]
    # The backward is a module of its own: its own build, sources and entry.
    jit.load_kernel(SPEC, "bwd", TC, **kw)
    assert len(calls) == 2
    assert calls[1].sources == [str(csrc / s) for s in jit.OP_SOURCES["bwd"]]
    assert calls[1].build_dir != entry and calls[1].name != req.name
    listed = jit.cached_entries(tmp_path / "cache")
    assert [(m["spec"], m["op"], m["arch"]) for m in listed] == [
        (SPEC.name, "fwd", "sm_90"), (SPEC.name, "bwd", "sm_90")]
    assert listed[0]["path"] == str(entry)


def test_operations_build_side_by_side(tmp_path, csrc):
    # load_kernels (a training step's forward asks for its backward too) builds the missing
    # operations at once, each in its own entry; loaded ones come from the process cache.
    record = tmp_path / "record"
    kw = dict(csrc_dir=csrc, cache_dir=tmp_path / "cache", loader=fake_loader,
              builder=partial(fake_builder, sleep=0.5, record=record))
    mods = jit.load_kernels(SPEC, ("fwd", "bwd"), TC, **kw)
    assert sorted(mods) == ["bwd", "fwd"] and all(m["fresh"] for m in mods.values())
    spans = [tuple(map(float, line.split()[2:])) for line in record.read_text().splitlines()]
    assert len(spans) == 2 and max(s for s, _ in spans) < min(e for _, e in spans)  # overlap
    again = jit.load_kernels(SPEC, ("fwd", "bwd", "decode"), TC, **kw)
    assert again["fwd"] is mods["fwd"] and again["bwd"] is mods["bwd"]
    assert len(record.read_text().splitlines()) == 3  # only decode was built


def test_failed_or_stale_builds_are_redone(tmp_path, csrc):
    kw = dict(csrc_dir=csrc, cache_dir=tmp_path / "cache", loader=fake_loader)

    def broken(req):
        raise RuntimeError("nvcc error")

    with pytest.raises(RuntimeError, match="nvcc error"):
        jit.load_kernel(SPEC, "fwd", TC, builder=broken, **kw)
    with pytest.raises(RuntimeError, match="produced no"):
        jit.load_kernel(SPEC, "fwd", TC, builder=lambda req: object(), **kw)
    assert not jit.is_built(SPEC, "fwd", TC, csrc, tmp_path / "cache")
    calls = []
    jit.load_kernel(SPEC, "fwd", TC, builder=partial(fake_builder, calls=calls), **kw)
    assert len(calls) == 1 and jit.is_built(SPEC, "fwd", TC, csrc, tmp_path / "cache")
    # A manifest for another key (or with its artifact gone) does not count as built.
    entry = calls[0].build_dir
    calls[0].artifact.unlink()
    assert not jit.is_built(SPEC, "fwd", TC, csrc, tmp_path / "cache")
    jit.clear_loaded()
    jit.load_kernel(SPEC, "fwd", TC, builder=partial(fake_builder, calls=calls), **kw)
    assert len(calls) == 2
    manifest = json.loads((entry / jit.MANIFEST).read_text())
    (entry / jit.MANIFEST).write_text(json.dumps(dict(manifest, key="0" * 64)))
    jit.clear_loaded()
    jit.load_kernel(SPEC, "fwd", TC, builder=partial(fake_builder, calls=calls), **kw)
    assert len(calls) == 3


def _build_worker(root, csrc_dir, record, barrier, results):
    barrier.wait()
    mod = jit.load_kernel(
        SPEC, "fwd", TC, csrc_dir=csrc_dir, cache_dir=root,
        builder=partial(fake_builder, sleep=1.0, record=record),
        loader=partial(fake_loader, record=record),
    )
    results.put((os.getpid(), mod["fresh"], mod.get("built_by"), time.time()))


def _lock_worker(path, record, barrier):
    barrier.wait()
    with jit.file_lock(Path(path)):
        start = time.time()
        time.sleep(0.3)
        with open(record, "a") as fh:
            fh.write(f"{start} {time.time()}\n")


fork_only = pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods() or os.name == "nt",
    reason="needs fork (and fcntl)",
)


@fork_only
def test_file_lock_serialises_processes(tmp_path):
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(3)
    record = tmp_path / "record"
    procs = [ctx.Process(target=_lock_worker, args=(tmp_path / "x" / jit.LOCK_FILE, record, barrier))
             for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    spans = sorted(tuple(map(float, line.split())) for line in record.read_text().splitlines())
    assert len(spans) == 3
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert start >= end  # no two holders at once


@fork_only
def test_second_process_reuses_the_first_build(tmp_path, csrc):
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    record = tmp_path / "record"
    procs = [ctx.Process(target=_build_worker, args=(tmp_path / "cache", csrc, record, barrier, results))
             for _ in range(2)]
    for p in procs:
        p.start()
    got = [results.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    events = [line.split() for line in record.read_text().splitlines()]
    builds = [e for e in events if e[0] == "build"]
    loads = [e for e in events if e[0] == "load"]
    assert len(builds) == 1, events  # compiled exactly once across both processes
    assert len(loads) == 1 and loads[0][1] != builds[0][1]
    assert float(loads[0][2]) >= float(builds[0][3])  # waited for the build, then loaded it
    fresh = {pid: f for pid, f, _, _ in got}
    assert sorted(fresh.values()) == [False, True]
    loaded = next(g for g in got if not g[1])
    assert loaded[2] == int(builds[0][1])  # the artifact the builder wrote


# Probe reasons ------------------------------------------------------------------------------
@pytest.fixture
def full_toolchain(monkeypatch):
    """Pretend everything is present; tests then take one piece away."""
    monkeypatch.setattr(toolchain, "device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(toolchain, "device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(toolchain, "find_nvcc", lambda: "/opt/cuda/bin/nvcc")
    monkeypatch.setattr(toolchain, "nvcc_version", lambda nvcc: "12.4.131")
    monkeypatch.setattr(toolchain, "find_ninja", lambda: "/usr/bin/ninja")
    monkeypatch.setattr(toolchain, "find_cutlass_include", lambda: "/opt/inc")
    monkeypatch.setattr(jit, "missing_kernel_sources", lambda: [])
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    return monkeypatch


def test_probe_on_this_machine():
    reason = cuda_backend.CudaBackend().probe()
    if not torch.cuda.is_available():
        assert reason is not None and "no CUDA device" in reason
    # The kernel sources ship with the package: only the machine can be missing something
    # (on a GPU machine with nvcc, ninja and the CUTLASS headers, nothing: reason is None).
    assert jit.missing_kernel_sources() == []
    assert reason is None or "kernel sources" not in reason


def test_probe_reasons_one_at_a_time(full_toolchain):
    mp = full_toolchain
    assert cuda_backend.CudaBackend().probe() is None  # not hard-wired to fail

    def reason_with(obj, attr, value):
        with mp.context() as m:
            m.setattr(obj, attr, value)
            return cuda_backend.CudaBackend().probe()

    assert reason_with(toolchain, "device_capability", lambda device=None: None) == "no CUDA device"
    assert reason_with(toolchain, "device_capability", lambda device=None: (7, 5)) == (
        "GPU Fake GPU is sm_75; needs compute capability >= 8.0")
    assert reason_with(toolchain, "find_nvcc", lambda: None) == (
        "nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    assert "does not match the CUDA 12.4" in reason_with(toolchain, "nvcc_version",
                                                         lambda nvcc: "13.0.88")
    assert "ninja not found" in reason_with(toolchain, "find_ninja", lambda: None)
    assert "CUTLASS/CuTe headers not found" in reason_with(toolchain, "find_cutlass_include",
                                                           lambda: None)
    assert "kernel sources not present yet" in reason_with(
        jit, "missing_kernel_sources", lambda: ["/x/csrc/flash_fwd.cu"])


def test_toolchain_detect_errors(full_toolchain):
    tc = toolchain.detect()
    assert tc.arch == "sm_90" and tc.gencode_flags() == [
        "-gencode", "arch=compute_90a,code=sm_90a", "-DFLASH_DMATTN_SM90=1"]
    assert toolchain.gencode_flags((8, 0)) == ["-gencode", "arch=compute_80,code=sm_80"]
    full_toolchain.setattr(toolchain, "find_cutlass_include", lambda: None)
    with pytest.raises(toolchain.ToolchainError, match="CUTLASS"):
        toolchain.detect()
    full_toolchain.setattr(toolchain, "device_capability", lambda device=None: None)
    with pytest.raises(toolchain.ToolchainError, match="no CUDA device"):
        toolchain.detect()


def test_nvcc_discovery_honours_cuda_home(monkeypatch, tmp_path):
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    toolchain.clear_caches()
    try:
        assert toolchain.find_nvcc() == str(nvcc)
        if os.name != "nt":
            assert toolchain.nvcc_version(str(nvcc)) == "12.4.131"
    finally:
        toolchain.clear_caches()


def test_cuda_never_selected_while_unavailable():
    if cuda_backend.CudaBackend().probe() is None:
        pytest.skip("the cuda backend is available on this machine (this checks one without)")
    assert "cuda" not in get_available_backends()
    with pytest.raises(BackendUnavailableError, match="'cuda' is unavailable: "):
        registry.get_backend("cuda")
    q = torch.randn(1, 4, 2, 16)
    inputs = AttentionInputs.from_args(q, q[:, :, :1], q[:, :, :1])
    assert registry.select_backend(inputs).name != "cuda"
    reasons = cuda_backend.CudaBackend().not_supported_reasons(inputs)
    assert any("needs CUDA" in r for r in reasons) and any("dtype" in r for r in reasons)


# CLI and import hygiene --------------------------------------------------------------------
def _run(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "flash_dmattn", *args], capture_output=True,
                          text=True, timeout=300, env=env)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-machine messages")
def test_cli_info_and_build_all_without_cuda():
    res = _run("info")
    assert res.returncode == 0, res.stderr
    row = next(line for line in res.stdout.splitlines() if line.startswith("cuda "))
    assert " no " in row and "no CUDA device" in row and "kernel sources" not in row
    assert registry.NOT_BUILT not in row
    res = _run("build", "--all")
    assert res.returncode == 2
    assert "cuda backend is unavailable here: no CUDA device" in res.stderr
    assert "Traceback" not in res.stderr + res.stdout


def test_cli_build_list_and_bad_specs(capsys):
    assert cli_main(["build", "--list"]) == 0
    listed = capsys.readouterr().out.split()
    assert listed == [s.name for s in all_specs()]
    assert cli_main(["build", "--list", "d128-bf16-bias-mask"]) == 0
    assert capsys.readouterr().out.split() == ["d128-bf16-mask-bias"]
    assert cli_main(["build", "d80-bf16"]) == 2
    assert "not a kernel bucket" in capsys.readouterr().err
    assert cli_main(["build", "--all", "d64-fp16"]) == 2
    assert cli_main(["build"]) == 2


def test_cli_build_selects_operations(capsys):
    assert cli_main(["build", "--list", "d128-bf16-mask-bias:fwd", "d64-fp16:bwd,decode",
                     "d32-bf16"]) == 0
    assert capsys.readouterr().out.split() == ["d128-bf16-mask-bias:fwd", "d64-fp16:bwd,decode",
                                               "d32-bf16"]
    assert cli_main(["build", "--list", "--op", "fwd", "d32-bf16", "d64-fp16:decode"]) == 0
    assert capsys.readouterr().out.split() == ["d32-bf16:fwd", "d64-fp16:decode"]
    assert cli_main(["build", "--list", "--all", "--op", "fwd"]) == 0
    assert capsys.readouterr().out.split() == [f"{s.name}:fwd" for s in all_specs()]
    assert cli_main(["build", "--list", "d64-fp16:both"]) == 2
    assert "unknown kernel operation 'both'" in capsys.readouterr().err
    from flash_dmattn.__main__ import build_targets

    spec = KernelSpec.parse("d64-fp16")
    # Operations in their order, each once, however they are named.
    assert build_targets(["d64-fp16:decode,fwd", "d64-fp16:fwd"]) == [(spec, "fwd"),
                                                                       (spec, "decode")]


def test_cli_build_builds_each_selected_module(monkeypatch, capsys, full_toolchain):
    # With the backend available (pretended), build loads one module per (spec, operation)
    # selected, side by side, and says which were built and which were there already.
    monkeypatch.setattr(registry._BACKENDS["cuda"], "unavailable_reason", lambda: None)
    asked = []
    monkeypatch.setattr(jit, "is_built", lambda spec, op, tc: op == "bwd")
    monkeypatch.setattr(jit, "load_kernel", lambda spec, op, tc: asked.append((spec.name, op)))
    assert cli_main(["build", "d128-bf16-mask-bias"]) == 0
    out = capsys.readouterr().out
    assert sorted(asked) == sorted(("d128-bf16-mask-bias", op) for op in jit.OPS)
    assert "d128-bf16-mask-bias fwd: built in" in out
    assert "d128-bf16-mask-bias bwd: already built" in out
    assert "3/3 kernel modules ready for sm_90" in out
    asked.clear()
    assert cli_main(["build", "d128-bf16-mask-bias:fwd", "d64-fp16", "--op", "decode"]) == 0
    assert sorted(asked) == [("d128-bf16-mask-bias", "fwd"), ("d64-fp16", "decode")]
    capsys.readouterr()

    def broken(spec, op, tc):
        if op == "bwd":
            raise RuntimeError("nvcc error")

    monkeypatch.setattr(jit, "load_kernel", broken)
    assert cli_main(["build", "d64-fp16"]) == 1
    captured = capsys.readouterr()
    assert "d64-fp16 bwd: FAILED: RuntimeError: nvcc error" in captured.err
    assert "2/3 kernel modules ready" in captured.out


class _OpModule(DenseKernelModule):
    """A stand-in for one operation's compiled module: zero outputs of the right shapes."""

    def __init__(self, op):
        self.op = op

    def decode_sizes(self):
        return 64, 64

    def fwd(self, q, *rest):
        return torch.zeros_like(q), q.new_zeros(q.shape[0], q.shape[2], q.shape[1],
                                                dtype=torch.float32)

    decode = fwd

    def bwd(self, dout, q, k, v, *rest):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None


@pytest.fixture
def asked_ops(monkeypatch):
    """The (spec, op) modules the cuda host code asks the JIT for (none is built)."""
    asked = []

    def load(spec, op, tc=None, **kwargs):
        asked.append((spec.name, op))
        return _OpModule(op)

    monkeypatch.setattr(toolchain, "detect", lambda device=None: TC)
    monkeypatch.setattr(jit, "load_kernel", load)
    return asked


def test_a_forward_only_call_loads_only_the_forward(asked_ops):
    from flash_dmattn.backends.cuda import kernels

    q = torch.randn(1, 256, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 256, 2, 64, dtype=torch.bfloat16)
    out, _ = kernels.cuda_forward(q, k, k, None, None, 0.125, True, 0.0)
    assert out.shape == q.shape and asked_ops == [("d64-bf16", "fwd")]
    asked_ops.clear()
    # Decode shapes (one query row per kv head, a long cache): the decode module only.
    kernels.cuda_forward(q[:, :1], k, k, None, None, 0.125, False, 0.0)
    assert asked_ops == [("d64-bf16", "decode")]
    asked_ops.clear()
    # Packed sequences: the forward of the -varlen spec.
    cu = torch.tensor([0, 100, 256], dtype=torch.int32)
    kernels.cuda_varlen_forward(q[0], k[0], k[0], cu, cu, 156, 156, None, None, 0.125, True, 0.0)
    assert asked_ops == [("d64-bf16-varlen", "fwd")]


def test_a_training_step_loads_forward_and_backward(asked_ops):
    # The forward of a training step asks for its backward's module too (its tiles serve the
    # mask summary; both build side by side); the backward then asks for its own.
    from flash_dmattn.backends.cuda import kernels

    q = torch.randn(1, 256, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 256, 2, 64, dtype=torch.bfloat16)
    out, lse, plan = kernels.cuda_planned_forward(q, k, k, None, None, 0.125, True, 0.0)
    assert sorted(asked_ops) == [("d64-bf16", "bwd"), ("d64-bf16", "fwd")]
    asked_ops.clear()
    kernels.cuda_backward(torch.ones_like(out), q, k, k, None, None, out, lse, 0.125, True, 0.0,
                          False, (True, True, True, False), plan=plan)
    assert asked_ops == [("d64-bf16", "bwd")]


def test_a_call_looks_its_module_up_once(asked_ops, monkeypatch):
    # Later calls with the same attributes take the memo (no spec, toolchain or loader key);
    # another head dim, operation, mask/bias flag or build variable asks again, and so does
    # every call after clear_loaded().
    from flash_dmattn.backends.cuda.extension import kernel_module

    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    monkeypatch.delenv("FLASH_DMATTN_CUDA_FLAGS", raising=False)
    first = kernel_module(q, True, True, op="fwd")
    assert kernel_module(q, True, True, op="fwd") is first
    assert asked_ops == [("d64-bf16-mask-bias", "fwd")]
    kernel_module(q, True, True, op="bwd")
    kernel_module(q, True, False, op="fwd")
    kernel_module(torch.randn(1, 8, 2, 128, dtype=torch.bfloat16), True, True, op="fwd")
    monkeypatch.setenv("FLASH_DMATTN_CUDA_FLAGS", "-DSOME_SWITCH=1")
    kernel_module(q, True, True, op="fwd")
    assert asked_ops[1:] == [("d64-bf16-mask-bias", "bwd"), ("d64-bf16-mask", "fwd"),
                             ("d128-bf16-mask-bias", "fwd"), ("d64-bf16-mask-bias", "fwd")]
    jit.clear_loaded()
    kernel_module(q, True, True, op="fwd")
    assert len(asked_ops) == 6


def test_import_touches_neither_cuda_nor_nvcc():
    code = r"""
import subprocess, sys, torch
def boom(*a, **k):
    raise SystemExit("touched: " + repr(a[:1]))
for name in ("is_available", "device_count", "get_device_capability", "get_device_name", "init",
             "_lazy_init", "current_device"):
    setattr(torch.cuda, name, boom)
subprocess.Popen = boom
subprocess.run = boom
import flash_dmattn
import flash_dmattn.backends.cuda.backend, flash_dmattn.backends.cuda.jit
import flash_dmattn.backends.cuda.toolchain, flash_dmattn.backends.cuda.spec
assert "torch.utils.cpp_extension" not in sys.modules
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr


@pytest.mark.gpu
def test_toolchain_discovery_on_a_gpu():
    cap = toolchain.device_capability()
    assert cap == torch.cuda.get_device_capability()
    assert toolchain.arch_name(cap) == f"sm_{cap[0]}{cap[1]}"
    assert not any("no CUDA device" in r for r in cuda_backend.unavailable_reasons())
    nvcc = toolchain.find_nvcc()
    if nvcc is None:
        pytest.skip("no nvcc on this CUDA machine (the probe reports it)")
    assert re.fullmatch(r"\d+\.\d+(\.\d+)*", toolchain.nvcc_version(nvcc) or "")


def test_packed_mask_bias_copies_start_each_sequence_aligned():
    # The cuda varlen path copies per-key masks / biases so that every sequence starts on a
    # 16-element boundary (tiles then load as 16-byte vectors); keys past cu_seqlens[-1] drop.
    from flash_dmattn.backends.cuda.kernels import AUX_ALIGN, _aligned_aux

    cu = torch.tensor([0, 5, 5, 38, 39], dtype=torch.int32)
    total_k = 42  # 3 keys past the last sequence
    mask = torch.rand(2, total_k) > 0.5
    bias = torch.randn(1, total_k, dtype=torch.bfloat16)
    mask_a, bias_a, cu_aux = _aligned_aux(mask, bias, cu)
    assert cu_aux.dtype == torch.int32 and cu_aux.tolist() == [0, 16, 16, 64, 80]
    assert mask_a.shape[:3] == (1, 2, 1) and bias_a.shape[:3] == (1, 1, 1)
    assert mask_a.stride(1) % AUX_ALIGN == 0 and bias_a.stride(1) % AUX_ALIGN == 0
    for b in range(4):
        s, e, a = int(cu[b]), int(cu[b + 1]), int(cu_aux[b])
        assert torch.equal(mask_a[0, :, 0, a:a + e - s], mask[:, s:e])
        assert torch.equal(bias_a[0, :, 0, a:a + e - s], bias[:, s:e])
    assert int(mask_a[0, :, 0, :80].sum()) == int(mask[:, :39].sum())  # padding is False
    assert _aligned_aux(None, None, cu) == (None, None, None)


@needs_triton  # the gather policy's test hook lives in the planner, beside its Triton kernels
def test_cuda_gather_plan_declines_what_the_kernels_cannot_take(monkeypatch):
    # The gathered forward needs a module that has it (sm_90, a mask, dense batches) and a
    # bias, if any, per key (it is gathered with the keys); otherwise tile lists are used.
    from flash_dmattn.backends.cuda import kernels

    class Module:
        def __init__(self, gathers):
            self.gathers = gathers

        def fwd_gathers(self):
            return self.gathers

    mask = torch.rand(1, 2, 256, 512) > 0.5
    rest = (256, 512, 4, True, 128, 128, None)
    monkeypatch.setattr("flash_dmattn.planning.gather._FORCED_POLICY", "always")
    assert kernels._gather_plan(Module(False), mask, None, *rest) is None
    assert kernels._gather_plan(Module(True), None, None, *rest) is None
    assert kernels._gather_plan(Module(True), mask, torch.randn(1, 2, 256, 512), *rest) is None
    assert kernels._gather_plan(Module(True), mask, torch.randn(1, 2, 256, 1), *rest) is None
    monkeypatch.setattr("flash_dmattn.planning.gather._FORCED_POLICY", "never")
    assert kernels._gather_plan(Module(True), mask, torch.randn(1, 2, 1, 512), *rest) is None


def test_cuda_auto_dispatch_takes_measured_calls_on_hopper(monkeypatch):
    # Measured fastest on Hopper (flash_dmattn/policy.py, benchmarks/results/POLICY.md):
    # forward-only calls (T1-T3), training without a bias (the dense suite, T3's per-key
    # mask), with a per-query mask (T2) and with a per-key bias (issue 33's per-key mask +
    # bias case); triton keeps decode calls, and other GPU generations pass cuda over.
    from flash_dmattn import policy
    from flash_dmattn.backends.cuda import kernels

    backend = cuda_backend.CudaBackend()
    capability = {"cc": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["cc"])
    monkeypatch.setattr(AttentionInputs, "device", property(lambda self: torch.device("cuda")))

    def inputs_for(Lq, Lk, grad=False, mask=False, bias=False, **kw):
        q = torch.randn(1, Lq, 8, 16, requires_grad=grad)
        k = torch.randn(1, Lk, 2, 16)
        m = torch.ones(1, 2, Lq, Lk, dtype=torch.bool) if mask else None
        b = torch.zeros(1, 2, 1, Lk) if bias else None
        return AttentionInputs.from_args(q, k, k, m, b, None, False, **kw)

    def first(inputs):
        return policy.rank(inputs).prefer[0]

    prefill = inputs_for(512, 512)
    assert not kernels.use_cuda_decode(512, 8, 2, 512, False)
    assert first(prefill) == "cuda" and backend.auto_skip_reasons(prefill) == []
    assert first(inputs_for(512, 512, grad=True)) == "cuda"  # mask-free training
    assert first(inputs_for(512, 512, mask=True)) == "cuda"  # masked inference
    # A per-query mask (the dynamic-mask workload), without a bias or with a per-key one.
    assert first(inputs_for(512, 512, grad=True, mask=True)) == "cuda"
    assert first(inputs_for(512, 512, grad=True, mask=True, bias=True)) == "cuda"
    per_key_mask = AttentionInputs.from_args(
        torch.randn(1, 512, 8, 16, requires_grad=True), torch.randn(1, 512, 2, 16),
        torch.randn(1, 512, 2, 16), torch.ones(1, 2, 1, 512, dtype=torch.bool), None, None, False)
    assert first(per_key_mask) == "cuda"  # block-sparse training (T3)
    per_key_mask_bias = AttentionInputs.from_args(
        torch.randn(1, 512, 8, 16, requires_grad=True), torch.randn(1, 512, 2, 16),
        torch.randn(1, 512, 2, 16), torch.ones(1, 2, 1, 512, dtype=torch.bool),
        torch.zeros(1, 2, 1, 512, requires_grad=True), None, False)
    assert first(per_key_mask_bias) == "cuda"  # issue 33's case, cuda measured 1.7x triton
    assert first(inputs_for(512, 512, grad=True, bias=True)) == "cuda"
    per_query_bias = AttentionInputs.from_args(
        torch.randn(1, 512, 8, 16, requires_grad=True), torch.randn(1, 512, 2, 16),
        torch.randn(1, 512, 2, 16), None, torch.zeros(1, 2, 512, 512, requires_grad=True),
        None, False)
    assert policy.rank(per_query_bias).order == ("flex", "triton", "cuda", "torch-reference")
    decode = inputs_for(1, 4096, bias=True)
    assert first(decode) == "triton"  # the decode kernel
    assert policy.rank(decode).order[1] == "cuda"
    # A plain step over little K/V: one SDPA call (rule gpu-plain-decode).
    assert first(inputs_for(1, 4096)) == "torch-reference"
    capability["cc"] = (8, 0)
    assert "cuda" not in policy.rank(prefill).prefer
    assert "sm_90" in backend.auto_skip_reasons(prefill)[0]
    monkeypatch.setenv("FLASH_DMATTN_CUDA_AUTO", "1")
    assert backend.auto_skip_reasons(prefill) == [] and first(prefill) == "cuda"


@pytest.mark.parametrize("causal,lq,lk", [(True, 300, 700), (True, 700, 300), (False, 129, 65)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_key_list_gather_lists_each_tiles_visible_live_keys(causal, lq, lk, with_bias):
    # The gathered dQ kernel's lists for a per-key mask, against a per-tile brute force: the
    # row is the live keys in order, the count is how many of them the tile's last row sees
    # (bottom-right causal), and the gathered bias holds the bias of each listed key.
    from flash_dmattn.backends.cuda.kernels import key_list_gather

    g = torch.Generator().manual_seed(lq + lk)
    B, H, Hm, Hb, bm = 2, 6, 2, 3, 128
    mask = torch.rand(B, Hm, 1, lk, generator=g) > 0.6
    mask[1, 0] = False  # a row with no live key
    bias = torch.randn(1, Hb, 1, lk, generator=g) if with_bias else None
    lists = key_list_gather(mask, bias, lq, lk, H, causal, bm)
    n_q = -(-lq // bm)
    assert lists.idx.shape[:3] == (B, Hm, n_q) and lists.idx.shape[3] % 64 == 0
    # The kernel copies 4 indices (16 bytes) at a time from every row.
    assert all(s % 4 == 0 for s in lists.idx.stride()[:3]) and lists.idx.stride(3) == 1
    assert lists.head_div == H // Hm
    for b in range(B):
        for hm in range(Hm):
            live = torch.nonzero(mask[b, hm, 0]).flatten()
            for t in range(n_q):
                last = min(lq, (t + 1) * bm) - 1
                limit = last + lk - lq + 1 if causal else lk
                n = int((live < limit).sum())
                assert int(lists.cnt[b, hm, t]) == n
                assert lists.idx[b, hm, t, :n].tolist() == live[:n].tolist()
    if with_bias:
        for b in range(B):
            for h in range(H):
                live = torch.nonzero(mask[b, h // (H // Hm), 0]).flatten()
                got = lists.gbias[b, h // (H // lists.gbias.size(1)), 0, :live.numel()]
                assert torch.equal(got, bias[0, h // (H // Hb), 0, live])
    assert key_list_gather(mask.expand(B, Hm, lq, lk), None, lq, lk, H, causal, bm) is None
    assert key_list_gather(mask, torch.randn(1, 1, lq, lk), lq, lk, H, causal, bm) is None
