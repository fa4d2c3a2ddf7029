"""The README's main command works on this machine."""
import os
import subprocess
import sys


def run(*args):
    # As a user runs it: without the Triton interpreter that conftest enables for kernel tests.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-m", "flash_dmattn", *args], capture_output=True, text=True, timeout=600, env=env
    )


def test_info():
    res = run("info")
    assert res.returncode == 0, res.stderr
    assert "torch-reference" in res.stdout and "available" in res.stdout


def test_demo_small():
    res = run("demo", "--seqlen", "128", "--repeats", "1")
    assert res.returncode == 0, res.stderr
    assert "torch-reference" in res.stdout and "flash_dmattn_func picks" in res.stdout
