"""Shared test set-up: GPU skipping, determinism of random inputs, quiet logs."""

import pytest
import torch

import mok_compile  # noqa: F401  (registers torch.ops.mok.*)

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def pytest_collection_modifyitems(config, items):
    # Every @pytest.mark.gpu test skips where there is no CUDA device.
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture(autouse=True)
def _reset_dynamo():
    """Each test starts with fresh Dynamo caches and counters."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
