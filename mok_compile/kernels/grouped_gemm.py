"""Grouped GEMMs over the expert-sorted pairs (see `dispatch.py` for the layout).

Three kernels, each with an upper-bound grid whose surplus programs exit at once
(the real number of row blocks depends on routing, which the host never reads). The grouped GEMMs read
their row block's expert and rows from `Dispatch.block_table` (built once per call and block height).

- `_grouped_gemm_kernel`: C[rows] = A[rows] @ W[e] for the row block's expert e,
  A optionally gathered by token (the dispatch gather fused into the A loads).
  Gated experts keep gate and up accumulators in the same program, so the
  activation runs in the epilogue and only I (not 2I) columns are written.
  Used for forward gate_up, forward down and backward d(pairs' inputs).
- `_gate_up_bwd_kernel`: the backward's middle: recomputes gate_up (x @ W1)
  and, in its epilogue, takes d(activation) with g2 = go @ W2^T from a plain
  gathered GEMM launched before it, so h is never stored.
- `_wgrad_kernel`: per-expert weight gradient; each program owns one output
  tile (or, PERSISTENT, a strided share of them) and reduces over its expert's rows
  in sorted order (deterministic, no atomics); the bias gradient rides along in the
  programs of the first tile column. On Hopper its tiles may be stored through TMA
  (`c_desc`): at a few rows per expert the kernel is bound by writing the gradients.
  (A runtime `if pid_q == 0` around that bias sum inside the pipelined K loop gave
  run-to-run different weight gradients on an H200 with Triton 3.6, so every program
  sums and only the first column's programs store.)

Weights may be in F.linear layout or transposed: kernels take (k, n) strides. On Hopper a grouped
GEMM may read its B tiles through TMA instead (`b_desc`, `_mainloop_tma`; chosen per config).

Row blocks are BLOCK_M rows of one expert, so an expert's last block is usually partly empty. With
HALF_TAIL, the first two kernels run a block of at most BLOCK_M // 2 rows at that height: the row
block -> (expert, rows) mapping and the grid stay the same; only that program's tile (`_gemm_tile`,
`_gate_up_bwd_tile`, the height a constexpr: both heights in one kernel) is half as tall.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .activation import _r, act_backward, act_forward, act_value_fp32


@triton.jit
def _block_of(block_table_ptr, pid_m):
    """(expert, first row, end row) of row block pid_m from `Dispatch.block_table`; expert == E for surplus
    programs."""
    entry = block_table_ptr + 4 * pid_m
    return tl.load(entry), tl.load(entry + 1), tl.load(entry + 2)


@triton.jit
def _tile_of(pid, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, N tile) of program pid, GROUP_M row blocks at a time: the programs running together share
    a few row blocks' weight tiles in L2 (row block fastest within a group, then N tile). Row block fastest
    over all N tiles instead made every row block of a wide expert re-read its weights from DRAM (Mixtral:
    112 N tiles of one row block fill the GPU, and the expert's 8 row blocks run one after another)."""
    num_n = tl.cdiv(N, BLOCK_N)
    num_m = tl.num_programs(0) // num_n
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def _mainloop(a_ptr, a_rows, rmask, stride_am, b_ptr, stride_bk, stride_bn, n0, N, KD, col_mul, up_off,
              GATED: tl.constexpr, INTERLEAVED: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, a_scale_ptrs=None, A_SCALE: tl.constexpr = False,
              b_desc=None, e=None, B_KN: tl.constexpr = False, B_BLOCKED: tl.constexpr = False):
    """acc = A[a_rows, :] @ B[:, cols] over KD, B[k, c] at b_ptr + k*stride_bk + c*stride_bn.

    Gated: one [BLOCK_K, 2*BLOCK_N] B tile whose column 2i is gate column (n0+i)*col_mul and column
    2i+1 the matching up column, so gate and up come out of a single wide dot (the matrix unit's
    best shape) and `tl.split` of the [BM, BN, 2] view separates them in the epilogue.

    A_SCALE (weight on input): each A row is multiplied by its scale (`a_scale_ptrs`, one per row)
    in fp32 and rounded to A's dtype before the dot, as `(x * w).to(x.dtype)` is in PyTorch.

    B_BLOCKED (gated, gate and up as column blocks): the tile holds gate n0.. then up n0.. as two
    runs, and the result is permuted to the order above. Per-thread loads take it for a
    [k, n]-contiguous weight, e.g. Llama4's [E, H, 2I] (alternating columns would be I apart: one
    load per element); TMA for either layout (one 4-d box, `_mainloop_tma`).

    b_desc (a TMA descriptor of all experts' weights, `_weight_descriptor`): B tiles come from the
    Hopper tensor-memory accelerator instead of per-thread loads; see `_mainloop_tma`."""
    if b_desc is not None:
        acc = _mainloop_tma(a_ptr, a_rows, rmask, stride_am, b_desc, e, n0, KD, GATED, B_KN, PRECISION, BLOCK_M,
                            BLOCK_N, BLOCK_K, GATED and B_BLOCKED)
    else:
        if GATED and B_BLOCKED:
            jj = tl.arange(0, 2 * BLOCK_N)
            ncol = n0 + jj % BLOCK_N
            cols = ncol + (jj // BLOCK_N) * up_off
            acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), tl.float32)
        elif GATED:
            jj = tl.arange(0, 2 * BLOCK_N)
            ncol = n0 + jj // 2
            if INTERLEAVED:
                # Same columns as below, written so that the compiler sees 2*BLOCK_N contiguous columns:
                # with the [E, H, 2I] layout, (n0 + jj//2) * 2 + jj % 2 made it load B element by element
                # (GPT-OSS ran at a third of the speed of the other shapes).
                cols = 2 * n0 + jj
            else:
                cols = ncol * col_mul + (jj % 2) * up_off
            acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), tl.float32)
        else:
            ncol = n0 + tl.arange(0, BLOCK_N)
            cols = ncol
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        nmask = ncol < N
        kk = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + kk[None, :]
        b_ptrs = b_ptr + kk[:, None] * stride_bk + cols[None, :] * stride_bn
        if A_SCALE:
            a_scale = tl.load(a_scale_ptrs, mask=rmask, other=0.0).to(tl.float32)
        for k0 in range(0, KD, BLOCK_K):
            kmask = (k0 + kk) < KD
            a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
            if A_SCALE:
                a = (a.to(tl.float32) * a_scale[:, None]).to(a_ptr.dtype.element_ty)
            b = tl.load(b_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_bk
    if GATED and B_BLOCKED:  # [gate block | up block] -> gate n, up n, gate n+1, ...
        acc = tl.reshape(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)), (BLOCK_M, 2 * BLOCK_N))
    return acc


