"""The forward gate_up as a CUDA C++ kernel for Hopper (csrc/gate_up_sm90.cu): persistent and warp-specialised,
W1 tiles multicast by TMA to the two CTAs of a cluster, the token gather in cp.async A loads, SiLU(gate) * up in
the epilogue. Its output is bit for bit the Triton gate_up's.

Why it exists: the Triton gate_up is bound by L2 reads (benchmarks/NOTES-gpu.md v25, v27), and sharing each W1
tile between two row blocks of one expert needs TMA multicast, which Triton 3.6 does not emit on Hopper. Measured
(NOTES v28, v31, v77), it is not faster in the layer, nor alone on the layer's routing (it won only on the tuner's;
inside the layer's step it took 3-6% longer than the Triton gate_up at DeepSeek-V3 T=4096 and Qwen3 T=16384), so it
runs only on request, MOK_GEMM_ENGINE=gate_up=sm90 (`configs.gate_up_engine`), and only for the calls it fits
(`eligible`); the GPU tests run it that way.

Built with the other Hopper kernels (`cuda_sm90.py`) and registered as the op `torch.ops.mok_sm90.gate_up`.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import cuda_sm90

available = cuda_sm90.available  # whether the Hopper kernels build (building them on the first call)


@functools.cache
def _entry():
    return cuda_sm90.entry("mok_gate_up_sm90", [ctypes.c_void_p] * 7 + [ctypes.c_int] * 5
                           + [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int])


def eligible(x, gate_up_proj, gate_up_bias, kw) -> bool:
    """Whether the forward gate_up of this call fits the kernel: bf16 on an sm_90 GPU, gated SiLU with gate and
    up as row blocks of W1 [E, 2I, H] (F.linear layout, contiguous), E <= 256, no bias, no weight on the input,
    16-byte rows (H, I multiples of 8), x and W1 16-byte aligned. Checks the tensors only; `available()` says
    whether it builds."""
    if not (cuda_sm90.on_sm90(x) and x.dtype == torch.bfloat16 and gate_up_proj.dtype == torch.bfloat16
            and x.is_contiguous() and x.data_ptr() % 16 == 0):
        return False
    if (not kw["gated"] or kw["activation"] != "silu" or kw["interleaved"] or kw["transposed"]
            or kw.get("weight_on_input", False) or gate_up_bias is not None):
        return False
    H = x.shape[1]
    I = gate_up_proj.shape[1] // 2
    return (gate_up_proj.is_contiguous() and gate_up_proj.shape[2] == H and H % 8 == 0 and I % 8 == 0
            and gate_up_proj.data_ptr() % 16 == 0 and gate_up_proj.shape[0] <= 256)


cuda_sm90.ops.define("gate_up(Tensor x, Tensor sorted_pair, Tensor w1, Tensor expert_count, Tensor expert_start, "
                     "Tensor(a!) out, Tensor(b!)? h, int top_k) -> ()")


def _gate_up_cuda(x, sorted_pair, w1, expert_count, expert_start, out, h, top_k):
    rows, (E, two_i, H) = sorted_pair.numel(), w1.shape
    I = two_i // 2
    cuda_sm90.check_rows("gate_up", x=x, out=out, h=h)
    if x.shape[1] != H or out.shape != (rows, I) or (h is not None and h.shape != (rows, two_i)):
        raise ValueError(f"mok_sm90.gate_up: shapes x {tuple(x.shape)}, W1 {tuple(w1.shape)}, out "
                         f"{tuple(out.shape)} do not fit {rows} sorted rows")
    if rows == 0:
        return
    cuda_sm90.call("gate_up", _entry(), x.data_ptr(), sorted_pair.data_ptr(), w1.data_ptr(), expert_count.data_ptr(),
                   expert_start.data_ptr(), out.data_ptr(), 0 if h is None else h.data_ptr(), rows, H, I, E, top_k,
                   device=x.device)


cuda_sm90.ops.impl("gate_up", _gate_up_cuda, "CUDA")
cuda_sm90.ops.impl("gate_up", lambda *args: None, "Meta")  # writes its outputs only


def gate_up(x, disp, w1, out, h=None):
    """out[r] = silu(x[t] @ W1[e, :I]^T) * (x[t] @ W1[e, I:]^T) for each sorted row r (pair of token t and
    expert e); `h` [T*K, 2I], if given, gets both products before the activation (the training forward)."""
    torch.ops.mok_sm90.gate_up(x, disp.sorted_pair, w1, disp.expert_count, disp.expert_start, out, h,
                               disp.top_k)
