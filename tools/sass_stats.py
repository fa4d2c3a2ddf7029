"""Registers, spills and SASS instruction counts of the cuda kernels, compiled for sm_90a on a
machine without a GPU (nvcc and the CUTLASS headers), optionally beside an older commit's.

    python tools/sass_stats.py TU SPEC [--base REV] [--flags "-DX=1"] [--ops] [--keep DIR]

``TU`` is a translation unit under ``csrc/`` (e.g. ``flash_fwd_sm90_dense_dropout.cu``),
``SPEC`` a kernel specialisation (e.g. ``d128-bf16``). The TU compiles with the JIT's own flags
(``backends.cuda.jit.cuda_flags`` for sm_90a, ``$FLASH_DMATTN_CUDA_FLAGS`` included) plus
``-Xptxas -v``; each kernel gets one line: registers, spill stores, SASS instructions. ``--base
REV`` compiles commit REV's ``csrc/`` beside this checkout's (a kernel change's before/after
without device time: e.g. that a default-off switch leaves the default kernels' SASS as it was,
or how many instructions a change saves); ``--flags`` adds nvcc flags to this checkout's build
only; ``--ops`` lists the opcodes whose counts differ; ``--keep DIR`` keeps the objects and
SASS listings.

What it cannot tell is speed: fewer instructions can still run slower (scheduling, register
pressure); a change is kept on a GPU measurement.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]


def parse_ptxas(text: str) -> Dict[str, Dict[str, int]]:
    """``{kernel: {"regs": n, "spill": bytes}}`` from ``ptxas -v`` output."""
    out: Dict[str, Dict[str, int]] = {}
    name = None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            name = m.group(1)
            out[name] = {"regs": 0, "spill": 0}
            continue
        if name is None:
            continue
        m = re.search(r"(\d+) bytes spill stores", line)
        if m:
            out[name]["spill"] = int(m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            out[name]["regs"] = int(m.group(1))
    return out


def parse_sass(text: str) -> Dict[str, List[str]]:
    """``{kernel: [opcode, ...]}`` from ``cuobjdump -sass`` output (predicates dropped, the
    opcode without its modifiers: ``@P0 IMAD.WIDE.U32 ...`` counts as ``IMAD``)."""
    out: Dict[str, List[str]] = {}
    name = None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            name = m.group(1)
            out[name] = []
            continue
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m and name is not None:
            out[name].append(m.group(1))
    return out


def _tools():
    """``(toolchain for sm_90a, cuobjdump, KernelSpec, cuda_flags)``; exits naming what is
    missing."""
    from flash_dmattn.backends.cuda import toolchain
    from flash_dmattn.backends.cuda.jit import cuda_flags
    from flash_dmattn.backends.cuda.spec import KernelSpec

    nvcc, inc = toolchain.find_nvcc(), toolchain.find_cutlass_include()
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump is None:
        try:
            import triton

            cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
            cuobjdump = str(cand) if cand.exists() else None
        except ImportError:
            pass
    missing = [n for n, v in (("nvcc", nvcc), ("the CUTLASS headers", inc),
                              ("cuobjdump", cuobjdump)) if v is None]
    if missing:
        sys.exit("needs " + ", ".join(missing))
    tc = toolchain.Toolchain(nvcc, toolchain.nvcc_version(nvcc) or "", inc, (9, 0))
    return tc, cuobjdump, KernelSpec, cuda_flags


def compile_tu(csrc: Path, tu: str, spec: str, extra: List[str], work: Path):
    """Compile ``csrc/tu`` for sm_90a into ``work``, with the JIT's flags for ``spec`` (and
    ``$FLASH_DMATTN_CUDA_FLAGS``) plus ``extra``; ``(ptxas stats, sass opcodes)``."""
    tc, cuobjdump, kernel_spec, cuda_flags = _tools()
    work.mkdir(parents=True, exist_ok=True)
    obj = work / (Path(tu).stem + ".o")
    cmd = [tc.nvcc, *cuda_flags(kernel_spec.parse(spec), tc), *extra,
           f"-I{csrc}", f"-I{tc.cutlass_include}", "-Xptxas", "-v", "-c", str(csrc / tu),
           "-o", str(obj)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"nvcc failed on {csrc / tu}:\n{res.stderr[-4000:]}")
    (work / "ptxas.txt").write_text(res.stderr)
    sass = subprocess.run([cuobjdump, "-sass", str(obj)], capture_output=True, text=True,
                          check=True).stdout
    (work / (Path(tu).stem + ".sass")).write_text(sass)
    return parse_ptxas(res.stderr), parse_sass(sass)


def _short(name: str, width: int = 64) -> str:
    try:
        demangled = subprocess.run(["c++filt", name], capture_output=True, text=True).stdout
        name = demangled.strip() or name
    except OSError:
        pass
    return name if len(name) <= width else name[:width - 3] + "..."


def report(after, before=None, ops: bool = False) -> List[str]:
    """One line per kernel of ``after`` (``(ptxas stats, sass opcodes)``), with ``before``'s
    numbers beside it where given."""
    stats, sass = after
    lines = []
    for name in sass:
        st = stats.get(name, {"regs": 0, "spill": 0})
        line = (f"{_short(name):64s} regs {st['regs']:3d} spill {st['spill']:4d} "
                f"instr {len(sass[name]):6d}")
        if before is not None:
            b_stats, b_sass = before
            if name not in b_sass:
                line += "  (not in base)"
            else:
                bs = b_stats.get(name, {"regs": 0, "spill": 0})
                line += (f"  | base regs {bs['regs']:3d} spill {bs['spill']:4d} "
                         f"instr {len(b_sass[name]):6d} ({len(sass[name]) - len(b_sass[name]):+d})")
                if ops:
                    a, b = Counter(sass[name]), Counter(b_sass[name])
                    diff = {op: a[op] - b[op] for op in sorted(set(a) | set(b)) if a[op] != b[op]}
                    if diff:
                        line += "\n    " + " ".join(f"{op} {d:+d}" for op, d in diff.items())
        lines.append(line)
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("tu")
    ap.add_argument("spec")
    ap.add_argument("--base", help="a commit whose csrc/ compiles beside this checkout's")
    ap.add_argument("--flags", default="", help="extra nvcc flags for this checkout's build")
    ap.add_argument("--ops", action="store_true", help="opcodes whose counts differ (with --base)")
    ap.add_argument("--keep", help="keep objects, ptxas output and SASS here")
    a = ap.parse_args(argv)
    tmp = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="sass-"))
    jobs = {"after": (ROOT / "csrc", a.flags.split())}
    if a.base:
        base_root = tmp / "base-tree"
        base_root.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", a.base, "csrc"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base_root)], input=archive, check=True)
        jobs["before"] = (base_root / "csrc", [])
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {k: pool.submit(compile_tu, csrc, a.tu, a.spec, extra, tmp / k)
                   for k, (csrc, extra) in jobs.items()}
        results = {k: f.result() for k, f in futures.items()}
    print("\n".join(report(results["after"], results.get("before"), a.ops)))
    if not a.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
