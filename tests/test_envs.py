"""One way to configure: the package reads its own environment variables in envs.py only.

Other modules may read the toolchain's standard variables (CUDA_HOME, CUTLASS_PATH,
XDG_CACHE_HOME) where they look for the toolchain or the cache, but a ``FLASH_DMATTN_*``
variable read anywhere else would be a setting that envs.py and the README do not list.
"""
import ast
import os
import re
from pathlib import Path

from flash_dmattn import envs

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flash_dmattn"


def _own_names():
    return {v for k, v in vars(envs).items() if k.isupper() and isinstance(v, str)
            and v.startswith("FLASH_DMATTN_")}


def test_only_envs_reads_flash_dmattn_variables():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "envs.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"FLASH_DMATTN_[A-Z0-9_]+", node.value):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
    assert not offenders, "read these through flash_dmattn.envs:\n" + "\n".join(offenders)


def test_every_variable_is_documented_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    missing = sorted(n for n in _own_names() if n not in section)
    assert not missing, f"README's Configuration section does not mention {missing}"


def test_readers(monkeypatch):
    for name in _own_names():
        monkeypatch.delenv(name, raising=False)
    assert envs.forced_backend() is None and envs.disabled_backends() == set()
    assert envs.cache_dir() is None and envs.hf_varlen_mode() is None
    assert envs.triton_autotune() and not envs.cuda_auto() and envs.cuda_extra_flags() == []
    assert envs.kernel_environment() == (None, None)
    monkeypatch.setenv(envs.BACKEND, " flex ")
    monkeypatch.setenv(envs.DISABLE, "cuda, ,triton")
    monkeypatch.setenv(envs.CACHE_DIR, "~/kernels")
    monkeypatch.setenv(envs.TRITON_AUTOTUNE, "0")
    monkeypatch.setenv(envs.CUDA_AUTO, "1")
    monkeypatch.setenv(envs.CUDA_FLAGS, "-DA=1  -DB=2")
    assert envs.forced_backend() == "flex" and envs.disabled_backends() == {"cuda", "triton"}
    assert envs.cache_dir() == Path("~/kernels").expanduser()
    assert not envs.triton_autotune() and envs.cuda_auto()
    assert envs.cuda_extra_flags() == ["-DA=1", "-DB=2"]
    # Raw values, as stored (only their equality matters: a memo key).
    assert [v if v is None or isinstance(v, str) else os.fsdecode(v)
            for v in envs.kernel_environment()] == ["-DA=1  -DB=2", "~/kernels"]
