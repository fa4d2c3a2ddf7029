"""Library and kernel sources say what and why, not when or on which machine: no dates and no
GPU model names anywhere in ``flash_dmattn/`` or ``csrc/`` (measurements belong in
``benchmarks/results/<gpu>/`` and in commit messages)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HISTORY = re.compile(r"20[0-9]{2}-[0-9]{2}-[0-9]{2}|H[12]00")
SUFFIXES = {".py", ".cu", ".cuh", ".h", ".cpp"}


def _sources():
    for top in ("flash_dmattn", "csrc"):
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in SUFFIXES and path.is_file():
                yield path


def test_there_are_sources_to_check():
    names = {p.name for p in _sources()}
    assert {"api.py", "flash_fwd_sm90.cu", "params.h"} <= names


@pytest.mark.parametrize("path", list(_sources()), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_dates_or_gpu_names(path):
    hits = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if HISTORY.search(line)]
    assert not hits, "dates or GPU names in the source:\n" + "\n".join(hits)
