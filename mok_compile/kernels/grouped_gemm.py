"""Grouped GEMMs over the expert-sorted pairs (see `dispatch.py` for the layout).

Three kernels, each with an upper-bound grid whose surplus programs exit at once
(the real number of row blocks depends on routing, which the host never reads):

- `_grouped_gemm_kernel`: C[rows] = A[rows] @ W[e] for the row block's expert e,
  A optionally gathered by token (the dispatch gather fused into the A loads).
  Gated experts keep gate and up accumulators in the same program, so the
  activation runs in the epilogue and only I (not 2I) columns are written.
  Used for forward gate_up, forward down and backward d(pairs' inputs).
- `_bwd_hidden_kernel`: the backward's middle: recomputes gate_up
  (x @ W1) and computes go @ W2^T for the same rows and I-tile in one K loop
  over H, then d(activation) in the epilogue, so h is never stored.
- `_wgrad_kernel`: per-expert weight gradient; each program owns one output
  tile and reduces over its expert's rows in sorted order (deterministic,
  no atomics); the bias gradient rides along in the programs of the first tile column.

Weights may be in F.linear layout or transposed: kernels take (k, n) strides.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .activation import act_backward, act_forward, act_value_fp32, _r


@triton.jit
def _expert_of_block(expert_count_ptr, expert_start_ptr, pid_m, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, first row, end row) of row block pid_m; expert == E for surplus programs."""
    cols = tl.arange(0, BLOCK_E)
    cmask = cols < E
    cnt = tl.load(expert_count_ptr + cols, mask=cmask, other=0)
    nblk = (cnt + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(nblk, axis=0)
    e = tl.sum((cum <= pid_m).to(tl.int32), axis=0)
    sel = cols == e
    first = tl.sum(tl.where(sel, cum - nblk, 0), axis=0)
    count = tl.sum(tl.where(sel, cnt, 0), axis=0)
    start = tl.sum(tl.where(sel, tl.load(expert_start_ptr + cols, mask=cmask, other=0), 0), axis=0)
    return e, start + (pid_m - first) * BLOCK_M, start + count


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, sorted_pair_ptr, b_ptr, bias_ptr, c_ptr, expert_count_ptr, expert_start_ptr,
    N, KD, E, stride_am, stride_be, stride_bk, stride_bn, stride_bias_e, stride_cm,
    col_mul, up_off, alpha, limit,
    TOPK: tl.constexpr, A_GATHER: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    e, row0, row_end = _expert_of_block(expert_count_ptr, expert_start_ptr, pid_m, E, BLOCK_M, BLOCK_E)
    if e >= E:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    if A_GATHER:
        a_rows = tl.load(sorted_pair_ptr + rows, mask=rmask, other=0) // TOPK
    else:
        a_rows = rows
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    col_g = n * col_mul
    col_u = col_g + up_off
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + kk[None, :]
    b_base = b_ptr + e.to(tl.int64) * stride_be + kk[:, None] * stride_bk
    bg_ptrs = b_base + col_g[None, :] * stride_bn
    bu_ptrs = b_base + col_u[None, :] * stride_bn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, KD, BLOCK_K):
        kmask = (k0 + kk) < KD
        a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
        bmask = kmask[:, None] & nmask[None, :]
        acc_g = tl.dot(a, tl.load(bg_ptrs, mask=bmask, other=0.0), acc_g, input_precision=PRECISION)
        if GATED:
            acc_u = tl.dot(a, tl.load(bu_ptrs, mask=bmask, other=0.0), acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        bg_ptrs += BLOCK_K * stride_bk
        bu_ptrs += BLOCK_K * stride_bk

    # Epilogue, rounding where HF's module holds a tensor in the input dtype: the projection's
    # output, the bias add, then each op of the activation.
    DT = c_ptr.dtype.element_ty
    g = _r(acc_g, DT)
    if HAS_BIAS:
        bias_base = bias_ptr + e.to(tl.int64) * stride_bias_e
        g = _r(g + tl.load(bias_base + col_g, mask=nmask, other=0.0).to(tl.float32)[None, :], DT)
    if ACT > 0:
        u = g
        if GATED:
            u = _r(acc_u, DT)
            if HAS_BIAS:
                u = _r(u + tl.load(bias_base + col_u, mask=nmask, other=0.0).to(tl.float32)[None, :], DT)
        g = act_forward(g, u, alpha, limit, ACT, DT)
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + n[None, :]
    tl.store(c_ptrs, g.to(DT), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _bwd_hidden_kernel(
    x_ptr, go_ptr, sorted_pair_ptr, w_ptr, w1_ptr, b1_ptr, w2_ptr, dh_ptr, act_ptr, dw_part_ptr,
    expert_count_ptr, expert_start_ptr,
    I, H, E, TK, stride_xm, stride_gm, stride_w1e, stride_w1k, stride_w1n, stride_b1e,
    stride_w2e, stride_w2k, stride_w2n, stride_dhm, stride_am, col_mul, up_off, alpha, limit,
    TOPK: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """For each pair row r (token t, weight w) and I-tile n:
         h = x[t] @ W1[e] (+ b1)          recomputed, gate and up
         g2 = go[t] @ W2[e]^T             d(expert output) before the routing weight
         dw_part[pid_n, r] = sum_n g2 * act(h)    (d topk_weight, partial over I-tiles)
         dh = act'(h) * (w * g2);  act(h) stored for dW2."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(I, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    e, row0, row_end = _expert_of_block(expert_count_ptr, expert_start_ptr, pid_m, E, BLOCK_M, BLOCK_E)
    if e >= E:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    pair = tl.load(sorted_pair_ptr + rows, mask=rmask, other=0)
    tok = (pair // TOPK).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    col_g = n * col_mul
    col_u = col_g + up_off
    kk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * stride_xm + kk[None, :]
    go_ptrs = go_ptr + tok[:, None] * stride_gm + kk[None, :]
    w1_base = w1_ptr + e.to(tl.int64) * stride_w1e + kk[:, None] * stride_w1k
    w1g_ptrs = w1_base + col_g[None, :] * stride_w1n
    w1u_ptrs = w1_base + col_u[None, :] * stride_w1n
    w2_ptrs = w2_ptr + e.to(tl.int64) * stride_w2e + kk[:, None] * stride_w2k + n[None, :] * stride_w2n
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_d = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kmask = (k0 + kk) < H
        am = rmask[:, None] & kmask[None, :]
        bm = kmask[:, None] & nmask[None, :]
        xa = tl.load(x_ptrs, mask=am, other=0.0)
        ga = tl.load(go_ptrs, mask=am, other=0.0)
        acc_g = tl.dot(xa, tl.load(w1g_ptrs, mask=bm, other=0.0), acc_g, input_precision=PRECISION)
        if GATED:
            acc_u = tl.dot(xa, tl.load(w1u_ptrs, mask=bm, other=0.0), acc_u, input_precision=PRECISION)
        acc_d = tl.dot(ga, tl.load(w2_ptrs, mask=bm, other=0.0), acc_d, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        go_ptrs += BLOCK_K
        w1g_ptrs += BLOCK_K * stride_w1k
        w1u_ptrs += BLOCK_K * stride_w1k
        w2_ptrs += BLOCK_K * stride_w2k

    g = acc_g
    u = acc_g
    if HAS_BIAS:
        b1 = b1_ptr + e.to(tl.int64) * stride_b1e
        g = g + tl.load(b1 + col_g, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if GATED:
        u = acc_u
        if HAS_BIAS:
            u = u + tl.load(b1 + col_u, mask=nmask, other=0.0).to(tl.float32)[None, :]
    om = rmask[:, None] & nmask[None, :]
    a = tl.where(om, act_value_fp32(g, u, alpha, limit, ACT), 0.0)
    tl.store(dw_part_ptr + pid_n.to(tl.int64) * TK + rows, tl.sum(acc_d * a, axis=1), mask=rmask)
    wv = tl.load(w_ptr + pair, mask=rmask, other=0.0).to(tl.float32)
    dg, du = act_backward(g, u, acc_d * wv[:, None], alpha, limit, ACT)
    DT = dh_ptr.dtype.element_ty
    dh_rows = dh_ptr + rows.to(tl.int64)[:, None] * stride_dhm
    tl.store(dh_rows + col_g[None, :], dg.to(DT), mask=om)
    if GATED:
        tl.store(dh_rows + col_u[None, :], du.to(DT), mask=om)
    tl.store(act_ptr + rows.to(tl.int64)[:, None] * stride_am + n[None, :], a.to(act_ptr.dtype.element_ty), mask=om)


@triton.jit
def _wgrad_kernel(
    p_ptr, q_ptr, sorted_pair_ptr, scale_ptr, c_ptr, dbias_ptr, expert_count_ptr, expert_start_ptr,
    P, Q, stride_pm, stride_qm, stride_ce, stride_cp, stride_cq, stride_dbe,
    TOPK: tl.constexpr, P_GATHER: tl.constexpr, Q_GATHER: tl.constexpr, P_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """C[e, p, q] = sum over expert e's rows r (in sorted order) of P[r, p] * Q[r, q];
    P/Q rows are gathered by token where flagged, P scaled by the pair's routing weight where flagged;
    dbias[e, p] = sum_r P[r, p] from the programs of the first q tile."""
    pid = tl.program_id(0)
    num_p = tl.cdiv(P, BLOCK_P)
    num_q = tl.cdiv(Q, BLOCK_Q)
    e = pid // (num_p * num_q)
    rest = pid % (num_p * num_q)
    pid_p = rest // num_q
    pid_q = rest % num_q
    start = tl.load(expert_start_ptr + e)
    count = tl.load(expert_count_ptr + e)
    pc = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    qc = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    pmask = pc < P
    qmask = qc < Q
    rr = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_P, BLOCK_Q), tl.float32)
    bacc = tl.zeros((BLOCK_P,), tl.float32)
    DT = p_ptr.dtype.element_ty
    for r0 in range(0, count, BLOCK_R):
        rmask = (r0 + rr) < count
        r = start + r0 + rr
        pair = tl.load(sorted_pair_ptr + r, mask=rmask, other=0)
        tok = (pair // TOPK).to(tl.int64)
        prow = r.to(tl.int64)
        qrow = r.to(tl.int64)
        if P_GATHER:
            prow = tok
        if Q_GATHER:
            qrow = tok
        pt = tl.load(p_ptr + prow[None, :] * stride_pm + pc[:, None], mask=pmask[:, None] & rmask[None, :],
                     other=0.0)  # [BLOCK_P, BLOCK_R]
        if P_SCALE:
            pf = pt.to(tl.float32) * tl.load(scale_ptr + pair, mask=rmask, other=0.0).to(tl.float32)[None, :]
            pt = pf.to(DT)
        else:
            pf = pt.to(tl.float32)
        if HAS_BIAS:
            if pid_q == 0:
                bacc += tl.sum(pf, axis=1)
        qt = tl.load(q_ptr + qrow[:, None] * stride_qm + qc[None, :], mask=rmask[:, None] & qmask[None, :],
                     other=0.0)  # [BLOCK_R, BLOCK_Q]
        acc = tl.dot(pt, qt, acc, input_precision=PRECISION)
    c_ptrs = c_ptr + e.to(tl.int64) * stride_ce + pc[:, None].to(tl.int64) * stride_cp + qc[None, :] * stride_cq
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=pmask[:, None] & qmask[None, :])
    if HAS_BIAS:
        if pid_q == 0:
            tl.store(dbias_ptr + e.to(tl.int64) * stride_dbe + pc, bacc.to(dbias_ptr.dtype.element_ty), mask=pmask)
