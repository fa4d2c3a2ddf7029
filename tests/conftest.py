import pytest
import torch

from flash_dmattn import registry


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clean_dispatch_state(monkeypatch):
    # Dispatch reads the environment per call and logs/warns once; isolate every test.
    monkeypatch.delenv("FLASH_DMATTN_BACKEND", raising=False)
    monkeypatch.delenv("FLASH_DMATTN_DISABLE", raising=False)
    registry.reset_dispatch_notes()
    yield
