"""`tests.kernels.interpreted`: a run started in the background (the kernel runner, started at collection by
tests/conftest.py) gives what a run started at the test would, its failures and hangs are reported, and a
session that ends first leaves no process behind."""

import subprocess

import pytest

from tests.kernels import interpreted


def test_a_background_run_gives_its_stdout_under_the_interpreter():
    argv = ["-c", "import os; print(os.environ['TRITON_INTERPRET'], 'ran')"]
    interpreted.start_interpreted(argv)
    interpreted.start_interpreted(argv)  # started once
    assert interpreted.interpreted_stdout(argv) == "1 ran\n" == interpreted.interpreted_stdout(argv)


def test_a_failing_background_run_reports_its_stderr():
    argv = ["-c", "import sys; sys.exit('the runner failed')"]
    interpreted.start_interpreted(argv)
    with pytest.raises(AssertionError, match="the runner failed"):
        interpreted.interpreted_stdout(argv)


def test_the_timeout_counts_from_the_start_and_kills_the_run():
    argv = ["-c", "import time; time.sleep(60)"]
    interpreted.start_interpreted(argv)
    proc = interpreted._STARTED[tuple(argv)][0]
    with pytest.raises(subprocess.TimeoutExpired):
        interpreted.interpreted_stdout(argv, timeout=1)
    assert proc.poll() is not None and tuple(argv) not in interpreted._STARTED


def test_runs_nobody_waited_for_are_killed_at_the_end():
    argv = ["-c", "import time; time.sleep(60)"]
    interpreted.start_interpreted(argv)
    proc = interpreted._STARTED[tuple(argv)][0]
    interpreted.stop_started(argv)  # only this one: the kernel runner may be running beside this test
    assert proc.poll() is not None and tuple(argv) not in interpreted._STARTED
