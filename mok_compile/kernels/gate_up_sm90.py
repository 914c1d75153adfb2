"""The forward gate_up as a CUDA C++ kernel for Hopper (csrc/gate_up_sm90.cu): persistent and warp-specialised,
W1 tiles multicast by TMA to the two CTAs of a cluster, the token gather in cp.async A loads, SiLU(gate) * up in
the epilogue. Its output is bit for bit the Triton gate_up's.

Why it exists: the Triton gate_up is bound by L2 reads (benchmarks/NOTES-gpu.md v25, v27), and sharing each W1
tile between two row blocks of one expert needs TMA multicast, which Triton 3.6 does not emit on Hopper. Measured
(NOTES v28), it is not faster in the layer, so it runs only on request, MOK_GEMM_ENGINE=gate_up=sm90
(`configs.gate_up_engine`), and only for the calls it fits (`eligible`); the GPU tests run it that way.

The source is compiled on first use with torch's cpp_extension (nvcc, ninja; cached like the CPU kernel's build,
`$MOK_BUILD_DIR` or torch's extension directory) into a plain shared library without torch headers (seconds to
build), called through ctypes. The call is registered as the op `torch.ops.mok_sm90.gate_up`, so a launch plan
(`plan.py`, which records aten-level ops and Triton launches) records and replays it like any other op.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import warnings
from pathlib import Path

import torch

_NAME = "mok_gate_up_sm90"
_SOURCE = "gate_up_sm90.cu"

_lock = threading.Lock()
_state: dict = {}  # "fn": the built entry point, or "error": why it could not be built; "warned"


def _source_path() -> Path:
    here = Path(__file__).resolve()
    for path in (here.parents[2] / "csrc" / _SOURCE, here.parents[1] / "csrc" / _SOURCE):
        if path.is_file():
            return path
    raise FileNotFoundError(f"CUDA source {_SOURCE} not found")


def _build():
    from torch.utils import cpp_extension

    build_dir = os.environ.get("MOK_BUILD_DIR")
    build_dir = os.path.join(build_dir, _NAME) if build_dir else cpp_extension._get_build_directory(_NAME, False)
    os.makedirs(build_dir, exist_ok=True)
    # An arch flag of our own makes cpp_extension add none: wgmma, setmaxnreg and multicast need sm_90a.
    cpp_extension.load(name=_NAME, sources=[str(_source_path())], build_directory=build_dir,
                       extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"],
                       is_python_module=False, verbose=False)
    lib = ctypes.CDLL(os.path.join(build_dir, f"{_NAME}.so"))
    fn = lib.mok_gate_up_sm90
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 5 + [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    return fn


def library():
    """The compiled entry point; raises RuntimeError (the build's own error) where it cannot be built."""
    if "fn" not in _state and "error" not in _state:
        with _lock:
            if "fn" not in _state and "error" not in _state:
                try:
                    _state["fn"] = _build()
                except Exception as err:  # noqa: BLE001 - any build failure: the caller falls back to Triton
                    _state["error"] = f"{type(err).__name__}: {err}"
    if "error" in _state:
        raise RuntimeError(f"mok_compile: the Hopper gate_up kernel could not be built: {_state['error'][:600]}")
    return _state["fn"]


def available() -> bool:
    """Whether the kernel is built (building it on the first call); False, after one warning, where it cannot be."""
    try:
        library()
        return True
    except RuntimeError as err:
        if not _state.get("warned"):
            _state["warned"] = True
            warnings.warn(f"{err}; the forward gate_up stays on the Triton kernel", RuntimeWarning, stacklevel=2)
        return False


@functools.cache
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)  # sm_90a code runs on 9.0 only


def eligible(x, gate_up_proj, gate_up_bias, kw) -> bool:
    """Whether the forward gate_up of this call fits the kernel: bf16 on an sm_90 GPU, gated SiLU with gate and
    up as row blocks of W1 [E, 2I, H] (F.linear layout, contiguous), E <= 256, no bias, no weight on the input,
    16-byte rows (H, I multiples of 8). Checks shapes only; `library()` may still fail to build."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and gate_up_proj.dtype == torch.bfloat16):
        return False
    if not _is_sm90(x.device.index if x.device.index is not None else torch.cuda.current_device()):
        return False
    if (not kw["gated"] or kw["activation"] != "silu" or kw["interleaved"] or kw["transposed"]
            or kw.get("weight_on_input", False) or gate_up_bias is not None):
        return False
    H = x.shape[1]
    I = gate_up_proj.shape[1] // 2
    return (gate_up_proj.is_contiguous() and gate_up_proj.shape[2] == H and H % 8 == 0 and I % 8 == 0
            and gate_up_proj.data_ptr() % 16 == 0 and gate_up_proj.shape[0] <= 256)


_lib = torch.library.Library("mok_sm90", "DEF")
_lib.define("gate_up(Tensor x, Tensor sorted_pair, Tensor w1, Tensor expert_count, Tensor expert_start, "
            "Tensor(a!) out, Tensor(b!)? h, int top_k) -> ()")


def _gate_up_cuda(x, sorted_pair, w1, expert_count, expert_start, out, h, top_k):
    rows, (E, two_i, H) = sorted_pair.numel(), w1.shape
    I = two_i // 2
    for name, t in (("x", x), ("out", out), ("h", h)):
        if t is not None and not (t.is_contiguous() and t.dtype == torch.bfloat16 and t.data_ptr() % 16 == 0):
            raise ValueError(f"mok_sm90.gate_up: {name} must be a contiguous, 16-byte aligned bf16 tensor")
    if x.shape[1] != H or out.shape != (rows, I) or (h is not None and h.shape != (rows, two_i)):
        raise ValueError(f"mok_sm90.gate_up: shapes x {tuple(x.shape)}, W1 {tuple(w1.shape)}, out "
                         f"{tuple(out.shape)} do not fit {rows} sorted rows")
    if rows == 0:
        return
    err = ctypes.create_string_buffer(256)
    with torch.cuda.device(x.device):
        status = library()(x.data_ptr(), sorted_pair.data_ptr(), w1.data_ptr(), expert_count.data_ptr(),
                           expert_start.data_ptr(), out.data_ptr(), 0 if h is None else h.data_ptr(), rows, H, I, E,
                           top_k, torch.cuda.current_stream(x.device).cuda_stream, err, 256)
    if status != 0:
        raise RuntimeError(f"mok_sm90.gate_up: {err.value.decode(errors='replace')}")


_lib.impl("gate_up", _gate_up_cuda, "CUDA")
_lib.impl("gate_up", lambda *args: None, "Meta")  # writes its outputs only


def gate_up(x, disp, w1, out, h=None):
    """out[r] = silu(x[t] @ W1[e, :I]^T) * (x[t] @ W1[e, I:]^T) for each sorted row r (pair of token t and
    expert e); `h` [T*K, 2I], if given, gets both products before the activation (the training forward)."""
    torch.ops.mok_sm90.gate_up(x, disp.sorted_pair, w1, disp.expert_count, disp.expert_start, out, h,
                               disp.top_k)