@triton.jit
def _mainloop_tma(a_ptr, a_rows, rmask, stride_am, b_desc, e, n0, KD, GATED: tl.constexpr, B_KN: tl.constexpr,
                  PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GATE_UP_BOX: tl.constexpr = False):
    """`_mainloop` with B from a descriptor ([E, k, n] if B_KN, else [E, n, k]); A stays a per-thread
    (gathered) load. Gated weights come as one box per K step either way:
    - interleaved gate/up columns: a [BLOCK_K, 2*BLOCK_N] box of the 3-d weight;
    - gate and up as column blocks (GATE_UP_BOX): the descriptor views the weight as 4-d, with the
      gate/up half as its own size-2 dimension ([E, k, 2, I] if B_KN, else [E, 2, I, k]), and one
      [.., 2, BLOCK_N, ..] box holds both blocks (returned as [gate block | up block], as B_BLOCKED).
      Columns past I are zero-filled per half, so a partial N tile never reads the other half.
      (v8 read the two blocks as two 3-d boxes with two dots: slower than per-thread loads.)"""
    WIDTH: tl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    c0 = 2 * n0 if GATED else n0
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + kk[None, :]
    acc = tl.zeros((BLOCK_M, WIDTH), tl.float32)
    for k0 in range(0, KD, BLOCK_K):
        a = tl.load(a_ptrs, mask=rmask[:, None] & ((k0 + kk) < KD)[None, :], other=0.0)
        if GATE_UP_BOX and B_KN:
            b = b_desc.load([e, k0, 0, n0]).reshape(BLOCK_K, WIDTH)
        elif GATE_UP_BOX:
            b = tl.trans(b_desc.load([e, 0, n0, k0]).reshape(WIDTH, BLOCK_K))
        elif B_KN:
            b = b_desc.load([e, k0, c0]).reshape(BLOCK_K, WIDTH)
        else:
            b = tl.trans(b_desc.load([e, c0, k0]).reshape(WIDTH, BLOCK_K))
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
    return acc


