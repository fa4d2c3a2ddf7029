"""tests/tiers.py names tests that exist, so the slow tier is what it says."""
import ast
from pathlib import Path

import tiers

HERE = Path(__file__).parent


def test_every_slow_entry_names_a_test_function():
    stale = []
    for module, functions in tiers.SLOW.items():
        path = HERE / module
        defined = set()
        if path.is_file():
            defined = {node.name for node in ast.walk(ast.parse(path.read_text()))
                       if isinstance(node, ast.FunctionDef)}
        for function, kind in functions.items():
            assert kind in ("all", "rest"), (module, function, kind)
            if function not in defined:
                stale.append(f"{module}::{function}")
    assert not stale, f"tests/tiers.py names tests that do not exist: {stale}"
