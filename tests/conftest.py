"""Shared test set-up: GPU skipping, fresh random inputs for the GPU tests, Dynamo resets."""

import os
import zlib

# MKL's vector math picks its code path per thread on first use, racily: a CPU tanh, exp or erf now and then
# returns results good to ~1e-5 in part of a tensor (pytorch/pytorch#188792), which made tests comparing rounded
# outputs flaky. One fixed MKL code path (read when MKL starts, so before torch loads; inherited by the interpreted
# kernels' subprocesses) avoids it.
os.environ.setdefault("MKL_CBWR", "AVX2")

import pytest  # noqa: E402
import torch  # noqa: E402

import mok_compile  # noqa: F401  (registers torch.ops.mok.*)

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def pytest_configure(config):
    """One seed per run for the GPU tests' inputs, chosen here (before xdist starts its workers, which inherit it)."""
    seed = os.environ.get("MOK_TEST_SEED") or str(int.from_bytes(os.urandom(3), "little"))
    if not seed.isdigit():
        raise pytest.UsageError(f"MOK_TEST_SEED must be a non-negative integer, not {seed!r}")
    os.environ["MOK_TEST_SEED"] = seed


def pytest_report_header(config):
    seed = os.environ["MOK_TEST_SEED"]
    return f"GPU tests' random inputs: MOK_TEST_SEED={seed} (set it to draw this run's inputs again)"


def pytest_terminal_summary(terminalreporter):
    if HAS_CUDA:  # also under -q, which leaves out the header
        terminalreporter.write_line(pytest_report_header(terminalreporter.config))


@pytest.fixture(autouse=True)
def _fresh_inputs_for_gpu_tests(request):
    """A @pytest.mark.gpu test draws new random inputs each run: its seeds (`tests.kernels.cases.generator`,
    `make_case`) are offset by the run's seed, and torch's global generators are seeded from the run's seed and the
    test's id. The other tests keep fixed inputs."""
    from tests.kernels import cases

    if "gpu" not in request.keywords:
        yield
        return
    run_seed = int(os.environ["MOK_TEST_SEED"])
    cases.SEED_OFFSET = run_seed
    torch.manual_seed(run_seed + zlib.crc32(request.node.nodeid.encode()))
    try:
        yield
    finally:
        cases.SEED_OFFSET = 0


# Directories whose tests run after all others. tests/ops runs the C++ CPU kernel on every core (OpenMP), which
# beside the background interpreted runs (pytest_collection_finish) took 3.4x as long on CI's 2 cores (NOTES v76);
# placed last it starts after them, while the Python-bound tests (mostly compiling) run beside them.
RUN_LAST = ("tests/ops/",)


def pytest_collection_modifyitems(config, items):
    # Every @pytest.mark.gpu test skips where there is no CUDA device.
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
    items.sort(key=lambda item: item.nodeid.startswith(RUN_LAST))  # stable: the order within each part stays


def pytest_collection_finish(session):
    """Queue the selected tests' interpreted runs (marked with `interpreted.background`: the Triton interpreter's
    kernel runner, ~10 minutes on the 2-core CI machine, and the other kernels' CPU checks) to run in the
    background, one after another, beside the tests before them; not in an xdist worker, which cannot know whether
    it will get those tests (they then run theirs when they start)."""
    if session.config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    argvs = [mark.args[0] for item in session.items for mark in item.iter_markers("interpreted")]
    if argvs:
        from tests.kernels import interpreted

        interpreted.RUNS.queue(argvs)


def pytest_sessionfinish(session):
    from tests.kernels import interpreted

    interpreted.RUNS.stop()  # a session that ended early: drop the queued runs, kill the ones nobody took


@pytest.fixture(autouse=True)
def _reset_dynamo():
    """Each test starts with fresh Dynamo caches and counters."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def no_tf32():
    """torch's matmul TF32 switch off for the test (the default; a test may turn it on), restored after."""
    matmul, before = torch.backends.cuda.matmul, torch.backends.cuda.matmul.allow_tf32
    matmul.allow_tf32 = False
    yield matmul
    matmul.allow_tf32 = before
