"""Dispatch and combine: a stable counting sort of (token, slot) pairs by expert, on the device.

No host synchronisation: sizes never depend on routing data. Pairs are numbered
p = t * K + k; the sort is stable in p, so every per-expert reduction (weight
gradients) runs over the same rows in the same order on every run.

    chunk_counts [n_chunks, BLOCK_E]  how many pairs of each token chunk go to each expert
                                      (written by the router kernel, or `count_chunks`)
    scan         -> expert_count [E], expert_start [E], expert_end [E], chunk_offset [n_chunks, BLOCK_E]
    scatter      -> sorted_pair [T*K] (pair at each sorted position), pair_pos [T*K] (inverse)

Each expert's rows are contiguous and unpadded; a grouped GEMM cuts them into row blocks of its BLOCK_M
(any BLOCK_M works) and reads each block's expert and rows from `Dispatch.block_table(BLOCK_M)`, built once
per call and block height from `expert_count` (one small launch).
`combine` sums the K rows of each token in slot order (fixed, no atomics).

Identity experts (LongCat-Flash's zero-computation experts, router choices E .. E+Z-1) are sorted as buckets of
their own after the experts': their pairs take the last sorted positions, from expert_end[E-1] on. The arrays
over all E + Z buckets are `bucket_count`, `bucket_start`, `bucket_end`, which the sort writes; `expert_count`,
`expert_start`, `expert_end` are their first E entries, all that the grouped GEMMs read, so no GEMM runs an
identity pair's row.

The five arrays are views of one int32 buffer, `Dispatch.layout` (`layout_size` entries): the training
forward returns it and its backward rebuilds the Dispatch from it (`Dispatch.from_layout`) instead of
counting, scanning and scattering again (3 launches; 8 bytes per (token, slot) pair kept).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import cdiv, launcher, next_power_of_2
from .post_norm import normalized
from .routing import place_pairs, repeats_before, routing_block, routing_warps


@triton.jit
def _chunk_hits(ids_ptr, pid, T, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """Chunk `pid` of the tokens: its rows, their mask, the expert columns, and hits[t, e] = 1 where token t picked
    expert e."""
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    rmask = rows < T
    hits = tl.zeros((BLOCK_T, BLOCK_E), tl.int32)
    for k in tl.static_range(K):
        idk = tl.load(ids_ptr + rows * K + k, mask=rmask, other=-1).to(tl.int32)
        hits += (idk[:, None] == cols[None, :]).to(tl.int32)
    return rows, rmask, cols, hits


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, T, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    _, _, cols, hits = _chunk_hits(ids_ptr, pid, T, K, BLOCK_T, BLOCK_E)
    tl.store(counts_ptr + pid * BLOCK_E + cols, tl.sum(hits, axis=0))


def count_chunks(topk_ids, num_experts, block_t, block_e):
    """chunk_counts from topk_ids (the backward has no router kernel to write them)."""
    T, K = topk_ids.shape
    n_chunks = cdiv(T, block_t)
    counts = torch.empty((n_chunks, block_e), dtype=torch.int32, device=topk_ids.device)
    if T > 0:
        launcher(_count_kernel)[(n_chunks,)](topk_ids, counts, T, K=K, BLOCK_T=block_t, BLOCK_E=block_e)
    return counts


@triton.jit
def _scan_kernel(counts_ptr, chunk_off_ptr, expert_count_ptr, expert_start_ptr, expert_end_ptr, n_chunks, E,
                 BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr):
    """One program: prefix sums over chunks (per expert) and over experts."""
    cols = tl.arange(0, BLOCK_E)
    running = tl.zeros((BLOCK_E,), tl.int32)
    for c0 in range(0, n_chunks, BLOCK_C):
        cr = c0 + tl.arange(0, BLOCK_C)
        offs = cr[:, None] * BLOCK_E + cols[None, :]
        m = (cr < n_chunks)[:, None]
        tile = tl.load(counts_ptr + offs, mask=m, other=0)
        tl.store(chunk_off_ptr + offs, tl.cumsum(tile, axis=0) - tile + running[None, :], mask=m)
        running += tl.sum(tile, axis=0)
    cmask = cols < E
    tl.store(expert_count_ptr + cols, running, mask=cmask)
    end = tl.cumsum(running, axis=0)
    tl.store(expert_start_ptr + cols, end - running, mask=cmask)
    tl.store(expert_end_ptr + cols, end, mask=cmask)


@triton.jit
def _scatter_kernel(ids_ptr, chunk_off_ptr, expert_start_ptr, sorted_pair_ptr, pair_pos_ptr, T, E,
                    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, REPEATS: tl.constexpr = False,
                    K_PAD: tl.constexpr = 1):
    """Position of pair (t, k) = start[e] + pairs of e in earlier chunks + earlier tokens of this chunk (+ with
    REPEATS, where a row may name an expert twice, its earlier slots naming e)."""
    pid = tl.program_id(0)
    rows, rmask, cols, hits = _chunk_hits(ids_ptr, pid, T, K, BLOCK_T, BLOCK_E)
    base = tl.load(expert_start_ptr + cols, mask=cols < E, other=0) + tl.load(chunk_off_ptr + pid * BLOCK_E + cols)
    pos_mat = base[None, :] + tl.cumsum(hits, axis=0) - hits
    if REPEATS:
        kcols = tl.arange(0, K_PAD)
        ids = tl.load(ids_ptr + rows[:, None] * K + kcols[None, :], mask=rmask[:, None] & (kcols < K)[None, :],
                      other=-1).to(tl.int32)
    for k in tl.static_range(K):
        idk = tl.load(ids_ptr + rows * K + k, mask=rmask, other=-1).to(tl.int32)
        if REPEATS:
            place_pairs(pos_mat, idk, k, rows, rmask, cols, K, sorted_pair_ptr, pair_pos_ptr,
                        repeats_before(ids, kcols, idk, k))
        else:  # a token picks each expert at most once: earlier pairs of the same expert are earlier tokens
            place_pairs(pos_mat, idk, k, rows, rmask, cols, K, sorted_pair_ptr, pair_pos_ptr)


def grid_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Row blocks a grouped GEMM's grid provides for: each expert wastes at most one partial block."""
    return cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


