"""Run Python under Triton's CPU interpreter, for kernel tests in CI (no GPU there). A fresh process: the
variable must be set before Triton and the kernel modules are first imported."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def interpreted_stdout(argv: list, timeout: float = 300) -> str:
    """stdout of `python *argv` run from the repository root with TRITON_INTERPRET=1 (asserts it succeeded)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def run_interpreted(script: str, timeout: float = 300):
    """The JSON value on the last line that `script` prints, run interpreted."""
    return json.loads(interpreted_stdout(["-c", script], timeout).splitlines()[-1])
