"""C++ builds (`ops.cpu.load_extension`: the CPU kernel, the plan replay) survive a build that died: torch's lock
file, which a killed build leaves behind, made every later load of the directory wait forever (v76: a device job
killed during the plan replay's build hung the next one's first load for its whole time limit). A live build is
still waited for (near miss). Each load runs in a process of its own, so that a hang fails the test."""

import os
import subprocess
import sys
import time

import pytest

fcntl = pytest.importorskip("fcntl")

from mok_compile.ops import cpu  # noqa: E402

if cpu.missing_build_tool():
    pytest.skip(f"cannot build C++ here: {cpu.missing_build_tool()}", allow_module_level=True)

NAME = "mok_test_build_lock"
_LOAD = f"""
import warnings
from mok_compile.ops import cpu
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    cpu.load_extension({NAME!r}, sources=[{{source!r}}], is_python_module=False, verbose=False)
print("loaded;", "; ".join(str(w.message) for w in caught if "did not finish" in str(w.message)))
"""


@pytest.fixture
def build_dir(tmp_path, monkeypatch):
    source = tmp_path / "tiny.cpp"
    source.write_text("int mok_test_build_lock_value() { return 1; }\n")
    monkeypatch.setenv("MOK_BUILD_DIR", str(tmp_path / "build"))
    path = tmp_path / "build" / NAME
    path.mkdir(parents=True)
    return path, source


def _start_load(source):
    return subprocess.Popen([sys.executable, "-c", _LOAD.format(source=str(source))], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ))


def _finish(proc):
    try:
        return proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise


def test_a_dead_builds_lock_is_removed_and_the_build_runs(build_dir):
    """Up to torch 2.13 a killed build's lock file is removed, with a warning; from 2.14 on torch locks that file
    itself and leaves it after every build, so finding it says nothing: it is left, and the build runs."""
    from torch.utils import cpp_extension

    path, source = build_dir
    (path / "lock").touch()  # what a killed build leaves (from torch 2.14 on: what any build leaves)
    out, err = _finish(_start_load(source))
    if not cpu._lock_file_blocks(cpp_extension):
        assert out.strip() == "loaded;", (out, err[-2000:])
        return
    assert out.startswith("loaded;") and f"{path / 'lock'}, left by a build of {NAME}" in out, err[-2000:]
    assert not (path / "lock").exists()


def test_a_live_build_is_waited_for(build_dir):
    path, source = build_dir
    with open(path / "mok.lock", "a") as guard:  # a build in progress: it holds the guard and torch's lock
        fcntl.flock(guard, fcntl.LOCK_EX)
        (path / "lock").touch()
        proc = _start_load(source)
        time.sleep(3)
        assert proc.poll() is None and (path / "lock").exists()
        (path / "lock").unlink()  # that build ends
    out, err = _finish(proc)
    assert out.strip() == "loaded;", (out, err[-2000:])  # nothing was removed
