"""Run Python under Triton's CPU interpreter, for kernel tests in CI (no GPU there). A fresh process: the
variable must be set before Triton and the kernel modules are first imported."""

import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KERNEL_RUNNER = ["-m", "tests.kernels.interpret_runner"]  # test_triton_interpret.py's kernel checks
_STARTED = {}  # argv -> (process, stdout file, stderr file, start time) of `start_interpreted`


def _env() -> dict:
    return {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}


def start_interpreted(argv: list):
    """Start `python *argv` interpreted in the background; `interpreted_stdout(argv)` then waits for it.
    For the long kernel runner: on the 2-core CI machine it runs on one core while the tests before it run
    on the other (output to temporary files: a full pipe would stall it)."""
    if tuple(argv) not in _STARTED:
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=_env(), stdout=out, stderr=err, text=True)
        _STARTED[tuple(argv)] = (proc, out, err, time.monotonic())


def _kill(proc):
    proc.kill()
    proc.wait()


def stop_started(argv: list | None = None):
    """Kill what `start_interpreted` started (`argv`'s run, or all) and nobody waited for: a session that ended
    early."""
    for key in [tuple(argv)] if argv is not None else list(_STARTED):
        proc, out, err, _ = _STARTED.pop(key)
        _kill(proc)
        out.close()
        err.close()


def interpreted_stdout(argv: list, timeout: float = 300) -> str:
    """stdout of `python *argv` run from the repository root with TRITON_INTERPRET=1 (asserts it succeeded);
    `timeout` counts from the start, also for a run that `start_interpreted` began earlier."""
    started = _STARTED.pop(tuple(argv), None)
    if started is None:
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=_env(), capture_output=True, text=True,
                              timeout=timeout)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc.stdout
    proc, out, err, t0 = started
    try:
        proc.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        _kill(proc)
        raise
    finally:
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
        out.close()
        err.close()
    assert proc.returncode == 0, stderr[-4000:]
    return stdout


def run_interpreted(script: str, timeout: float = 300):
    """The JSON value on the last line that `script` prints, run interpreted."""
    return json.loads(interpreted_stdout(["-c", script], timeout).splitlines()[-1])


def run_compare(case: str, device: str):
    """What `compare(device, seed)`, defined by the Python source `case`, returns: run interpreted in a subprocess
    on the CPU (seed 0), or in this process on CUDA (a random seed, TF32 off; the test is skipped without CUDA)."""
    if device == "cpu":
        return run_interpreted(case + "import json\nprint(json.dumps(compare('cpu', 0)))\n")
    import pytest
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    namespace = {}
    exec(case, namespace)  # noqa: S102 - the same case as the interpreted test
    torch.backends.cuda.matmul.allow_tf32 = False
    return namespace["compare"]("cuda", int(torch.randint(0, 2**31, ())))
