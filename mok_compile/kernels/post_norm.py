"""The post-expert norm (`ExpertSpec.post_norm`) as passes over the expert outputs y in expert-sorted rows.

The down GEMM writes y per pair ([T*K, H], the inputs' dtype); the norm needs whole rows (their mean square), which
no GEMM tile holds, so it is a row pass of its own between the down GEMM and the combine (the forward), and before
the backward's g2 GEMM (the backward). Same semantics as `reference.apply_post_norm` / `post_norm_backward`, with g =
`reference.post_norm_scale` (fp32, [H] shared or [E, H]: the row of each sorted row's expert):

    normalize_rows   y[r] = n(y[r]) in place, in fp32, rounded where the reference rounds
    backward_rows    dy[r] (over y, the inputs' dtype), d(topk_weights) of each pair at its sorted position
                     (fp32), d(post_norm_weight) summed per expert in sorted row order (no atomics)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops import reference
from .activation_pass import expert_row_ptrs
from .cutlass_gemm import segment_sum
from .launch import cdiv, launcher, next_power_of_2

_ROWS = 4
_FWD_COLS, _BWD_COLS = 1024, 512  # the backward holds four row tiles at once


@triton.jit
def _normalize_rows_kernel(y_ptr, g_ptr, sorted_pair_ptr, ids_ptr, TK, H, stride_y, stride_ge, eps,
                           SCALED: tl.constexpr, PER_EXPERT: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_H: tl.constexpr):
    """rms: (rms(y) * g).to(DT); SCALED: rms((y * g).to(DT)).to(DT); rms(v) = v * rsqrt(mean(v^2) + eps) in fp32.
    Two passes over each row: its mean square, then the normalised row over y (each program owns its rows)."""
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
    r = tl.rsqrt(ss / H + eps)[:, None]
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        m = rmask[:, None] & (cols < H)[None, :]
        v = tl.load(y_rows + cols[None, :], mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_rows + cols[None, :], mask=m, other=0.0)
        if SCALED:
            n = (v * g).to(DT).to(tl.float32) * r
        else:
            n = (v * r) * g
        tl.store(y_rows + cols[None, :], n.to(DT), mask=m)


@triton.jit
def _backward_rows_kernel(y_ptr, g_ptr, go_ptr, w_ptr, sorted_pair_ptr, ids_ptr, dg_ptr, dw_ptr, TK, H, stride_y,
                          stride_ge, stride_go, stride_dg, eps, K: tl.constexpr, SCALED: tl.constexpr,
                          PER_EXPERT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """`reference.post_norm_backward` of sorted row r (pair p, token t = p // K) at dn = w[p] * go[t], in fp32 (its
    roundings read as the identity): dy over y, dg[r], and dw[r] = <go[t], n> (n unrounded). With a = y, b = a * g
    (SCALED) or a, r = rsqrt(mean(b^2) + eps) and q = <go[t], a * g>: <go[t], n> = r * q, and the mean both
    gradients subtract, mean(du * u) (rms) or mean(dn * u) (scaled), is c = w * r * q / H."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < TK
    pair = tl.load(sorted_pair_ptr + rows, mask=rmask, other=0)
    wv = tl.load(w_ptr + pair, mask=rmask, other=0.0).to(tl.float32)[:, None]
    y_rows = y_ptr + rows.to(tl.int64)[:, None] * stride_y
    go_rows = go_ptr + (pair // K).to(tl.int64)[:, None] * stride_go
    dg_rows = dg_ptr + rows.to(tl.int64)[:, None] * stride_dg
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
    tl.store(dw_ptr + rows, r * q, mask=rmask)
    c = wv * (r * q / H)[:, None]
    r = r[:, None]
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        m = rmask[:, None] & (cols < H)[None, :]
        a = tl.load(y_rows + cols[None, :], mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_rows + cols[None, :], mask=m, other=0.0)
        dn = wv * tl.load(go_rows + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if SCALED:
            db = r * (dn - (a * g * r) * c)
            dy, dg = db * g, db * a
        else:
            u = a * r
            dy, dg = r * (dn * g - u * c), dn * u
        tl.store(dg_rows + cols[None, :], dg.to(dg_ptr.dtype.element_ty), mask=m)
        tl.store(y_rows + cols[None, :], dy.to(y_ptr.dtype.element_ty), mask=m)


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


def normalize_rows(y, disp, topk_ids, g, kw):
    """y [T*K, H] (sorted rows, T > 0) normalised in place; `g` from `scale`, `topk_ids` [T, K] contiguous."""
    TK, H = y.shape
    grid, stride_ge, consts = _launch_args(y, g, kw, _FWD_COLS)
    launcher(_normalize_rows_kernel)[grid](y, g, disp.sorted_pair, topk_ids, TK, H, y.stride(0), stride_ge,
                                           float(kw["post_norm_eps"]), **consts)
    return y


def backward_rows(y, g, go, w_flat, disp, topk_ids, weight, kw):
    """(dy, dw [1, T*K] fp32, d(post_norm_weight)) of rows y [T*K, H] (sorted; dy is written over them), grad_out
    `go` [T, H] and the pairs' weights `w_flat` [T*K]. dw holds each pair's d(topk_weights) at its sorted position
    (`routing.route_backward`'s dw_parts). The weight's gradient: each expert's rows summed in sorted order
    (`segment_sum`), then for a shared [H] weight the experts' fp32 sums added (a fixed-shape torch sum: deterministic);
    in the weight's dtype."""
    TK, H = y.shape
    dg_rows = torch.empty((TK, H), dtype=torch.float32, device=y.device)  # summed in fp32, as HF's autograd does
    dw = torch.empty((1, TK), dtype=torch.float32, device=y.device)
    grid, stride_ge, consts = _launch_args(y, g, kw, _BWD_COLS)
    launcher(_backward_rows_kernel)[grid](y, g, go, w_flat, disp.sorted_pair, topk_ids, dg_rows, dw, TK, H,
                                          y.stride(0), stride_ge, go.stride(0), dg_rows.stride(0),
                                          float(kw["post_norm_eps"]), K=disp.top_k, **consts)
    E = disp.num_experts
    if weight.dim() == 2:
        d_weight = segment_sum(dg_rows, disp, torch.empty((E, H), dtype=weight.dtype, device=y.device), gather=False)
    else:
        per_expert = segment_sum(dg_rows, disp, torch.empty((E, H), dtype=torch.float32, device=y.device),
                                 gather=False)
        d_weight = per_expert.sum(dim=0).to(weight.dtype)
    return y, dw, d_weight
