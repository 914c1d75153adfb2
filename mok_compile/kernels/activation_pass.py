"""The gate_up activation and its derivative as passes over a stored h (rows in expert-sorted order).

Used where h exists in memory instead of only in a GEMM's registers: after the CUTLASS gathered
GEMM (`cutlass_gemm.py`), and in the backward when the training forward saved h
(`mok::fused_moe_train`). Same rounding as the Triton epilogues of `grouped_gemm.py`: h is the
rounded product before bias; the forward adds the bias and applies the activation op by op in the
input dtype; the backward works in fp32 like `_gate_up_bwd_kernel`.

    activation_rows        act(h (+ b1)) per sorted row
    activation_bwd_rows    dh, w * act(h), partial d(topk_weights) per I-tile, from h and g2
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activation import _r, act_backward, act_forward, act_value_fp32
from .launch import cdiv, launcher


@triton.jit
def _load_gate_up(h_ptr, rows64, rmask, n0, I, stride_h, bias_rows, col_mul, up_off, GATED: tl.constexpr,
                  INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(gate, up) [BM, BN] in fp32 from the stored h, each + its bias in fp32 (`bias_rows` [BM, 1]: the
    row's expert bias); ungated: up = gate. Interleaved columns are read as one contiguous [BM, 2BN] run."""
    if INTERLEAVED:
        cols = 2 * n0 + tl.arange(0, 2 * BLOCK_N)
        m = rmask[:, None] & (cols < 2 * I)[None, :]
        v = tl.load(h_ptr + rows64 * stride_h + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            v += tl.load(bias_rows + cols[None, :], mask=m, other=0.0).to(tl.float32)
        g, u = tl.split(tl.reshape(v, (v.shape[0], BLOCK_N, 2)))
    else:
        n = n0 + tl.arange(0, BLOCK_N)
        m = rmask[:, None] & (n < I)[None, :]
        g = tl.load(h_ptr + rows64 * stride_h + (n * col_mul)[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            g += tl.load(bias_rows + (n * col_mul)[None, :], mask=m, other=0.0).to(tl.float32)
        u = g
        if GATED:
            cu = n * col_mul + up_off
            u = tl.load(h_ptr + rows64 * stride_h + cu[None, :], mask=m, other=0.0).to(tl.float32)
            if HAS_BIAS:
                u += tl.load(bias_rows + cu[None, :], mask=m, other=0.0).to(tl.float32)
    return g, u


@triton.jit
def expert_row_ptrs(bias_ptr, sorted_pair_ptr, ids_ptr, rows, rmask, stride_be, HAS_BIAS: tl.constexpr):
    """[BM, 1] pointers to the row of each sorted row's expert in a per-expert tensor (a bias, a norm weight):
    its expert's (ids at the row's pair) where HAS_BIAS, else bias_ptr itself (no bias, or one shared row)."""
    if HAS_BIAS:
        pair = tl.load(sorted_pair_ptr + rows, mask=rmask, other=0)
        e = tl.load(ids_ptr + pair, mask=rmask, other=0)
        return bias_ptr + e.to(tl.int64)[:, None] * stride_be
    return bias_ptr + tl.zeros((rows.shape[0], 1), tl.int64)


@triton.jit
def _activation_rows_kernel(h_ptr, sorted_pair_ptr, ids_ptr, bias_ptr, out_ptr, TK, I, stride_h, stride_out,
                            stride_be, col_mul, up_off, alpha, limit, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
                            ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr):
    """out[r, n] = act(gate (+ b), up (+ b)) rounded op by op as the Triton gate_up epilogue does."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n0 = tl.program_id(1) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    rmask = rows < TK
    rows64 = rows.to(tl.int64)[:, None]
    DT = out_ptr.dtype.element_ty
    bias_rows = expert_row_ptrs(bias_ptr, sorted_pair_ptr, ids_ptr, rows, rmask, stride_be, HAS_BIAS)
    g, u = _load_gate_up(h_ptr, rows64, rmask, n0, I, stride_h, bias_rows, col_mul, up_off, GATED, INTERLEAVED,
                         HAS_BIAS, BLOCK_N)
    # h is already rounded; the bias add is one more rounded op (identity without a bias)
    a = act_forward(_r(g, DT), _r(u, DT), alpha, limit, ACT, DT)
    tl.store(out_ptr + rows64 * stride_out + n[None, :], a.to(DT), mask=rmask[:, None] & (n < I)[None, :])


@triton.jit
def _activation_bwd_rows_kernel(h_ptr, g2_ptr, w_ptr, sorted_pair_ptr, ids_ptr, bias_ptr, dh_ptr, act_ptr,
                                dw_part_ptr, TK, I, stride_h, stride_g2, stride_dh, stride_act, stride_be, col_mul,
                                up_off, alpha, limit, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
                                ACT: tl.constexpr, HAS_BIAS: tl.constexpr, UNIT_WEIGHTS: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The epilogue of the Triton `_gate_up_bwd_kernel` as its own pass over the stored h:
    dw_part[pid_n, r] = sum_n g2 * act(h), dh = act'(h) * (w * g2), act_w = w * act(h).
    Each program reads its tile before writing the same tile, so dh may alias h and act_w g2.
    UNIT_WEIGHTS: w = 1 and no dw parts (g2 is already weighted: a post-expert norm's dy gives them)."""
    pid_n = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n0 = pid_n * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    rmask = rows < TK
    om = rmask[:, None] & (n < I)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    bias_rows = expert_row_ptrs(bias_ptr, sorted_pair_ptr, ids_ptr, rows, rmask, stride_be, HAS_BIAS)
    g, u = _load_gate_up(h_ptr, rows64, rmask, n0, I, stride_h, bias_rows, col_mul, up_off, GATED, INTERLEAVED,
                         HAS_BIAS, BLOCK_N)
    g2 = tl.load(g2_ptr + rows64 * stride_g2 + n[None, :], mask=om, other=0.0).to(tl.float32)
    if UNIT_WEIGHTS:
        wv = tl.full((BLOCK_M,), 1.0, tl.float32)
    else:
        pair = tl.load(sorted_pair_ptr + rows, mask=rmask, other=0)
        wv = tl.load(w_ptr + pair, mask=rmask, other=0.0).to(tl.float32)
    a = tl.where(om, act_value_fp32(g, u, alpha, limit, ACT), 0.0)
    if not UNIT_WEIGHTS:
        tl.store(dw_part_ptr + pid_n.to(tl.int64) * TK + rows, tl.sum(g2 * a, axis=1), mask=rmask)
    dg, du = act_backward(g, u, g2 * wv[:, None], alpha, limit, ACT)
    DT = dh_ptr.dtype.element_ty
    if INTERLEAVED:
        cols = 2 * n0 + tl.arange(0, 2 * BLOCK_N)
        d = tl.reshape(tl.join(dg, du), (BLOCK_M, 2 * BLOCK_N))
        tl.store(dh_ptr + rows64 * stride_dh + cols[None, :], d.to(DT), mask=rmask[:, None] & (cols < 2 * I)[None, :])
    else:
        tl.store(dh_ptr + rows64 * stride_dh + (n * col_mul)[None, :], dg.to(DT), mask=om)
        if GATED:
            tl.store(dh_ptr + rows64 * stride_dh + (n * col_mul + up_off)[None, :], du.to(DT), mask=om)
    tl.store(act_ptr + rows64 * stride_act + n[None, :], (a * wv[:, None]).to(act_ptr.dtype.element_ty), mask=om)


_ROWS, _COLS = 32, 128
# The backward pass moves twice the bytes per element of the forward's and holds more tiles in registers:
# 16 x 128 blocks (interleaved gate/up: 8 x 64, i.e. 128 stored columns per row), measured on an H200
# (NOTES-gpu v16): 3.7-3.9 TB/s at the Qwen3 and Mixtral shapes against 3.0-3.2 with 32 x 128, and 3.4
# against 2.0 TB/s at GPT-OSS' interleaved one.
_BWD_BLOCKS = {False: (16, 128), True: (8, 64)}


def activation_rows(h, disp, topk_ids, bias, I, *, gated, interleaved, act, col_mul, up_off, alpha, limit):
    TK = h.shape[0]
    out = torch.empty((TK, I), dtype=h.dtype, device=h.device)
    launcher(_activation_rows_kernel)[(cdiv(TK, _ROWS), cdiv(I, _COLS))](
        h, disp.sorted_pair, topk_ids, bias if bias is not None else h, out, TK, I, h.stride(0), out.stride(0),
        bias.stride(0) if bias is not None else 0, col_mul, up_off, alpha, limit, GATED=gated,
        INTERLEAVED=gated and interleaved, ACT=act, HAS_BIAS=bias is not None, BLOCK_M=_ROWS, BLOCK_N=_COLS,
        num_warps=4)
    return out


def activation_bwd_rows(h, g2, w_flat, disp, topk_ids, bias, I, *, gated, interleaved, act, col_mul, up_off, alpha,
                        limit, h_is_saved=False):
    """(dh, w * act, dw_parts [cdiv(I, block columns), TK] fp32); w * act is written over g2 and dh over h (both dead
    afterwards, which keeps the backward's peak memory at one [TK, 2I] + one [TK, I] buffer), except
    over a saved h (`h_is_saved`: autograd's saved tensor must survive for a retained graph).
    `w_flat=None`: unit weights, and no dw parts (None)."""
    TK = h.shape[0]
    rows, cols = _BWD_BLOCKS[bool(gated and interleaved)]
    n_parts = cdiv(I, cols)
    unit = w_flat is None
    dw_parts = None if unit else torch.empty((n_parts, TK), dtype=torch.float32, device=h.device)
    dh = torch.empty_like(h) if h_is_saved else h
    launcher(_activation_bwd_rows_kernel)[(cdiv(TK, rows), n_parts)](
        h, g2, h if unit else w_flat, disp.sorted_pair, topk_ids, bias if bias is not None else h, dh, g2,
        h if unit else dw_parts, TK, I, h.stride(0), g2.stride(0), dh.stride(0), g2.stride(0),
        bias.stride(0) if bias is not None else 0, col_mul, up_off, alpha, limit, GATED=gated,
        INTERLEAVED=gated and interleaved, ACT=act, HAS_BIAS=bias is not None, UNIT_WEIGHTS=unit, BLOCK_M=rows,
        BLOCK_N=cols, num_warps=4)
    return dh, g2, dw_parts
