"""Expert GEMMs through PyTorch's grouped GEMM (`torch.nn.functional.grouped_mm`, CUTLASS on Hopper).

Why a second engine: CUTLASS's grouped GEMM (TMA loads, warp-specialised wgmma, persistent
tiles) beats our Triton tiles where experts get many rows (Mixtral: ~1000+ rows per expert)
and in the weight gradients. It reads its A operand in expert-sorted order from memory, so
a gathered GEMM here pays one row gather (`gather_rows`) and the gate_up activation is its
own pass over h (`activation_pass.py`) instead of an epilogue; `configs.engine` weighs that
against the faster GEMM per stage.

Same sorted layout as `dispatch.py`: expert e's rows are [expert_start[e], expert_end[e]).
Deterministic (no split-K: every output tile is one reduction in a fixed order) and no host
synchronisation (group offsets stay on the device), like the Triton kernels.

    grouped_mm(a, w_kn, disp)   C[rows of e] = A[rows of e] @ w_kn[e]        (w_kn [E, k, n])
    wgrad(p, q, disp)           C[e] = P[rows of e]^T @ Q[rows of e]         ([E, p, q])
    segment_sum                 bias gradients: per-expert column sums of (gathered, scaled) rows
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import cdiv, launcher, next_power_of_2


_grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@functools.cache
def _is_hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def eligible(x, gate_up_proj, down_proj, I) -> bool:
    """Whether this call can use CUTLASS: bf16 on Hopper (where PyTorch runs its sm90 CUTLASS kernel and
    what we measured), every row 16-byte aligned (H, I multiples of 8), contiguous weights. (Weight on
    input limits it to the weight gradients: `moe._engines`.)"""
    return (_grouped_mm is not None and x.is_cuda and x.dtype == torch.bfloat16
            and _is_hopper(x.device.index if x.device.index is not None else torch.cuda.current_device())
            and x.shape[1] % 8 == 0 and I % 8 == 0
            and gate_up_proj.dtype == down_proj.dtype == torch.bfloat16
            and gate_up_proj.is_contiguous() and down_proj.is_contiguous()
            and _aligned(gate_up_proj) and _aligned(down_proj))


_SPREAD_ROWS = 4  # x rows per program of the spread (each written K times)


@triton.jit
def _spread_rows_kernel(x_ptr, pair_pos_ptr, scale_ptr, out_ptr, T, H, stride_x, stride_out, K: tl.constexpr,
                        SCALE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[pair_pos[t * K + k]] = x[t] (SCALE: (x[t] * scale[t * K + k]).to(out dtype), rounded once from
    fp32) for every slot k: each x row is read once and written K times."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rmask = rows < T
    m = rmask[:, None] & (cols < H)[None, :]
    v = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=m, other=0.0)
    for k in tl.static_range(K):
        pos = tl.load(pair_pos_ptr + rows * K + k, mask=rmask, other=0).to(tl.int64)
        vk = v
        if SCALE:
            s = tl.load(scale_ptr + rows * K + k, mask=rmask, other=0.0).to(tl.float32)
            vk = (v.to(tl.float32) * s[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + pos[:, None] * stride_out + cols[None, :], vk, mask=m)


def gather_rows(x, disp, scale=None):
    """x[token of each sorted pair]: the A operand of a gathered GEMM, in expert-sorted order.
    `scale` [T*K] (weight on input): rows (x[t] * scale[pair]).to(x.dtype), the experts' input.

    Written by spreading each x row to its K sorted positions rather than gathering (`index_select` on
    the sorted tokens): a row is then read once. Gathering reads each row K times in expert order, which
    at large T (x past L2) is K reads from DRAM: Qwen3 T=16384 took 0.267 ms per gather."""
    T, H = x.shape
    out = torch.empty((disp.num_pairs, H), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    assert x.stride(1) == 1 and disp.num_pairs == T * disp.top_k
    block_h = min(512, next_power_of_2(H))
    launcher(_spread_rows_kernel)[(cdiv(T, _SPREAD_ROWS), cdiv(H, block_h))](
        x, disp.pair_pos, scale if scale is not None else x, out, T, H, x.stride(0), out.stride(0), K=disp.top_k,
        SCALE=scale is not None, BLOCK_T=_SPREAD_ROWS, BLOCK_H=block_h, num_warps=4)
    return out


def grouped_mm(a, w_kn, disp):
    return _grouped_mm(a, w_kn, offs=disp.expert_end)


def wgrad(p, q, disp):
    return _grouped_mm(p.t(), q, offs=disp.expert_end)


@triton.jit
def _segment_sum_kernel(src_ptr, sorted_pair_ptr, scale_ptr, out_ptr, expert_start_ptr, expert_count_ptr, N,
                        stride_src, stride_oe, TOPK: tl.constexpr, GATHER: tl.constexpr, SCALE: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[e, n] = sum over expert e's sorted rows r, in order, of s_r * src[row(r), n] (fp32)."""
    e = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    start = tl.load(expert_start_ptr + e)
    count = tl.load(expert_count_ptr + e)
    rr = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)
    for r0 in range(0, count, BLOCK_R):
        rmask = (r0 + rr) < count
        r = start + r0 + rr
        src_row = r.to(tl.int64)
        if GATHER or SCALE:
            pair = tl.load(sorted_pair_ptr + r, mask=rmask, other=0)
        if GATHER:
            src_row = (pair // TOPK).to(tl.int64)
        v = tl.load(src_ptr + src_row[:, None] * stride_src + n[None, :], mask=rmask[:, None] & nmask[None, :],
                    other=0.0).to(tl.float32)
        if SCALE:
            v = v * tl.load(scale_ptr + pair, mask=rmask, other=0.0).to(tl.float32)[:, None]
        acc += v
    tl.store(out_ptr + e.to(tl.int64) * stride_oe + n, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=nmask)


_COLS = 128


def segment_sum(src, disp, out, *, gather, scale=None):
    """out [E, N] (any float dtype): per-expert sums of src rows (gathered by token if `gather`)."""
    N = out.shape[1]
    launcher(_segment_sum_kernel)[(disp.num_experts, cdiv(N, _COLS))](
        src, disp.sorted_pair, scale if scale is not None else src, out, disp.expert_start, disp.expert_count, N,
        src.stride(0), out.stride(0), TOPK=disp.top_k, GATHER=gather, SCALE=scale is not None, BLOCK_R=32,
        BLOCK_N=_COLS, num_warps=4)
    return out
