"""Expert GEMMs through PyTorch's grouped GEMM (`torch.nn.functional.grouped_mm`, CUTLASS on Hopper).

Why a second engine: CUTLASS's grouped GEMM (TMA loads, warp-specialised wgmma, persistent
tiles) beats our Triton tiles where experts get many rows (Mixtral: ~1000+ rows per expert)
and in the weight gradients. It reads its A operand in expert-sorted order from memory, so
a gathered GEMM here pays one row gather (`gather_rows`) and the gate_up activation is its
own pass over h (`activation_rows`, the same rounding as the Triton epilogue) instead of an
epilogue; `configs.engine` weighs that against the faster GEMM per stage.

Same sorted layout as `dispatch.py`: expert e's rows are [expert_start[e], expert_end[e]).
Deterministic (no split-K: every output tile is one reduction in a fixed order) and no host
synchronisation (group offsets stay on the device), like the Triton kernels.

    grouped_mm(a, w_kn, disp)   C[rows of e] = A[rows of e] @ w_kn[e]        (w_kn [E, k, n])
    wgrad(p, q, disp)           C[e] = P[rows of e]^T @ Q[rows of e]         ([E, p, q])
    activation_rows             act(h (+ b1)) per sorted row
    activation_bwd_rows         dh, w * act(h), partial d(topk_weights) from h and g2
    segment_sum                 bias gradients: per-expert column sums of (gathered, scaled) rows
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .activation import _r, act_backward, act_forward, act_value_fp32

_grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@functools.cache
def _is_hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def eligible(x, gate_up_proj, down_proj, I, weight_on_input, check_alignment=True) -> bool:
    """Whether this call can use CUTLASS: bf16 on Hopper (where PyTorch runs its sm90 CUTLASS kernel and
    what we measured), every row 16-byte aligned (H, I multiples of 8), contiguous weights.
    `check_alignment=False`: everything but the data pointers (fake tensors have none); `aligned_weights`
    then copies a misaligned weight."""
    return (_grouped_mm is not None and x.is_cuda and x.dtype == torch.bfloat16 and not weight_on_input
            and _is_hopper(x.device.index if x.device.index is not None else torch.cuda.current_device())
            and x.shape[1] % 8 == 0 and I % 8 == 0
            and gate_up_proj.dtype == down_proj.dtype == torch.bfloat16
            and gate_up_proj.is_contiguous() and down_proj.is_contiguous()
            and (not check_alignment or (_aligned(gate_up_proj) and _aligned(down_proj))))


def aligned_weights(w):
    """`w`, or an aligned copy of it when its data pointer is not 16-byte aligned (rare: a view at an odd offset)."""
    return w if _aligned(w) else w.clone()


def gather_rows(x, disp):
    """x[token of each sorted pair]: the A operand of a gathered GEMM, in expert-sorted order."""
    return x.index_select(0, disp.sorted_token())


def grouped_mm(a, w_kn, disp):
    return _grouped_mm(a, w_kn, offs=disp.expert_end)


def wgrad(p, q, disp):
    return _grouped_mm(p.t(), q, offs=disp.expert_end)


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
def _bias_rows(bias_ptr, sorted_pair_ptr, ids_ptr, rows, rmask, stride_be, HAS_BIAS: tl.constexpr):
    """[BM, 1] pointers to the bias row of each sorted row's expert (bias_ptr itself without biases)."""
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
    bias_rows = _bias_rows(bias_ptr, sorted_pair_ptr, ids_ptr, rows, rmask, stride_be, HAS_BIAS)
    g, u = _load_gate_up(h_ptr, rows64, rmask, n0, I, stride_h, bias_rows, col_mul, up_off, GATED, INTERLEAVED,
                         HAS_BIAS, BLOCK_N)
    # h is already rounded; the bias add is one more rounded op (identity without a bias)
    a = act_forward(_r(g, DT), _r(u, DT), alpha, limit, ACT, DT)
    tl.store(out_ptr + rows64 * stride_out + n[None, :], a.to(DT), mask=rmask[:, None] & (n < I)[None, :])