@triton.jit
def _tile_rows(sorted_pair_ptr, row0, row_end, BM: tl.constexpr):
    """(sorted rows, row mask, pair ids) of a tile of BM rows from row0 (rows from row_end on masked)."""
    rows = row0 + tl.arange(0, BM)
    rmask = rows < row_end
    pair = tl.load(sorted_pair_ptr + rows, mask=rmask, other=0)
    return rows, rmask, pair


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, sorted_pair_ptr, b_ptr, bias_ptr, c_ptr, block_table_ptr,
    N, KD, E, stride_am, stride_be, stride_bk, stride_bn, stride_bias_e, stride_cm,
    col_mul, up_off, alpha, limit,
    TOPK: tl.constexpr, A_GATHER: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr, ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    scale_ptr=None, dot_ptr=None, dw_part_ptr=None, stride_dot=None, TK=None,
    A_SCALE: tl.constexpr = False, DW_DOT: tl.constexpr = False, h_ptr=None, stride_hm=None,
    STORE_H: tl.constexpr = False, b_desc=None, B_KN: tl.constexpr = False, B_BLOCKED: tl.constexpr = False,
    HALF_TAIL: tl.constexpr = False, GROUP_M: tl.constexpr = 8,
):
    """C = A @ W[e] per row block (see module doc). Weight on input (Llama4) adds two flags:
    A_SCALE: A rows are scaled by scale[pair] (rounded to A's dtype) in the loads (forward gate_up);
    DW_DOT: the epilogue also writes dw_part[pid_n, row] = sum over this N-tile of the fp32 product
    times dot[pair // TOPK] (backward dgrad: d w = <dxs, x> per N-tile, summed later in fixed order).
    STORE_H (training forward gate_up): also store the product before bias and activation, rounded, in
    W's column layout (h[row, c] for c < 2I gated), for the backward to read instead of recomputing.
    b_desc: B through TMA (`_mainloop_tma`); b_ptr and its strides are then unused.
    HALF_TAIL: a block of at most BLOCK_M // 2 rows (an expert's last) runs at that height (module doc).
    GROUP_M: programs walk the tiles GROUP_M row blocks at a time (`_tile_of`)."""
    pid_m, pid_n = _tile_of(tl.program_id(0), N, BLOCK_N, GROUP_M)
    e, row0, row_end = _block_of(block_table_ptr, pid_m)
    if e >= E:
        return
    if HALF_TAIL and row_end - row0 <= BLOCK_M // 2:
        _gemm_tile(a_ptr, sorted_pair_ptr, b_ptr, bias_ptr, c_ptr, e, row0, row_end, pid_n, N, KD, stride_am,
                   stride_be, stride_bk, stride_bn, stride_bias_e, stride_cm, col_mul, up_off, alpha, limit, scale_ptr,
                   dot_ptr, dw_part_ptr, stride_dot, TK, h_ptr, stride_hm, b_desc, TOPK, A_GATHER, GATED, INTERLEAVED,
                   ACT, HAS_BIAS, PRECISION, BLOCK_M // 2, BLOCK_N, BLOCK_K, A_SCALE, DW_DOT, STORE_H, B_KN, B_BLOCKED)
    else:
        _gemm_tile(a_ptr, sorted_pair_ptr, b_ptr, bias_ptr, c_ptr, e, row0, row_end, pid_n, N, KD, stride_am,
                   stride_be, stride_bk, stride_bn, stride_bias_e, stride_cm, col_mul, up_off, alpha, limit, scale_ptr,
                   dot_ptr, dw_part_ptr, stride_dot, TK, h_ptr, stride_hm, b_desc, TOPK, A_GATHER, GATED, INTERLEAVED,
                   ACT, HAS_BIAS, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, A_SCALE, DW_DOT, STORE_H, B_KN, B_BLOCKED)


@triton.jit
def _gemm_tile(a_ptr, sorted_pair_ptr, b_ptr, bias_ptr, c_ptr, e, row0, row_end, pid_n, N, KD, stride_am, stride_be,
               stride_bk, stride_bn, stride_bias_e, stride_cm, col_mul, up_off, alpha, limit, scale_ptr, dot_ptr,
               dw_part_ptr, stride_dot, TK, h_ptr, stride_hm, b_desc, TOPK: tl.constexpr, A_GATHER: tl.constexpr,
               GATED: tl.constexpr, INTERLEAVED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
               PRECISION: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               A_SCALE: tl.constexpr, DW_DOT: tl.constexpr, STORE_H: tl.constexpr, B_KN: tl.constexpr,
               B_BLOCKED: tl.constexpr):
    """`_grouped_gemm_kernel`'s work for expert e's rows row0.. (< row_end) and N-tile pid_n at height BM."""
    rows, rmask, pair = _tile_rows(sorted_pair_ptr, row0, row_end, BM)
    if A_GATHER:
        a_rows = pair // TOPK
    else:
        a_rows = rows
    n0 = pid_n * BLOCK_N
    if A_SCALE:
        acc = _mainloop(a_ptr, a_rows, rmask, stride_am, b_ptr + e.to(tl.int64) * stride_be, stride_bk,
                        stride_bn, n0, N, KD, col_mul, up_off, GATED, INTERLEAVED, PRECISION, BM, BLOCK_N,
                        BLOCK_K, scale_ptr + pair, True, B_BLOCKED=B_BLOCKED)
    else:
        acc = _mainloop(a_ptr, a_rows, rmask, stride_am, b_ptr + e.to(tl.int64) * stride_be, stride_bk, stride_bn,
                        n0, N, KD, col_mul, up_off, GATED, INTERLEAVED, PRECISION, BM, BLOCK_N, BLOCK_K,
                        b_desc=b_desc, e=e, B_KN=B_KN, B_BLOCKED=B_BLOCKED)

    # Epilogue, rounding where HF's module holds a tensor in the input dtype: the projection's
    # output, the bias add, then each op of the activation.
    DT = c_ptr.dtype.element_ty
    n = n0 + tl.arange(0, BLOCK_N)
    nmask = n < N
    if DW_DOT:
        dot = tl.load(dot_ptr + (pair // TOPK).to(tl.int64)[:, None] * stride_dot + n[None, :],
                      mask=rmask[:, None] & nmask[None, :], other=0.0).to(tl.float32)
        tl.store(dw_part_ptr + pid_n.to(tl.int64) * TK + rows, tl.sum(acc * dot, axis=1), mask=rmask)
    if STORE_H:
        h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_hm
        if INTERLEAVED:  # acc's columns are already h's: gate n, up n, gate n+1, ...
            hc = 2 * n0 + tl.arange(0, 2 * BLOCK_N)
            tl.store(h_rows + hc[None, :], acc.to(DT), mask=rmask[:, None] & (hc < 2 * N)[None, :])
        elif GATED:
            hg, hu = tl.split(tl.reshape(acc, (BM, BLOCK_N, 2)))
            tl.store(h_rows + (n * col_mul)[None, :], hg.to(DT), mask=rmask[:, None] & nmask[None, :])
            tl.store(h_rows + (n * col_mul + up_off)[None, :], hu.to(DT), mask=rmask[:, None] & nmask[None, :])
        else:
            tl.store(h_rows + n[None, :], acc.to(DT), mask=rmask[:, None] & nmask[None, :])
    bias_base = bias_ptr + e.to(tl.int64) * stride_bias_e
    if GATED:
        g, u = tl.split(tl.reshape(acc, (BM, BLOCK_N, 2)))
        g = _r(g, DT)
        u = _r(u, DT)
        if HAS_BIAS:
            g = _r(g + tl.load(bias_base + n * col_mul, mask=nmask, other=0.0).to(tl.float32)[None, :], DT)
            u = _r(u + tl.load(bias_base + n * col_mul + up_off, mask=nmask, other=0.0).to(tl.float32)[None, :], DT)
    else:
        g = _r(acc, DT)
        if HAS_BIAS:
            g = _r(g + tl.load(bias_base + n, mask=nmask, other=0.0).to(tl.float32)[None, :], DT)
        u = g
    if ACT > 0:
        g = act_forward(g, u, alpha, limit, ACT, DT)
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + n[None, :]
    tl.store(c_ptrs, g.to(DT), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _gate_up_bwd_kernel(
    x_ptr, sorted_pair_ptr, w_ptr, w1_ptr, b1_ptr, g2_ptr, dh_ptr, act_ptr, dw_part_ptr, block_table_ptr,
    I, H, E, TK, stride_xm, stride_w1e, stride_w1k, stride_w1n, stride_b1e, stride_g2m, stride_dhm, stride_am,
    col_mul, up_off, alpha, limit,
    TOPK: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    WOI: tl.constexpr = False, B_BLOCKED: tl.constexpr = False,
    HALF_TAIL: tl.constexpr = False, GROUP_M: tl.constexpr = 8,
):
    """Recomputes h = x[t] @ W1[e] (+ b1) for a row block and I-tile (h is never stored), then with
    g2 = go[t] @ W2[e]^T (d expert output before the routing weight, from the previous launch):
        dw_part[pid_n, r] = sum_n g2 * act(h)     partial d(topk_weight) over this I-tile
        dh = act'(h) * (w * g2)                    stored in h's column layout
        w * act(h)                                 stored for dW2
    WOI (weight on input): h = (x[t] * w).to(x.dtype) @ W1[e]; the output is not weighted, so
    dh = act'(h) * g2, act(h) is stored unscaled and no dw_part is written (d w comes from dgrad).
    HALF_TAIL, GROUP_M: as in `_grouped_gemm_kernel`."""
    pid_m, pid_n = _tile_of(tl.program_id(0), I, BLOCK_N, GROUP_M)
    e, row0, row_end = _block_of(block_table_ptr, pid_m)
    if e >= E:
        return
    if HALF_TAIL and row_end - row0 <= BLOCK_M // 2:
        _gate_up_bwd_tile(x_ptr, sorted_pair_ptr, w_ptr, w1_ptr, b1_ptr, g2_ptr, dh_ptr, act_ptr, dw_part_ptr, e, row0,
                          row_end, pid_n, I, H, TK, stride_xm, stride_w1e, stride_w1k, stride_w1n, stride_b1e,
                          stride_g2m, stride_dhm, stride_am, col_mul, up_off, alpha, limit, TOPK, GATED, INTERLEAVED,
                          ACT, HAS_BIAS, PRECISION, BLOCK_M // 2, BLOCK_N, BLOCK_K, WOI, B_BLOCKED)
    else:
        _gate_up_bwd_tile(x_ptr, sorted_pair_ptr, w_ptr, w1_ptr, b1_ptr, g2_ptr, dh_ptr, act_ptr, dw_part_ptr, e, row0,
                          row_end, pid_n, I, H, TK, stride_xm, stride_w1e, stride_w1k, stride_w1n, stride_b1e,
                          stride_g2m, stride_dhm, stride_am, col_mul, up_off, alpha, limit, TOPK, GATED, INTERLEAVED,
                          ACT, HAS_BIAS, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, WOI, B_BLOCKED)


@triton.jit
def _gate_up_bwd_tile(x_ptr, sorted_pair_ptr, w_ptr, w1_ptr, b1_ptr, g2_ptr, dh_ptr, act_ptr, dw_part_ptr, e, row0,
                      row_end, pid_n, I, H, TK, stride_xm, stride_w1e, stride_w1k, stride_w1n, stride_b1e, stride_g2m,
                      stride_dhm, stride_am, col_mul, up_off, alpha, limit, TOPK: tl.constexpr, GATED: tl.constexpr,
                      INTERLEAVED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                      BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WOI: tl.constexpr,
                      B_BLOCKED: tl.constexpr):
    """`_gate_up_bwd_kernel`'s work for expert e's rows row0.. (< row_end) and I-tile pid_n at height BM."""
    rows, rmask, pair = _tile_rows(sorted_pair_ptr, row0, row_end, BM)
    n0 = pid_n * BLOCK_N
    if WOI:
        acc = _mainloop(x_ptr, pair // TOPK, rmask, stride_xm, w1_ptr + e.to(tl.int64) * stride_w1e, stride_w1k,
                        stride_w1n, n0, I, H, col_mul, up_off, GATED, INTERLEAVED, PRECISION, BM, BLOCK_N,
                        BLOCK_K, w_ptr + pair, True, B_BLOCKED=B_BLOCKED)
    else:
        acc = _mainloop(x_ptr, pair // TOPK, rmask, stride_xm, w1_ptr + e.to(tl.int64) * stride_w1e, stride_w1k,
                        stride_w1n, n0, I, H, col_mul, up_off, GATED, INTERLEAVED, PRECISION, BM, BLOCK_N,
                        BLOCK_K, B_BLOCKED=B_BLOCKED)
    n = n0 + tl.arange(0, BLOCK_N)
    nmask = n < I
    col_g = n * col_mul
    col_u = col_g + up_off
    b1 = b1_ptr + e.to(tl.int64) * stride_b1e
    if GATED:
        g, u = tl.split(tl.reshape(acc, (BM, BLOCK_N, 2)))
        if HAS_BIAS:
            u = u + tl.load(b1 + col_u, mask=nmask, other=0.0).to(tl.float32)[None, :]
    else:
        g = acc
        u = acc
    if HAS_BIAS:
        g = g + tl.load(b1 + col_g, mask=nmask, other=0.0).to(tl.float32)[None, :]
    om = rmask[:, None] & nmask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    g2 = tl.load(g2_ptr + rows64 * stride_g2m + n[None, :], mask=om, other=0.0).to(tl.float32)
    a = tl.where(om, act_value_fp32(g, u, alpha, limit, ACT), 0.0)
    if WOI:
        dg, du = act_backward(g, u, g2, alpha, limit, ACT)
    else:
        tl.store(dw_part_ptr + pid_n.to(tl.int64) * TK + rows, tl.sum(g2 * a, axis=1), mask=rmask)
        wv = tl.load(w_ptr + pair, mask=rmask, other=0.0).to(tl.float32)
        dg, du = act_backward(g, u, g2 * wv[:, None], alpha, limit, ACT)
    DT = dh_ptr.dtype.element_ty
    tl.store(dh_ptr + rows64 * stride_dhm + col_g[None, :], dg.to(DT), mask=om)
    if GATED:
        tl.store(dh_ptr + rows64 * stride_dhm + col_u[None, :], du.to(DT), mask=om)
    # dW2 = sum_r (w go)[r]^T act[r]: store w * act here so the dW2 kernel's operands need no
    # per-row scaling in registers (which made it slower than dW1 at half the work).
    if WOI:
        tl.store(act_ptr + rows64 * stride_am + n[None, :], a.to(act_ptr.dtype.element_ty), mask=om)
    else:
        tl.store(act_ptr + rows64 * stride_am + n[None, :], (a * wv[:, None]).to(act_ptr.dtype.element_ty),
                 mask=om)


@triton.jit
def _wgrad_kernel(
    p_ptr, q_ptr, sorted_pair_ptr, scale_ptr, c_ptr, dbias_ptr, expert_count_ptr, expert_start_ptr,
    P, Q, E, num_programs, stride_pm, stride_qm, stride_ce, stride_cp, stride_cq, stride_dbe,
    TOPK: tl.constexpr, P_GATHER: tl.constexpr, Q_GATHER: tl.constexpr, BIAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr, Q_SCALE: tl.constexpr = False,
    PERSISTENT: tl.constexpr = False, c_desc=None,
):
    """C[e, p, q] = sum over expert e's rows r (in sorted order) of P[r, p] * Q[r, q];
    P/Q rows are gathered by token where flagged; dbias[e, p] = sum_r s_r P[r, p] (s_r the pair's
    routing weight if BIAS_SCALE, else 1), stored by the programs of the first q tile.
    Q_SCALE (weight on input, dW1): Q rows are (Q[r] * scale[pair]).to(Q's dtype), the expert's input.
    One output tile per program, or with PERSISTENT tiles i, i + num_programs, ... (one resident wave of
    programs). `c_desc` (Hopper, `moe._wgrad`): C tiles are stored through TMA, asynchronously."""
    if PERSISTENT:  # a loop in the one-tile launch made its plain stores 20-30% slower (NOTES v37)
        for tile in range(tl.program_id(0), E * tl.cdiv(P, BLOCK_P) * tl.cdiv(Q, BLOCK_Q), num_programs):
            _wgrad_output_tile(
                tile, p_ptr, q_ptr, sorted_pair_ptr, scale_ptr, c_ptr, dbias_ptr, expert_count_ptr, expert_start_ptr,
                P, Q, stride_pm, stride_qm, stride_ce, stride_cp, stride_cq, stride_dbe, TOPK, P_GATHER, Q_GATHER,
                BIAS_SCALE, HAS_BIAS, PRECISION, BLOCK_P, BLOCK_Q, BLOCK_R, Q_SCALE, c_desc)
    else:
        _wgrad_output_tile(
            tl.program_id(0), p_ptr, q_ptr, sorted_pair_ptr, scale_ptr, c_ptr, dbias_ptr, expert_count_ptr,
            expert_start_ptr, P, Q, stride_pm, stride_qm, stride_ce, stride_cp, stride_cq, stride_dbe, TOPK, P_GATHER,
            Q_GATHER, BIAS_SCALE, HAS_BIAS, PRECISION, BLOCK_P, BLOCK_Q, BLOCK_R, Q_SCALE, c_desc)


@triton.jit
def _wgrad_output_tile(
    tile, p_ptr, q_ptr, sorted_pair_ptr, scale_ptr, c_ptr, dbias_ptr, expert_count_ptr, expert_start_ptr,
    P, Q, stride_pm, stride_qm, stride_ce, stride_cp, stride_cq, stride_dbe, TOPK: tl.constexpr,
    P_GATHER: tl.constexpr, Q_GATHER: tl.constexpr, BIAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
    Q_SCALE: tl.constexpr, c_desc,
):
    """Output tile `tile` of `_wgrad_kernel` (expert-major, then p, then q), and its share of the bias gradient."""
    num_p = tl.cdiv(P, BLOCK_P)
    num_q = tl.cdiv(Q, BLOCK_Q)
    e = tile // (num_p * num_q)
    rest = tile % (num_p * num_q)
    pid_p = rest // num_q
    pid_q = rest % num_q
    acc, bacc, pc, pmask = _wgrad_tile(
        p_ptr, q_ptr, sorted_pair_ptr, scale_ptr, expert_count_ptr, expert_start_ptr, e, pid_p, pid_q, P, Q,
        stride_pm, stride_qm, TOPK, P_GATHER, Q_GATHER, BIAS_SCALE, HAS_BIAS, PRECISION, BLOCK_P, BLOCK_Q,
        BLOCK_R, Q_SCALE)
    if c_desc is not None:
        c_desc.store([e, pid_p * BLOCK_P, pid_q * BLOCK_Q], acc.to(c_desc.dtype).reshape(1, BLOCK_P, BLOCK_Q))
    else:
        qc = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
        c_ptrs = c_ptr + e.to(tl.int64) * stride_ce + pc[:, None].to(tl.int64) * stride_cp + qc[None, :] * stride_cq
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=pmask[:, None] & (qc < Q)[None, :])
    if HAS_BIAS:
        if pid_q == 0:
            tl.store(dbias_ptr + e.to(tl.int64) * stride_dbe + pc, bacc.to(dbias_ptr.dtype.element_ty), mask=pmask)


@triton.jit
def _wgrad_tile(
    p_ptr, q_ptr, sorted_pair_ptr, scale_ptr, expert_count_ptr, expert_start_ptr, e, pid_p, pid_q, P, Q,
    stride_pm, stride_qm, TOPK: tl.constexpr, P_GATHER: tl.constexpr, Q_GATHER: tl.constexpr,
    BIAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr, Q_SCALE: tl.constexpr,
):
    """One output tile of `_wgrad_kernel`: (acc [BLOCK_P, BLOCK_Q] fp32, bias sum [BLOCK_P] fp32, p columns,
    their mask)."""
    start = tl.load(expert_start_ptr + e)
    count = tl.load(expert_count_ptr + e)
    pc = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    qc = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    pmask = pc < P
    qmask = qc < Q
    rr = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_P, BLOCK_Q), tl.float32)
    bacc = tl.zeros((BLOCK_P,), tl.float32)
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
        if HAS_BIAS:  # every program sums (no runtime `if` inside the pipelined loop, see module doc)
            pf = pt.to(tl.float32)
            if BIAS_SCALE:
                pf = pf * tl.load(scale_ptr + pair, mask=rmask, other=0.0).to(tl.float32)[None, :]
            bacc += tl.sum(pf, axis=1)
        qt = tl.load(q_ptr + qrow[:, None] * stride_qm + qc[None, :], mask=rmask[:, None] & qmask[None, :],
                     other=0.0)  # [BLOCK_R, BLOCK_Q]
        if Q_SCALE:
            qs = tl.load(scale_ptr + pair, mask=rmask, other=0.0).to(tl.float32)
            qt = (qt.to(tl.float32) * qs[:, None]).to(q_ptr.dtype.element_ty)
        acc = tl.dot(pt, qt, acc, input_precision=PRECISION)
    return acc, bacc, pc, pmask
