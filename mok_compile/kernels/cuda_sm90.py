"""The Hopper CUDA C++ kernels (csrc/*_sm90.cu): built on first use into one shared library and called through
ctypes.

The sources are compiled with torch's cpp_extension (nvcc, ninja; cached like the CPU kernel's build, under
`$MOK_BUILD_DIR` or torch's extension directory) into a plain shared library without torch headers, so the build
takes seconds. The build directory's name carries a hash of the sources, so an edited source or header is rebuilt.
Each kernel module (`gate_up_sm90.py`, `wgrad_sm90.py`) registers its call as an op of the `mok_sm90` library
namespace, which a launch plan (`plan.py`) records and replays like any other op.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import threading
import warnings
from pathlib import Path

import torch

_SOURCES = ("gate_up_sm90.cu", "wgrad_sm90.cu")
_HEADERS = ("sm90_common.cuh",)

_lock = threading.Lock()
_state: dict = {}  # "lib": the loaded library, or "error": why it could not be built; "warned"

ops = torch.library.Library("mok_sm90", "DEF")  # the kernels' ops: torch.ops.mok_sm90.*


def _csrc() -> Path:
    here = Path(__file__).resolve()
    for path in (here.parents[2] / "csrc", here.parents[1] / "csrc"):  # source tree, or installed in the package
        if (path / _SOURCES[0]).is_file():
            return path
    raise FileNotFoundError(f"CUDA sources {', '.join(_SOURCES)} not found")


def _build():
    from torch.utils import cpp_extension

    csrc = _csrc()
    digest = hashlib.sha1(b"".join((csrc / f).read_bytes() for f in _SOURCES + _HEADERS)).hexdigest()[:12]
    name = f"mok_sm90_{digest}"
    build_dir = os.environ.get("MOK_BUILD_DIR")
    build_dir = os.path.join(build_dir, name) if build_dir else cpp_extension._get_build_directory(name, False)
    os.makedirs(build_dir, exist_ok=True)
    # An arch flag of our own makes cpp_extension add none: wgmma, setmaxnreg and multicast need sm_90a.
    cpp_extension.load(name=name, sources=[str(csrc / f) for f in _SOURCES], build_directory=build_dir,
                       extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"],
                       is_python_module=False, verbose=False)
    return ctypes.CDLL(os.path.join(build_dir, f"{name}.so"))


def library():
    """The loaded library; raises RuntimeError (the build's own error) where it cannot be built."""
    if "lib" not in _state and "error" not in _state:
        with _lock:
            if "lib" not in _state and "error" not in _state:
                try:
                    _state["lib"] = _build()
                except Exception as err:  # noqa: BLE001 - any build failure: the caller falls back
                    _state["error"] = f"{type(err).__name__}: {err}"
    if "error" in _state:
        raise RuntimeError(f"mok_compile: the Hopper CUDA kernels could not be built: {_state['error'][:600]}")
    return _state["lib"]


def entry(name: str, argtypes: list):
    """The library's C function `name` with its argument types; every entry returns 0 or a CUDA error code."""
    fn = getattr(library(), name)
    fn.restype = ctypes.c_int
    fn.argtypes = argtypes
    return fn


def available() -> bool:
    """Whether the kernels are built (building them on the first call); False, after one warning, where they
    cannot be."""
    try:
        library()
        return True
    except RuntimeError as err:
        if not _state.get("warned"):
            _state["warned"] = True
            warnings.warn(f"{err}; those stages stay on the Triton or CUTLASS kernels", RuntimeWarning, stacklevel=2)
        return False


@functools.cache
def is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)  # sm_90a code runs on 9.0 only


def on_sm90(t: torch.Tensor) -> bool:
    return t.is_cuda and is_sm90(t.device.index if t.device.index is not None else torch.cuda.current_device())


def check_rows(op: str, **tensors):
    """Every tensor given (None skipped) must be a contiguous, 16-byte aligned bf16 tensor: the kernels read and
    write rows in 16-byte chunks."""
    for name, t in tensors.items():
        if t is not None and not (t.is_contiguous() and t.dtype == torch.bfloat16 and t.data_ptr() % 16 == 0):
            raise ValueError(f"mok_sm90.{op}: {name} must be a contiguous, 16-byte aligned bf16 tensor")


def call(op: str, fn, *args, device):
    """Run entry `fn` with `args` on `device`'s current stream; a nonzero status raises with the kernel's text."""
    err = ctypes.create_string_buffer(256)
    with torch.cuda.device(device):
        status = fn(*args, torch.cuda.current_stream(device).cuda_stream, err, 256)
    if status != 0:
        raise RuntimeError(f"mok_sm90.{op}: {err.value.decode(errors='replace')}")
