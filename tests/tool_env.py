"""The environment in which tests run a tool of ``tools/`` as a subprocess, and the tool as a
module for tests that call its functions.

The tools import ``flash_dmattn`` as a user would and patch no ``sys.path``; they expect the
package installed (``pip install -e .``). The tests put this checkout first on ``PYTHONPATH``
instead, so that the tool imports the package under test whatever is installed.
"""
import importlib.util
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tool_env(env=None):
    """``env`` (default: this process's environment) with the checkout first on PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def load_tool(name: str):
    """``tools/<name>.py`` imported as a module (tools are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