@triton.jit
def _activation_bwd_rows_kernel(h_ptr, g2_ptr, w_ptr, sorted_pair_ptr, ids_ptr, bias_ptr, dh_ptr, act_ptr,
                                dw_part_ptr, TK, I, stride_h, stride_g2, stride_dh, stride_act, stride_be, col_mul,
                                up_off, alpha, limit, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
                                ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr):
    """The epilogue of the Triton `_gate_up_bwd_kernel` as its own pass over the stored h:
    dw_part[pid_n, r] = sum_n g2 * act(h), dh = act'(h) * (w * g2), act_w = w * act(h).
    Each program reads its tile before writing the same tile, so dh may alias h and act_w g2."""
    pid_n = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n0 = pid_n * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    rmask = rows < TK
    om = rmask[:, None] & (n < I)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    bias_rows = _bias_rows(bias_ptr, sorted_pair_ptr, ids_ptr, rows, rmask, stride_be, HAS_BIAS)
    g, u = _load_gate_up(h_ptr, rows64, rmask, n0, I, stride_h, bias_rows, col_mul, up_off, GATED, INTERLEAVED,
                         HAS_BIAS, BLOCK_N)
    g2 = tl.load(g2_ptr + rows64 * stride_g2 + n[None, :], mask=om, other=0.0).to(tl.float32)
    pair = tl.load(sorted_pair_ptr + rows, mask=rmask, other=0)
    wv = tl.load(w_ptr + pair, mask=rmask, other=0.0).to(tl.float32)
    a = tl.where(om, act_value_fp32(g, u, alpha, limit, ACT), 0.0)
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


_ROWS, _COLS = 32, 128


def activation_rows(h, disp, topk_ids, bias, I, *, gated, interleaved, act, col_mul, up_off, alpha, limit):
    TK = h.shape[0]
    out = torch.empty((TK, I), dtype=h.dtype, device=h.device)
    _activation_rows_kernel[(triton.cdiv(TK, _ROWS), triton.cdiv(I, _COLS))](
        h, disp.sorted_pair, topk_ids, bias if bias is not None else h, out, TK, I, h.stride(0), out.stride(0),
        bias.stride(0) if bias is not None else 0, col_mul, up_off, alpha, limit, GATED=gated,
        INTERLEAVED=gated and interleaved, ACT=act, HAS_BIAS=bias is not None, BLOCK_M=_ROWS, BLOCK_N=_COLS,
        num_warps=4)
    return out


def activation_bwd_rows(h, g2, w_flat, disp, topk_ids, bias, I, *, gated, interleaved, act, col_mul, up_off, alpha,
                        limit, h_is_saved=False):
    """(dh, w * act, dw_parts [cdiv(I, 128), TK] fp32); w * act is written over g2 and dh over h (both dead
    afterwards, which keeps the backward's peak memory at one [TK, 2I] + one [TK, I] buffer), except
    over a saved h (`h_is_saved`: autograd's saved tensor must survive for a retained graph)."""
    TK = h.shape[0]
    n_parts = triton.cdiv(I, _COLS)
    dw_parts = torch.empty((n_parts, TK), dtype=torch.float32, device=h.device)
    dh = torch.empty_like(h) if h_is_saved else h
    _activation_bwd_rows_kernel[(triton.cdiv(TK, _ROWS), n_parts)](
        h, g2, w_flat, disp.sorted_pair, topk_ids, bias if bias is not None else h, dh, g2, dw_parts, TK, I,
        h.stride(0), g2.stride(0), dh.stride(0), g2.stride(0), bias.stride(0) if bias is not None else 0,
        col_mul, up_off, alpha, limit, GATED=gated, INTERLEAVED=gated and interleaved, ACT=act,
        HAS_BIAS=bias is not None, BLOCK_M=_ROWS, BLOCK_N=_COLS, num_warps=4)
    return dh, g2, dw_parts


def segment_sum(src, disp, out, *, gather, scale=None):
    """out [E, N] (any float dtype): per-expert sums of src rows (gathered by token if `gather`)."""
    N = out.shape[1]
    _segment_sum_kernel[(disp.num_experts, triton.cdiv(N, _COLS))](
        src, disp.sorted_pair, scale if scale is not None else src, out, disp.expert_start, disp.expert_count, N,
        src.stride(0), out.stride(0), TOPK=disp.top_k, GATHER=gather, SCALE=scale is not None, BLOCK_R=32,
        BLOCK_N=_COLS, num_warps=4)
    return out
