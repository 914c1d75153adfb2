"""`tests.kernels.interpreted`: a run started in the background (the marked tests' runs, queued at collection by
tests/conftest.py) gives what a run started at the test would, its failures and hangs are reported, queued runs
run one at a time in order, and a session that ends first leaves no process behind."""

import subprocess
import time

import pytest

from tests.kernels import interpreted


def _wait_for(condition, seconds=60.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _started(argv):
    """Runs of their own (not the session's queue, which may be busy with the kernel runner), with `argv`'s
    started."""
    runs = interpreted.BackgroundRuns()
    runs.queue([argv, argv])  # queued once
    _wait_for(lambda: tuple(argv) in runs.started)
    return runs


def test_a_background_run_gives_its_stdout_under_the_interpreter():
    argv = ["-c", "import os; print(os.environ['TRITON_INTERPRET'], 'ran')"]
    runs = _started(argv)
    assert interpreted.interpreted_stdout(argv, runs=runs) == "1 ran\n" == interpreted.interpreted_stdout(argv)


def test_a_failing_background_run_reports_its_stderr():
    argv = ["-c", "import sys; sys.exit('the runner failed')"]
    runs = _started(argv)
    with pytest.raises(AssertionError, match="the runner failed"):
        interpreted.interpreted_stdout(argv, runs=runs)


def test_the_timeout_counts_from_the_start_and_kills_the_run():
    argv = ["-c", "import time; time.sleep(60)"]
    runs = _started(argv)
    proc = runs.started[tuple(argv)][0]
    with pytest.raises(subprocess.TimeoutExpired):
        interpreted.interpreted_stdout(argv, timeout=1, runs=runs)
    assert proc.poll() is not None and not runs.started


def test_runs_nobody_waited_for_are_killed_at_the_end():
    argv = ["-c", "import time; time.sleep(60)"]
    runs = _started(argv)
    proc = runs.started[tuple(argv)][0]
    runs.stop()
    assert proc.poll() is not None and not runs.started


def test_queued_runs_run_one_at_a_time_in_order():
    runs = interpreted.BackgroundRuns()
    argvs = [["-c", f"import time; t = time.monotonic(); time.sleep(0.3); print({i}, t, time.monotonic())"]
             for i in range(3)]
    runs.queue(argvs + argvs[:1])  # each once
    _wait_for(lambda: runs.worker is None)
    spans = [interpreted.interpreted_stdout(argv, runs=runs).split() for argv in argvs]
    assert [int(span[0]) for span in spans] == [0, 1, 2]
    times = [float(t) for span in spans for t in span[1:]]
    assert times == sorted(times), spans  # each started after the one before it ended


def test_a_run_the_queue_has_not_reached_runs_in_the_test():
    runs = interpreted.BackgroundRuns()
    slow, quick = ["-c", "import time; time.sleep(60)"], ["-c", "print('quick')"]
    runs.queue([slow, quick])
    _wait_for(lambda: tuple(slow) in runs.started)
    assert interpreted.interpreted_stdout(quick, runs=runs) == "quick\n" and not runs.queued
    proc = runs.started[tuple(slow)][0]
    runs.stop()
    assert proc.poll() is not None and not runs.started
    _wait_for(lambda: runs.worker is None)


def test_the_cpu_kernels_tests_run_after_the_others(request):
    """tests/conftest.py's RUN_LAST: in this session's order no test of those directories precedes another's."""
    from tests.conftest import RUN_LAST

    last = [item.nodeid.startswith(RUN_LAST) for item in request.session.items]
    assert last == sorted(last)
