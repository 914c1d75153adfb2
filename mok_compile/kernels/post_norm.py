"""The post-expert norm (`ExpertSpec.post_norm`) over the expert outputs y in expert-sorted rows.

The down GEMM writes y per pair ([T*K, H], the inputs' dtype); the norm needs whole rows (their mean square), which
no GEMM tile holds. So a row pass takes each row's rsqrt, and the combine normalises each row as it reads it: y is
written once and read twice, and stays as it is, which lets the training forward save it for the backward (the
norm's backward reads y; without it the backward would run the down GEMM again). Same semantics as
`reference.apply_post_norm` / `post_norm_backward`, with g = `reference.post_norm_scale` (fp32, [H] shared or
[E, H]: the row of each row's expert):

    row_rsqrt        r[row] = rsqrt(mean(b^2) + eps), b = y or (y * g).to(DT), in fp32
    normalized       n of a row's values at its g and r (the combine's `norm`: `dispatch.combine`)
    backward_rows    dy[r] (the inputs' dtype), d(topk_weights) of each pair at its sorted position
                     (fp32), d(post_norm_weight) summed per expert in sorted row order (no atomics, no
                     per-row fp32 buffer)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops import reference
from .activation_pass import expert_row_ptrs
from .launch import cdiv, launcher, next_power_of_2

_ROWS = 4
_FWD_COLS, _BWD_COLS = 1024, 512  # the backward's row pass holds three row tiles at once
_EXPERT_COLS = 128  # the backward's columns per program of an expert (with 32 rows a step, as `segment_sum`)


@triton.jit
def _row_rsqrt_kernel(y_ptr, g_ptr, sorted_pair_ptr, ids_ptr, r_ptr, TK, H, stride_y, stride_ge, eps,
                      SCALED: tl.constexpr, PER_EXPERT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """r[row] = rsqrt(mean(b^2) + eps) of each sorted row, b = y (rms) or (y * g).to(DT) (SCALED), in fp32."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < TK
    y_rows = y_ptr + rows.to(tl.int64)[:, None] * stride_y
    g_rows = expert_row_ptrs(g_ptr, sorted_pair_ptr, ids_ptr, rows, rmask, stride_ge, PER_EXPERT)
    DT = y_ptr.dtype.element_ty
    ss = tl.zeros((BLOCK_M,), tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        m = rmask[:, None] & (cols < H)[None, :]
        v = tl.load(y_rows + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if SCALED:
            v = (v * tl.load(g_rows + cols[None, :], mask=m, other=0.0)).to(DT).to(tl.float32)
        ss += tl.sum(v * v, axis=1)
    tl.store(r_ptr + rows, tl.rsqrt(ss / H + eps), mask=rmask)


@triton.jit
def normalized(v, g, r, SCALED: tl.constexpr, DT: tl.constexpr):
    """n of rows v (y, read in fp32) at their scale g and rsqrt r, before its rounding to DT: rms (v * r) * g,
    SCALED (v * g).to(DT) * r (`reference.apply_post_norm`)."""
    if SCALED:
        return (v * g).to(DT).to(tl.float32) * r
    return (v * r) * g


@triton.jit
def _row_stats_kernel(y_ptr, g_ptr, go_ptr, sorted_pair_ptr, ids_ptr, r_ptr, dw_ptr, TK, H, stride_y, stride_ge,
                      stride_go, eps, K: tl.constexpr, SCALED: tl.constexpr, PER_EXPERT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """The backward's per-row scalars of sorted row r (pair p, token t = p // K), in fp32 (the norm's roundings read
    as the identity): with a = y, b = a * g (SCALED) or a, r = rsqrt(mean(b^2) + eps) and q = <go[t], a * g>, the
    row's rsqrt r and dw[r] = <go[t], n> = r * q (n unrounded), the pair's d(topk_weights)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < TK
    pair = tl.load(sorted_pair_ptr + rows, mask=rmask, other=0)
    y_rows = y_ptr + rows.to(tl.int64)[:, None] * stride_y
    go_rows = go_ptr + (pair // K).to(tl.int64)[:, None] * stride_go
    g_rows = expert_row_ptrs(g_ptr, sorted_pair_ptr, ids_ptr, rows, rmask, stride_ge, PER_EXPERT)
    ss = tl.zeros((BLOCK_M,), tl.float32)
    q = tl.zeros((BLOCK_M,), tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        m = rmask[:, None] & (cols < H)[None, :]
        a = tl.load(y_rows + cols[None, :], mask=m, other=0.0).to(tl.float32)
        ag = a * tl.load(g_rows + cols[None, :], mask=m, other=0.0)
        b = ag if SCALED else a
        ss += tl.sum(b * b, axis=1)
        q += tl.sum(tl.load(go_rows + cols[None, :], mask=m, other=0.0).to(tl.float32) * ag, axis=1)
    r = tl.rsqrt(ss / H + eps)
    tl.store(r_ptr + rows, r, mask=rmask)
    tl.store(dw_ptr + rows, r * q, mask=rmask)


@triton.jit
def _norm_grads(a, g, gov, wv, r, dw, H, SCALED: tl.constexpr):
    """(dy, dg) of rows a (y, fp32) at dn = w * go[t], from their r and dw = r * q (`_row_stats_kernel`):
    `reference.post_norm_backward`, the mean both gradients subtract, mean(du * u) (rms) or mean(dn * u) (scaled),
    being c = w * r * q / H."""
    dn = wv * gov
    c = wv * (dw / H)
    if SCALED:
        db = r * (dn - (a * g * r) * c)
        return db * g, db * a
    u = a * r
    return r * (dn * g - u * c), dn * u


@triton.jit
def _backward_experts_kernel(y_ptr, g_ptr, go_ptr, w_ptr, sorted_pair_ptr, r_ptr, dw_ptr, expert_start_ptr,
                             expert_count_ptr, dy_ptr, out_ptr, H, stride_y, stride_ge, stride_go, stride_dy,
                             stride_oe, K: tl.constexpr, SCALED: tl.constexpr, PER_EXPERT: tl.constexpr,
                             BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """One program per expert and BLOCK_H columns, over the expert's sorted rows in order: dy of each row (its
    columns; each element is read from y before this program writes it, so dy may be y) and out[e, h], the sum of
    the rows' dg (fp32; the per-expert part of d(post_norm_weight)), from y, go and the rows' r and dw."""
    e = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    g_row = g_ptr
    if PER_EXPERT:
        g_row += e.to(tl.int64) * stride_ge
    g = tl.load(g_row + cols, mask=cmask, other=0.0)[None, :]
    start = tl.load(expert_start_ptr + e)
    count = tl.load(expert_count_ptr + e)
    acc = tl.zeros((BLOCK_R, BLOCK_H), tl.float32)
    for r0 in range(0, count, BLOCK_R):
        rows = start + r0 + tl.arange(0, BLOCK_R)
        rmask = (r0 + tl.arange(0, BLOCK_R)) < count
        m = rmask[:, None] & cmask[None, :]
        pair = tl.load(sorted_pair_ptr + rows, mask=rmask, other=0)
        wv = tl.load(w_ptr + pair, mask=rmask, other=0.0).to(tl.float32)[:, None]
        r = tl.load(r_ptr + rows, mask=rmask, other=0.0)[:, None]
        dw = tl.load(dw_ptr + rows, mask=rmask, other=0.0)[:, None]
        a = tl.load(y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :], mask=m, other=0.0).to(tl.float32)
        gov = tl.load(go_ptr + (pair // K).to(tl.int64)[:, None] * stride_go + cols[None, :], mask=m,
                      other=0.0).to(tl.float32)
        dy, dg = _norm_grads(a, g, gov, wv, r, dw, H, SCALED)
        tl.store(dy_ptr + rows.to(tl.int64)[:, None] * stride_dy + cols[None, :], dy.to(dy_ptr.dtype.element_ty),
                 mask=m)
        acc += tl.where(m, dg, 0.0)
    out = tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + e.to(tl.int64) * stride_oe + cols, out, mask=cmask)


def scale(kw, weight):
    """g [H] or [E, H] fp32, contiguous (`reference.post_norm_scale`: the offset added in the weight's dtype)."""
    return reference.post_norm_scale(weight, kw["post_norm_offset"]).contiguous()


def _launch_args(y, g, kw, block_h):
    """(grid, g's stride between experts, the kernels' constants) of a pass over the rows y."""
    TK, H = y.shape
    per_expert = g.dim() == 2
    consts = dict(SCALED=kw["post_norm"] == "scaled_rms", PER_EXPERT=per_expert, BLOCK_M=_ROWS,
                  BLOCK_H=min(block_h, next_power_of_2(H)), num_warps=4)
    return (cdiv(TK, _ROWS),), g.stride(0) if per_expert else 0, consts


def row_rsqrt(y, disp, topk_ids, g, kw):
    """r [T*K] fp32: the norm's rsqrt of each sorted row of y [T*K, H] (T > 0); `g` from `scale`, `topk_ids` [T, K]
    contiguous. The combine then normalises each row as it reads it (`dispatch.combine`'s `norm`): y itself is
    left as it is, for the backward to read."""
    TK, H = y.shape
    r = torch.empty((TK,), dtype=torch.float32, device=y.device)
    grid, stride_ge, consts = _launch_args(y, g, kw, _FWD_COLS)
    launcher(_row_rsqrt_kernel)[grid](y, g, disp.sorted_pair, topk_ids, r, TK, H, y.stride(0), stride_ge,
                                      float(kw["post_norm_eps"]), **consts)
    return r


def backward_rows(y, g, go, w_flat, disp, topk_ids, weight, kw, *, dy=None):
    """(dy, dw [1, T*K] fp32, d(post_norm_weight)) of rows y [T*K, H] (sorted), grad_out `go` [T, H] and the pairs'
    weights `w_flat` [T*K]; dy is written into `dy` ([T*K, H], the inputs' dtype; may be y itself), else into a new
    tensor. dw holds each pair's d(topk_weights) at its sorted position (`routing.route_backward`'s dw_parts). The
    weight's gradient: each expert's rows summed in sorted order in fp32, as HF's autograd sums its fp32 products
    (no [T*K, H] fp32 rows stored: each expert's program computes its rows' parts from y), then for a shared [H]
    weight the experts' sums added (a fixed-shape torch sum: deterministic); in the weight's dtype. Two launches:
    the rows' r and dw, then per expert dy and the weight's gradient."""
    TK, H = y.shape
    if dy is None:
        dy = torch.empty_like(y)
    r = torch.empty((TK,), dtype=torch.float32, device=y.device)
    dw = torch.empty((1, TK), dtype=torch.float32, device=y.device)
    grid, stride_ge, consts = _launch_args(y, g, kw, _BWD_COLS)
    K, E = disp.top_k, disp.num_experts
    launcher(_row_stats_kernel)[grid](y, g, go, disp.sorted_pair, topk_ids, r, dw, TK, H, y.stride(0), stride_ge,
                                      go.stride(0), float(kw["post_norm_eps"]), K=K, **consts)
    per_expert = torch.empty((E, H), dtype=weight.dtype if weight.dim() == 2 else torch.float32, device=y.device)
    launcher(_backward_experts_kernel)[(E, cdiv(H, _EXPERT_COLS))](
        y, g, go, w_flat, disp.sorted_pair, r, dw, disp.expert_start, disp.expert_count, dy, per_expert, H,
        y.stride(0), stride_ge, go.stride(0), dy.stride(0), per_expert.stride(0), K=K, SCALED=consts["SCALED"],
        PER_EXPERT=consts["PER_EXPERT"], BLOCK_R=32, BLOCK_H=_EXPERT_COLS, num_warps=4)
    d_weight = per_expert if weight.dim() == 2 else per_expert.sum(dim=0).to(weight.dtype)
    return dy, dw, d_weight
