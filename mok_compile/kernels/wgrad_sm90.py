"""The expert weight gradients as a CUDA C++ kernel for Hopper (csrc/wgrad_sm90.cu): C[e] = P[rows of e]^T @
Q[rows of e], with either operand's rows gathered by token inside the kernel, so the backward needs no sorted
copies of x and grad_out (CUTLASS's grouped GEMM reads its operands in sorted order: two [T*K, H] gathers).

Why it exists: on CUTLASS the two weight gradients and their gathers take about a third of the Qwen3 layer's
backward (benchmarks/NOTES-gpu.md v16 (3)). Measured (NOTES v29) it gives CUTLASS's result bit for bit but is slower,
0.79-0.84x for the layer's fwd+bwd, bound by its loads; so it runs only on request, MOK_GEMM_ENGINE=wgrad=sm90, and
only for the calls it fits (`eligible`). Deterministic like the rest: one fp32 sum per element in sorted row order.

Registered as the op `torch.ops.mok_sm90.wgrad`; `moe._backward` runs it for the `wgrad` stage when asked for and
the call fits, else CUTLASS.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import cuda_sm90

available = cuda_sm90.available  # whether the Hopper kernels build (building them on the first call)


@functools.cache
def _entry():
    return cuda_sm90.entry("mok_wgrad_sm90", [ctypes.c_void_p] * 6 + [ctypes.c_int] * 7
                           + [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int])


def eligible(x, gate_up_proj, down_proj, kw) -> bool:
    """Whether both weight gradients of this call fit the kernel: bf16 on an sm_90 GPU, x (contiguous) and the
    contiguous weights 16-byte aligned with 16-byte rows (H, I multiples of 8), no weight on the input (its x rows
    are scaled before the GEMM). Any activation and weight layout: the gradient's columns follow the weight's.
    grad_out's alignment is the caller's to check (`moe._backward`); `available()` says whether the kernel builds."""
    if not (cuda_sm90.on_sm90(x) and x.dtype == torch.bfloat16 and x.data_ptr() % 16 == 0
            and not kw.get("weight_on_input", False)):
        return False
    return all(w.dtype == torch.bfloat16 and w.is_contiguous() and w.data_ptr() % 16 == 0 and w.shape[1] % 8 == 0
               and w.shape[2] % 8 == 0 for w in (gate_up_proj, down_proj))


cuda_sm90.ops.define("wgrad(Tensor p, Tensor q, Tensor sorted_pair, Tensor expert_count, Tensor expert_start, "
                     "Tensor(a!) out, bool p_gather, bool q_gather, int top_k) -> ()")


def _wgrad_cuda(p, q, sorted_pair, expert_count, expert_start, out, p_gather, q_gather, top_k):
    cuda_sm90.check_rows("wgrad", p=p, q=q, out=out)
    rows, E = sorted_pair.numel(), expert_count.numel()
    P, Q = p.shape[1], q.shape[1]
    tokens = rows // top_k if top_k > 0 else 0
    if (out.shape != (E, P, Q) or p.shape[0] != (tokens if p_gather else rows)
            or q.shape[0] != (tokens if q_gather else rows) or P % 8 or Q % 8):
        raise ValueError(f"mok_sm90.wgrad: shapes p {tuple(p.shape)}, q {tuple(q.shape)}, out {tuple(out.shape)} do "
                         f"not fit {rows} sorted rows over {E} experts (P and Q must be multiples of 8)")
    if out.numel() == 0:
        return
    cuda_sm90.call("wgrad", _entry(), p.data_ptr(), q.data_ptr(), sorted_pair.data_ptr(), expert_count.data_ptr(),
                   expert_start.data_ptr(), out.data_ptr(), rows, P, Q, E, top_k, int(p_gather), int(q_gather),
                   device=out.device)


cuda_sm90.ops.impl("wgrad", _wgrad_cuda, "CUDA")
cuda_sm90.ops.impl("wgrad", lambda *args: None, "Meta")  # writes its output only


def wgrad(p, q, disp, out, *, p_gather=False, q_gather=False):
    """out[e] = P[rows of e]^T @ Q[rows of e] in bf16 (an expert without rows gets zeros). With `p_gather` P is
    [T, P] and row r reads P[token of r]; else P is [T*K, P] in sorted order; likewise Q."""
    torch.ops.mok_sm90.wgrad(p, q, disp.sorted_pair, disp.expert_count, disp.expert_start, out, p_gather, q_gather,
                             disp.top_k)
    return out
