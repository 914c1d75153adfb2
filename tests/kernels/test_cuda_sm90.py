"""The build of the Hopper CUDA kernels (`cuda_sm90.py`, csrc/*_sm90.cu), where nvcc exists: each source compiles
for sm_90a on its own with no register spills, and every source and header is built and installed."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mok_compile.kernels import cuda_sm90

CSRC = Path(__file__).resolve().parents[2] / "csrc"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("source", cuda_sm90._SOURCES)
def test_source_compiles_for_sm90a_without_spills(tmp_path, source):
    """As cuda_sm90.py builds it (no torch headers): ptxas must not spill (a spill in a consumer warp group's
    accumulators costs more than the kernel gains)."""
    run = subprocess.run(["nvcc", "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
                          "-Xcompiler", "-fPIC", "-shared", str(CSRC / source), "-o", str(tmp_path / "k.so")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    spills = re.findall(r"(\d+) bytes spill stores", run.stderr)
    assert spills and set(spills) == {"0"}, run.stderr[-3000:]
    assert "is injected" not in run.stderr, run.stderr[-3000:]  # ptxas serialised wgmma (C7517)


def test_every_source_and_header_is_in_the_build_and_the_package():
    on_disk = {p.name for p in CSRC.glob("*_sm90.cu")} | {p.name for p in CSRC.glob("*.cuh")}
    assert on_disk == set(cuda_sm90._SOURCES) | set(cuda_sm90._HEADERS)
    pyproject = (CSRC.parent / "pyproject.toml").read_text()
    assert '"*.cu"' in pyproject and '"*.cuh"' in pyproject  # installed with the package
