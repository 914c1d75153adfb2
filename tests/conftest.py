"""Shared test set-up: GPU skipping, determinism of random inputs, quiet logs."""

import os

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


def pytest_collection_finish(session):
    """Start the Triton interpreter's kernel runner (~10 minutes on the 2-core CI machine) in the background as
    soon as its tests are selected, so that it runs beside the tests before them; not in an xdist worker, which
    cannot know whether it will get them (they then run it when they start, as before)."""
    if session.config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if any(item.path.name == "test_triton_interpret.py" for item in session.items):
        from tests.kernels import interpreted

        interpreted.start_interpreted(interpreted.KERNEL_RUNNER)


def pytest_sessionfinish(session):
    from tests.kernels import interpreted

    interpreted.stop_started()


@pytest.fixture(autouse=True)
def _reset_dynamo():
    """Each test starts with fresh Dynamo caches and counters."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