@triton.jit
def _block_table_kernel(expert_count_ptr, expert_start_ptr, table_ptr, num_rows, E, BLOCK_M: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):
    """Row blocks r of this program: table[r] = (expert, first row, end of the expert's rows, 0), the experts'
    blocks in expert order; expert = E past the last block."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_E)
    cmask = cols < E
    nblk = (tl.load(expert_count_ptr + cols, mask=cmask, other=0) + BLOCK_M - 1) // BLOCK_M
    # Experts all of whose blocks come before block r: a prefix of the experts (the running block count grows).
    done = (tl.cumsum(nblk, axis=0)[None, :] <= r[:, None]) & cmask[None, :]
    e = tl.sum(done.to(tl.int32), axis=1)
    before = tl.sum(tl.where(done, nblk[None, :], 0), axis=1)
    rmask = r < num_rows
    hit = rmask & (e < E)
    start = tl.load(expert_start_ptr + e, mask=hit, other=0)
    end = start + tl.load(expert_count_ptr + e, mask=hit, other=0)
    row = table_ptr + r * 4
    tl.store(row, e, mask=rmask)
    tl.store(row + 1, tl.where(hit, start + (r - before) * BLOCK_M, 0), mask=rmask)
    tl.store(row + 2, end, mask=rmask)
    tl.store(row + 3, tl.zeros_like(e), mask=rmask)


def _aligned_len(n: int) -> int:
    """n int32 entries rounded up to 16 bytes, so that every array of a layout starts 16-byte aligned, as a
    tensor of its own would (Triton specialises pointer arguments on that alignment)."""
    return -(-n // 4) * 4


def layout_size(num_experts: int, num_pairs: int) -> int:
    """int32 entries of a `Dispatch.layout`: expert_count, expert_start, expert_end [E]; sorted_pair, pair_pos
    [T*K]; each padded to 16 bytes."""
    return 3 * _aligned_len(num_experts) + 2 * _aligned_len(num_pairs)


class Dispatch:
    """The sorted layout of one routing decision: what every grouped kernel needs. `num_experts`: the experts that
    compute; `num_buckets` (default: as many): the router's choices, identity experts included."""

    def __init__(self, topk_ids, chunk_counts, num_experts, block_t, repeats=False, num_buckets=None):
        T, K = topk_ids.shape
        buckets = num_buckets or num_experts
        layout = torch.empty(layout_size(buckets, T * K), dtype=torch.int32, device=topk_ids.device)
        self._view(layout, num_experts, K, T * K, buckets)
        self.sort(topk_ids, chunk_counts, block_t, repeats)

    @classmethod
    def from_ids(cls, topk_ids, num_experts, num_buckets=None) -> "Dispatch":
        """The layout of `topk_ids` [T, K], counted and sorted here at `routing_block`'s tile, where no routing
        kernel wrote the counts (the backward's recompute; the tuner and tests on given ids). A row may name an
        expert twice (the op's given `expert_ids`)."""
        buckets = num_buckets or num_experts
        block_t, block_e = routing_block(buckets, topk_ids.shape[0])
        return cls(topk_ids, count_chunks(topk_ids, buckets, block_t, block_e), num_experts, block_t,
                   repeats=True, num_buckets=buckets)

    @classmethod
    def unsorted(cls, num_experts, top_k, num_pairs, device, num_buckets=None) -> "Dispatch":
        """A Dispatch whose arrays are allocated but not yet written: `routing.route(dispatch=...)` sorts into it."""
        buckets = num_buckets or num_experts
        disp = cls.__new__(cls)
        disp._view(torch.empty(layout_size(buckets, num_pairs), dtype=torch.int32, device=device), num_experts,
                   top_k, num_pairs, buckets)
        return disp

    def sort(self, topk_ids, chunk_counts, block_t, repeats=False):
        """Write the arrays: scan the chunk counts, then scatter each pair to its sorted position. `repeats`: a row
        of `topk_ids` may name an expert twice (given ids); a top-k's never does."""
        self._tables.clear()  # block tables of earlier counts
        T, K = topk_ids.shape
        n_chunks, block_e = chunk_counts.shape
        buckets = self.num_buckets
        chunk_off = torch.empty_like(chunk_counts)
        launcher(_scan_kernel)[(1,)](chunk_counts, chunk_off, self.bucket_count, self.bucket_start, self.bucket_end,
                                     n_chunks, buckets, BLOCK_C=max(1, min(64, 8192 // block_e)), BLOCK_E=block_e)
        if T > 0:
            launcher(_scatter_kernel)[(n_chunks,)](topk_ids, chunk_off, self.bucket_start, self.sorted_pair,
                                                   self.pair_pos, T, buckets, K=K, BLOCK_T=block_t,
                                                   BLOCK_E=block_e, num_warps=routing_warps(block_t, block_e),
                                                   **({"REPEATS": True, "K_PAD": next_power_of_2(K)} if repeats
                                                      else {}))

    @classmethod
    def from_layout(cls, layout, num_experts, top_k, num_pairs, num_buckets=None) -> "Dispatch":
        """The Dispatch whose `layout` this is (the training forward's, kept for its backward)."""
        buckets = num_buckets or num_experts
        if (layout.dtype != torch.int32 or layout.dim() != 1 or not layout.is_contiguous()
                or layout.numel() != layout_size(buckets, num_pairs)):
            raise ValueError(f"mok.fused_moe_backward: routing_layout must be a contiguous int32 vector of "
                             f"{layout_size(buckets, num_pairs)} entries (the training forward's for "
                             f"{num_pairs} pairs and {buckets} experts), got {layout.dtype} of shape "
                             f"{tuple(layout.shape)}")
        disp = cls.__new__(cls)
        disp._view(layout, num_experts, top_k, num_pairs, buckets)
        return disp

    def block_table(self, block_m: int) -> torch.Tensor:
        """[grid_rows, 4] int32: row block r's (expert, first row, end of its expert's rows, 0) at block height
        `block_m`, built on the first request for that height (and kept on this Dispatch). A grouped GEMM reads
        its block's entry instead of working it out from all experts' counts in each program: 1-6% faster
        kernels alone at the layer shapes, 0.99-1.04x in the op (NOTES v45 (1))."""
        table = self._tables.get(block_m)
        if table is None:
            E = self.num_experts
            rows = grid_rows(self.num_pairs, E, block_m)
            table = self._tables[block_m] = torch.empty((rows, 4), dtype=torch.int32, device=self.layout.device)
            if rows:
                block_e = next_power_of_2(max(E, 2))
                block_r = max(1, min(64, 8192 // block_e))
                launcher(_block_table_kernel)[(cdiv(rows, block_r),)](
                    self.expert_count, self.expert_start, table, rows, E, BLOCK_M=block_m, BLOCK_R=block_r,
                    BLOCK_E=block_e, num_warps=4)
        return table

    def _view(self, layout, num_experts, top_k, num_pairs, num_buckets):
        self._tables = {}
        self.layout = layout
        self.num_experts, self.num_buckets, self.top_k, self.num_pairs = num_experts, num_buckets, top_k, num_pairs
        b, p = _aligned_len(num_buckets), _aligned_len(num_pairs)
        self.bucket_count = layout[:num_buckets]
        self.bucket_start = layout[b:b + num_buckets]
        self.bucket_end = layout[2 * b:2 * b + num_buckets]
        if num_buckets == num_experts:  # no identity experts: the same views (no slicing on the host path)
            self.expert_count, self.expert_start = self.bucket_count, self.bucket_start
            self.expert_end = self.bucket_end
        else:
            self.expert_count = self.bucket_count[:num_experts]
            self.expert_start = self.bucket_start[:num_experts]
            self.expert_end = self.bucket_end[:num_experts]
        # expert_end: the group offsets of grouped_mm
        self.sorted_pair = layout[3 * b:3 * b + num_pairs]
        self.pair_pos = layout[3 * b + p:3 * b + p + num_pairs]


@triton.jit
def _combine_kernel(y_ptr, pos_ptr, w_ptr, extra_ptr, out_ptr, T, H, stride_y, stride_extra, stride_out,
                    K: tl.constexpr, HAS_W: tl.constexpr, ROUND_PRODUCT: tl.constexpr, HAS_EXTRA: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, bias_ptr=None, ids_ptr=None, stride_be=None,
                    HAS_BIAS: tl.constexpr = False, ident_ptr=None, iw_ptr=None, stride_ident=0, num_experts=0,
                    IDENTITY: tl.constexpr = False, ROUND_IDENTITY: tl.constexpr = False, ZERO: tl.constexpr = False,
                    norm_r_ptr=None, norm_g_ptr=None, stride_ge=0, NORM: tl.constexpr = False,
                    NORM_SCALED: tl.constexpr = False, NORM_PER_EXPERT: tl.constexpr = False):
    """HAS_BIAS: y rows are expert outputs without their bias; add bias[ids[t, k]] (rounded, as the
    GEMM epilogue would) before weighting.
    IDENTITY: pairs whose id is num_experts or more (identity experts) have no y row; their weights (`iw_ptr`) are
    summed into s[t] and s[t] * ident[t] is added (the forward: ident = x, each of the experts' sum and the
    identity term rounded to the output dtype first, ROUND_IDENTITY; the backward: ident = grad_out, in fp32).
    ZERO (with IDENTITY): those pairs are zero experts' instead, which add nothing: no term, no ident or iw read.
    NORM: y rows are a post-expert norm's input; each is normalised (`post_norm.normalized`, at its rsqrt
    norm_r[row] and the g row of its expert, or the shared one) and rounded to the output dtype before weighting."""
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    hcols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    rmask = rows < T
    m = rmask[:, None] & (hcols < H)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    DT = out_ptr.dtype.element_ty
    if IDENTITY:
        if not ZERO:
            s = tl.zeros((BLOCK_T,), tl.float32)
    for k in tl.static_range(K):
        p = tl.load(pos_ptr + rows * K + k, mask=rmask, other=0).to(tl.int64)
        if IDENTITY:
            e = tl.load(ids_ptr + rows * K + k, mask=rmask, other=0)
            if not ZERO:
                passed = e >= num_experts
                s += tl.where(passed, tl.load(iw_ptr + rows * K + k, mask=rmask & passed, other=0.0).to(tl.float32),
                              0.0)
            vm = m & (e < num_experts)[:, None]
        else:
            vm = m
        v = tl.load(y_ptr + p[:, None] * stride_y + hcols[None, :], mask=vm, other=0.0).to(tl.float32)
        if HAS_BIAS:
            e = tl.load(ids_ptr + rows * K + k, mask=rmask, other=0).to(tl.int64)
            b = tl.load(bias_ptr + e[:, None] * stride_be + hcols[None, :], mask=vm, other=0.0).to(tl.float32)
            v = (v + b).to(DT).to(tl.float32)
        if NORM:
            g_off = hcols[None, :]
            if NORM_PER_EXPERT:
                e = tl.load(ids_ptr + rows * K + k, mask=rmask, other=0).to(tl.int64)
                g_off = e[:, None] * stride_ge + g_off
            g = tl.load(norm_g_ptr + g_off, mask=vm, other=0.0)
            rr = tl.load(norm_r_ptr + p, mask=rmask, other=0.0)[:, None]
            v = normalized(v, g, rr, NORM_SCALED, DT).to(DT).to(tl.float32)
        if HAS_W:
            wk = tl.load(w_ptr + rows * K + k, mask=rmask, other=0.0).to(tl.float32)
            v = v * wk[:, None]
            if ROUND_PRODUCT:  # HF multiplies in the input dtype when the weights were cast to it
                v = v.to(DT).to(tl.float32)
        if IDENTITY:
            v = tl.where(vm, v, 0.0)  # an identity (or zero) pair adds nothing here (not even 0 * a weight of inf)
        acc += v
    if HAS_EXTRA:
        acc += tl.load(extra_ptr + rows[:, None].to(tl.int64) * stride_extra + hcols[None, :], mask=m,
                       other=0.0).to(tl.float32)
    if IDENTITY and not ZERO:
        if ROUND_IDENTITY:  # s in the weights' dtype, as their sum is; x * s in fp32 (or in it), then rounded
            s = s.to(iw_ptr.dtype.element_ty).to(tl.float32)
        src = tl.load(ident_ptr + rows[:, None].to(tl.int64) * stride_ident + hcols[None, :], mask=m,
                      other=0.0).to(tl.float32)
        term = src * s[:, None]
        if ROUND_IDENTITY:
            acc = acc.to(DT).to(tl.float32) + term.to(DT).to(tl.float32)
        else:
            acc += term
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + hcols[None, :], acc.to(DT), mask=m)


def combine(y, pair_pos, topk_weights, extra, T, K, out_dtype, round_product=None, bias=None, topk_ids=None,
            identity=None, norm=None):
    """out[t] = sum_k w[t, k] * (y[pair_pos[t, k]] (+ bias[topk_ids[t, k]])) (+ extra[t]), summed in slot
    order in fp32.

    `round_product`: round each w * y to out_dtype before the sum (None: where HF's forward does,
    i.e. weights already in the low-precision output dtype).
    `identity` = (source [T, H], weights [T, K], num_experts, rounded): the pairs of `topk_ids` past num_experts
    (identity experts) have no y row; s[t] * source[t] is added, s[t] the sum of their weights, where `rounded`
    (the forward) as LongCat-Flash rounds it: s in the weights' dtype, then the experts' sum and the identity term
    each rounded to out_dtype before they are added. (None, None, num_experts, False): those pairs are zero experts'
    (Zaya's skip expert), which add nothing.
    `norm` = (r [T*K], g [H] or [E, H] fp32, scaled): y is a post-expert norm's input, normalised row by row as it is
    read (`post_norm.row_rsqrt` gives r; not with a bias or identity experts, as the op's inputs are checked)."""
    if round_product is None:
        round_product = topk_weights is not None and topk_weights.dtype == out_dtype and out_dtype != torch.float32
    H = y.shape[1]
    out = torch.empty((T, H), dtype=out_dtype, device=y.device)
    if T == 0:
        return out
    block_h = min(256, next_power_of_2(H))
    block_t = 16
    launcher(_combine_kernel)[(cdiv(T, block_t), cdiv(H, block_h))](
        y, pair_pos, topk_weights if topk_weights is not None else y, extra if extra is not None else y, out,
        T, H, y.stride(0), extra.stride(0) if extra is not None else 0, out.stride(0),
        K=K, HAS_W=topk_weights is not None,
        ROUND_PRODUCT=bool(round_product) and topk_weights is not None,
        HAS_EXTRA=extra is not None, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4,
        **({} if bias is None and identity is None and norm is None else dict(ids_ptr=topk_ids)),
        **({} if bias is None else dict(bias_ptr=bias, stride_be=bias.stride(0), HAS_BIAS=True)),
        **({} if identity is None else dict(num_experts=identity[2], IDENTITY=True, ZERO=identity[0] is None)),
        **({} if identity is None or identity[0] is None else dict(
            ident_ptr=identity[0], iw_ptr=identity[1], stride_ident=identity[0].stride(0), ROUND_IDENTITY=identity[3])),
        **({} if norm is None else dict(
            norm_r_ptr=norm[0], norm_g_ptr=norm[1], stride_ge=norm[1].stride(0) if norm[1].dim() == 2 else 0,
            NORM=True, NORM_SCALED=norm[2], NORM_PER_EXPERT=norm[1].dim() == 2)),
        # LongCat-Flash's rounding is that of separate ops: no a * b + c contracted to one fma (its fp32 identity term)
        **({} if identity is None or not identity[3] else dict(enable_fp_fusion=False)),
    )
    return out
