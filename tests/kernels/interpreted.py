"""Run Python under Triton's CPU interpreter, for kernel tests in CI (no GPU there). A fresh process: the
variable must be set before Triton and the kernel modules are first imported.

Interpreted runs take a large part of CI's time on its 2-core machine, each in one single-threaded process. A test marks
its run with `background(argv)`; tests/conftest.py queues the selected tests' runs at collection, and one
background thread runs them one after another, in the order the tests come, on the core the other tests leave
free. A test then takes its run's output (`interpreted_stdout`), waiting for it if it is running, or runs it itself
if the queue has not reached it yet.
"""

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KERNEL_RUNNER = ["-m", "tests.kernels.interpret_runner"]  # test_triton_interpret.py's kernel checks


def _env() -> dict:
    return {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}


def _compare_script(case: str) -> str:
    return case + "import json\nprint(json.dumps(compare('cpu', 0)))\n"


def compare_argv(case: str) -> list:
    """The interpreted run of `run_compare(case, "cpu")`."""
    return script_argv(_compare_script(case))


def script_argv(script: str) -> list:
    """The interpreted run of `run_interpreted(script)`."""
    return ["-c", script]


def background(argv: list):
    """Marks a test whose interpreted run (`argv`, as the test starts it) may run early, in the background."""
    return pytest.mark.interpreted(tuple(argv))


def _kill(proc):
    proc.kill()
    proc.wait()


class BackgroundRuns:
    """Interpreted runs started ahead of the tests that read them: queued for one thread that starts each when the
    one before it ended. Output goes to temporary files: a full pipe would stall a run."""

    def __init__(self):
        self.started = {}  # argv -> (process, stdout file, stderr file, start time)
        self.queued = []  # argvs not started yet, in order
        self.lock = threading.Lock()  # guards started and queued
        self.worker = None  # the thread working through queued

    def _start(self, argv: tuple):  # with the lock held
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=_env(), stdout=out, stderr=err, text=True)
        self.started[argv] = (proc, out, err, time.monotonic())
        return proc

    def queue(self, argvs: list):
        with self.lock:
            new = [a for a in dict.fromkeys(map(tuple, argvs)) if a not in self.started and a not in self.queued]
            self.queued.extend(new)
            if self.queued and self.worker is None:
                self.worker = threading.Thread(target=self._work_through_queue, name="interpreted-runs", daemon=True)
                self.worker.start()

    def _work_through_queue(self):
        while True:
            with self.lock:
                if not self.queued:
                    self.worker = None
                    return
                proc = self._start(self.queued.pop(0))
            proc.wait()

    def take(self, argv: list):
        """(process, stdout file, stderr file, start time) of `argv`'s run, None where it was never started (a
        queued one then leaves the queue: the caller runs it)."""
        with self.lock:
            if tuple(argv) in self.queued:
                self.queued.remove(tuple(argv))
            return self.started.pop(tuple(argv), None)

    def stop(self):
        """Drop the queued runs and kill the started ones nobody took."""
        with self.lock:
            self.queued.clear()
            started = list(self.started.values())
            self.started.clear()
        for proc, out, err, _ in started:
            _kill(proc)
            out.close()
            err.close()


RUNS = BackgroundRuns()  # the session's (tests/conftest.py queues the selected tests' runs)


def interpreted_stdout(argv: list, timeout: float = 300, runs: BackgroundRuns = RUNS) -> str:
    """stdout of `python *argv` run from the repository root with TRITON_INTERPRET=1 (asserts it succeeded);
    `timeout` counts from the start, also for a run started earlier in the background. A run still queued is
    taken off the queue and run here."""
    started = runs.take(argv)
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
    return json.loads(interpreted_stdout(script_argv(script), timeout).splitlines()[-1])


def run_compare(case: str, device: str):
    """What `compare(device, seed)`, defined by the Python source `case`, returns: run interpreted in a subprocess
    on the CPU (seed 0), or in this process on CUDA (a random seed, TF32 off; the test is skipped without CUDA)."""
    if device == "cpu":
        return run_interpreted(_compare_script(case))
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    namespace = {}
    exec(case, namespace)  # noqa: S102 - the same case as the interpreted test
    torch.backends.cuda.matmul.allow_tf32 = False
    return namespace["compare"]("cuda", int(torch.randint(0, 2**31, ())))
