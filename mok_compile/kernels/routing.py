"""Router: logits -> (topk_weights, topk_ids) in one kernel, and its backward.

One program owns BLOCK_T tokens and all E logits of each (E <= 256 fits one
tile). Top-k is k rounds of "max, then lowest index among equals, then mask",
so ties resolve the same way on every run. The forward also writes how many of
its tokens picked each expert: the first step of the device-side counting sort
(`dispatch.py`), saving a pass over `topk_ids`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import cdiv, launcher, next_power_of_2

ROUTING_CODES = {"softmax_topk": 0, "topk_softmax": 1, "sigmoid_grouped_topk": 2, "topk_sigmoid": 3,
                 "sqrtsoftplus_topk": 4, "sparsemixer": 5}
# The 16-bit dtypes `route`'s round_to takes, as the forward kernel's ROUND_TO.
ROUND_CODES = {torch.bfloat16: 1, torch.float16: 2}


def routing_block(num_experts: int, num_tokens: int | None = None) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_E) of a routing program (NOTES-gpu.md v47). A program's k rounds of row reductions are a
    chain of dependent steps whose length grows with its tile, so at E >= 128 the tile is kept small enough to
    spread T over the SMs, and no smaller: every program adds a row of chunk counts to the scan's serial pass.

    - E <= 64: 64 tokens (at most 4K logits); its programs are short whatever the tile.
    - E = 128: the fewest of 8, 16, 32 tokens that make at most 256 programs (T=256: 8; 4096: 16; 16384: 32),
      but one program for up to 16 tokens: it also sorts the pairs, saving the scan and scatter launches.
    - E >= 256: 4 tokens, or 8 past 128 programs (measured with DeepSeek-V3's grouped routing, which keeps many
      [BLOCK_T, E] fp32 tiles live).
    `num_tokens=None` gives the many-token tile. A tile is never taller than T rounded up to a power of 2
    (a decode step's few tokens do not pay for empty rows)."""
    block_e = next_power_of_2(max(num_experts, 2))
    if block_e <= 64:
        block_t = min(64, 4096 // block_e)
    else:
        fewest, most, programs = (8, 32, 256) if block_e == 128 else (4, 8, 128)
        if num_tokens is None:
            block_t = most
        elif block_e == 128 and num_tokens <= 16:
            block_t = 16
        else:
            block_t = min(most, max(fewest, next_power_of_2(cdiv(num_tokens, programs))))
    if num_tokens is not None:
        block_t = min(block_t, next_power_of_2(max(num_tokens, 1)))
    return block_t, block_e


def route_backward_block(num_experts: int, num_tokens: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_E) of a `route_backward` program (NOTES-gpu.md v48). Its chain of row reductions is the
    forward's, but it sorts nothing and feeds no scan, so at E = 128 it takes 8 tokens a program at every T
    (measured to 16384), and at E >= 256 4 tokens up to 512 programs (T = 2048), then 16 (fewer, longer programs:
    8 was the slowest of 4, 8 and 16 at T = 4096 and 16384). E <= 64 as `routing_block`. Never taller than T's
    power of 2."""
    block_e = next_power_of_2(max(num_experts, 2))
    if block_e <= 64:
        return routing_block(num_experts, num_tokens)
    block_t = 8 if block_e == 128 else 4 if cdiv(num_tokens, 4) <= 512 else 16
    return min(block_t, next_power_of_2(max(num_tokens, 1))), block_e


def routing_warps(block_t: int, block_e: int) -> int:
    """Warps of a routing or scatter program over a [block_t, block_e] tile. The k rounds of row reductions are a
    chain of dependent steps; within one warp each is a few shuffles, with no exchange through shared memory and
    no barrier, which is what a program of one token of few logits wants. At E >= 128, one warp per token row
    up to 4 (Triton's default); below, 4 for a full 64-token tile and fewer for a tile cut to a few tokens
    (NOTES-gpu.md v47)."""
    if block_e >= 128:
        return min(4, block_t)
    if block_t == 64:
        return 4
    return max(1, min(4, block_t * block_e // 512))


@triton.jit
def _renorm_denominator(total, renorm_min, renorm_eps):
    """clamp(total, min=renorm_min) + renorm_eps (a NaN total stays NaN, as with torch.clamp)."""
    return tl.where(total < renorm_min, renorm_min, total) + renorm_eps


@triton.jit
def _softplus(x):
    """log(1 + exp(x)) as PyTorch's softplus (x itself past its threshold 20), as max(x, 0) + log1p(exp(-|x|)), with
    log1p(y) = log(u) * y / (u - 1), u = 1 + y: exact to a few ulps where y is tiny (Triton has no log1p that its
    interpreter runs). An x of -inf gives 0."""
    y = tl.exp(-tl.abs(x))
    u = 1.0 + y
    d = u - 1.0
    log1p = tl.where(d == 0.0, y, tl.log(u) * (y / tl.where(d == 0.0, 1.0, d)))  # no 0 / 0, even unused
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p)


@triton.jit
def _sparsemixer_gates(logit, left, top, threshold, LOW: tl.constexpr, LDT: tl.constexpr):
    """One sparsemixer round's softmax [BLOCK_T, BLOCK_E] (fp32, unrounded) of `left` (the logits not yet picked,
    -inf elsewhere) without those the round drops, ``(top - s) / max(|s|, top) > threshold`` for `top` [BLOCK_T]
    the round's pick's logit; LOW: the difference and the ratio rounded to the logits' dtype LDT, as PyTorch runs
    PhiMoE's ops in it (`threshold` is rounded to the dtype by the caller). The division is rounded correctly, as
    PyTorch's is, so that a ratio at the threshold compares as HF's does."""
    diff = top[:, None] - logit
    if LOW:
        diff = diff.to(LDT).to(tl.float32)
    ratio = tl.math.div_rn(diff, tl.maximum(tl.abs(logit), top[:, None]))
    if LOW:
        ratio = ratio.to(LDT).to(tl.float32)
    e = tl.exp(tl.where(ratio > threshold, float("-inf"), left) - top[:, None])  # top: the largest left, kept
    return e / tl.sum(e, axis=1)[:, None]


def sparsemixer_threshold(logits, softmax_fp32: bool, jitter_eps: float) -> float:
    """2 * jitter_eps as PyTorch compares the sparsemixer's ratios with it: rounded to the dtype they are in (the
    logits', or fp32 with `softmax_fp32`)."""
    return _rounded(2 * jitter_eps, torch.float32 if softmax_fp32 else logits.dtype)


def _runs_low(logits, softmax_fp32: bool) -> bool:
    """Whether the routing's scores are computed, and rounded, in the logits' 16-bit dtype (SOFTMAX_LOW)."""
    return (not softmax_fp32) and logits.dtype != torch.float32


def _sparsemixer_args(routing, logits, softmax_fp32: bool, jitter_eps: float) -> dict:
    """The routing kernels' sparsemixer arguments (its rounded threshold), computed only for that routing: the
    host path of every other routing is not charged for them."""
    if routing != "sparsemixer":
        return {}
    return dict(threshold=sparsemixer_threshold(logits, softmax_fp32, jitter_eps))


@functools.cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=dtype))


@triton.jit
def _take(mat, cols, idx):
    """mat[t, idx[t]] for a [BT, BE] tile."""
    return tl.sum(tl.where(cols[None, :] == idx[:, None], mat, 0.0), axis=1)


@triton.jit
def _argmax_first(cur, cols, BLOCK: tl.constexpr):
    """Row-wise (max, lowest index holding it): a deterministic tie-break."""
    mx = tl.max(cur, axis=1)
    idx = tl.min(tl.where(cur == mx[:, None], cols[None, :], BLOCK), axis=1)
    return mx, idx


@triton.jit
def repeats_before(ids, kcols, idk, k):
    """How many of the slots before k of each row of `ids` [BLOCK_T, K_PAD] hold idk[t]: given ids (hash routing)
    may name an expert twice, and the second pair goes after the first."""
    return tl.sum(((kcols[None, :] < k) & (ids == idk[:, None])).to(tl.int32), axis=1)


@triton.jit
def place_pairs(pos_mat, idk, k, rows, rmask, cols, K: tl.constexpr, sorted_pair_ptr, pair_pos_ptr, repeats=0):
    """The sort's last step for slot k of each row's token: pair t * K + k goes to position pos_mat[t, idk[t]]
    (its expert's start + the earlier pairs of that expert), plus `repeats`, its row's earlier pairs of the same
    expert; both directions of the permutation are written."""
    pos = tl.sum(tl.where(cols[None, :] == idk[:, None], pos_mat, 0), axis=1) + repeats
    tl.store(pair_pos_ptr + rows * K + k, pos, mask=rmask)
    tl.store(sorted_pair_ptr + pos, rows * K + k, mask=rmask)


@triton.jit
def _route_fwd_kernel(
    logits_ptr, sel_bias_ptr, w_ptr, ids_ptr, counts_ptr,
    T, E, stride_lt, group_size, renorm_eps, routed_scale,
    K: tl.constexpr, K_PAD: tl.constexpr, ROUTING: tl.constexpr, SOFTMAX_LOW: tl.constexpr,
    HAS_SEL_BIAS: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, G_PAD: tl.constexpr,
    RENORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    expert_count_ptr=None, expert_start_ptr=None, expert_end_ptr=None, sorted_pair_ptr=None, pair_pos_ptr=None,
    DISPATCH: tl.constexpr = False, SEL_LOW: tl.constexpr = False, renorm_min=0.0, GROUP_TOP: tl.constexpr = 2,
    given_ids_ptr=None, GIVEN_IDS: tl.constexpr = False, expert_scale_ptr=None, EXPERT_SCALE: tl.constexpr = False,
    threshold=0.0, ROUND_TO: tl.constexpr = 0,
):
    """DISPATCH (the only program: T <= BLOCK_T): also the scan and the scatter of `dispatch.py` for its one
    chunk, from the same picks, so a few-token call skips those two launches.

    HAS_SEL_BIAS: the selection bias is added to what the top-k ranks (`choice`), never to `value`;
    SEL_LOW: that sum is rounded to the logits' dtype, as PyTorch rounds a 16-bit score plus a 16-bit bias.
    N_GROUP > 1: only the TOPK_GROUP groups with the largest sums of their GROUP_TOP largest choices can be chosen.
    GIVEN_IDS: the ids are read from `given_ids_ptr` [T, K] instead of chosen (each clamped into [0, E), so that
    an id out of range, the caller's error, cannot send a pair outside the buffers); the weights are `value` there.
    EXPERT_SCALE: each weight is multiplied last by its expert's `expert_scale` value (in fp32, before the store's
    rounding). ROUND_TO (`ROUND_CODES`): the weights are rounded to bf16 (1) or fp16 (2) before an fp32 store
    (`round_weights`).
    ROUTING 5 (sparsemixer): round k's pick is the largest logit left; its weight, the round's softmax at the pick
    (`_sparsemixer_gates`, rounded to the logits' dtype where SOFTMAX_LOW); `threshold` is 2 * jitter_eps."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    rmask = rows < T
    cmask = cols < E
    lmask = rmask[:, None] & cmask[None, :]
    LDT = logits_ptr.dtype.element_ty
    # Rows past T read zeros (not -inf) so that no NaN is computed; columns past E read -inf.
    logit = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_lt + cols[None, :], mask=lmask,
                    other=0.0).to(tl.float32)
    logit = tl.where(cmask[None, :], logit, float("-inf"))
    ninf = float("-inf")

    if ROUTING == 0:  # softmax over all E, then top-k of the probabilities
        m = tl.max(logit, axis=1)
        p = tl.where(lmask, tl.exp(logit - m[:, None]), 0.0)
        value = p / tl.sum(p, axis=1)[:, None]
        if SOFTMAX_LOW:  # HF runs this softmax in the logits' dtype
            value = value.to(LDT).to(tl.float32)
        choice = tl.where(cmask[None, :], value, ninf)
    elif ROUTING == 1 or ROUTING == 5:  # top-k of the logits, softmax over the k afterwards; sparsemixer
        value = logit
        choice = tl.where(cmask[None, :], logit, ninf)
    elif ROUTING == 3:  # top-k of the logits, sigmoid of the k picked (Llama4)
        value = 1.0 / (1.0 + tl.exp(-logit))
        if SOFTMAX_LOW:  # sigmoid in the logits' dtype
            value = value.to(LDT).to(tl.float32)
        choice = tl.where(cmask[None, :], logit, ninf)
    elif ROUTING == 4:  # sqrt(softplus(logits)) scores (DeepSeek-V4)
        if SOFTMAX_LOW:  # each op in the logits' dtype, as PyTorch rounds softplus, then sqrt
            value = tl.sqrt(_softplus(logit).to(LDT).to(tl.float32)).to(LDT).to(tl.float32)
        else:
            value = tl.sqrt(_softplus(logit))
        choice = tl.where(cmask[None, :], value, ninf)
    else:  # sigmoid scores
        value = 1.0 / (1.0 + tl.exp(-logit))
        if SOFTMAX_LOW:  # sigmoid in the logits' dtype (LFM2-MoE)
            value = value.to(LDT).to(tl.float32)
        choice = tl.where(cmask[None, :], value, ninf)
    if HAS_SEL_BIAS:  # chooses only
        choice = choice + tl.load(sel_bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if SEL_LOW:
            choice = choice.to(LDT).to(tl.float32)
    if N_GROUP > 1:  # keep the TOPK_GROUP groups whose GROUP_TOP largest choices sum the largest
        gid = cols // group_size
        gcols = tl.arange(0, G_PAD)
        gscore = tl.full((BLOCK_T, G_PAD), ninf, tl.float32)
        for g in tl.static_range(N_GROUP):
            c = tl.where((gid == g)[None, :], choice, ninf)
            m1, i1 = _argmax_first(c, cols, BLOCK_E)
            if GROUP_TOP == 2:
                m1 += tl.max(tl.where(cols[None, :] == i1[:, None], ninf, c), axis=1)
            gscore = tl.where(gcols[None, :] == g, m1[:, None], gscore)
        keep = tl.zeros((BLOCK_T, BLOCK_E), tl.int32)
        for j in tl.static_range(TOPK_GROUP):
            _, gi = _argmax_first(gscore, gcols, G_PAD)
            keep += (gid[None, :] == gi[:, None]).to(tl.int32)
            gscore = tl.where(gcols[None, :] == gi[:, None], ninf, gscore)
        choice = tl.where(keep > 0, choice, ninf)

    kcols = tl.arange(0, K_PAD)
    top_v = tl.zeros((BLOCK_T, K_PAD), tl.float32)
    top_i = tl.zeros((BLOCK_T, K_PAD), tl.int32)
    picked = tl.zeros((BLOCK_T, BLOCK_E), tl.int32)
    for k in tl.static_range(K):
        if GIVEN_IDS:
            idx = tl.load(given_ids_ptr + rows * K + k, mask=rmask, other=0).to(tl.int32)
            idx = tl.minimum(tl.maximum(idx, 0), E - 1)
        else:
            top, idx = _argmax_first(choice, cols, BLOCK_E)
        if ROUTING == 5:
            wk = _take(_sparsemixer_gates(logit, choice, top, threshold, SOFTMAX_LOW, LDT), cols, idx)
            if SOFTMAX_LOW:
                wk = wk.to(LDT).to(tl.float32)
        else:
            wk = _take(value, cols, idx)
        top_v = tl.where(kcols[None, :] == k, wk[:, None], top_v)
        top_i = tl.where(kcols[None, :] == k, idx[:, None], top_i)
        hit = cols[None, :] == idx[:, None]
        picked += hit.to(tl.int32)
        choice = tl.where(hit, ninf, choice)

    kmask = kcols < K
    if ROUTING == 1:
        mk = tl.max(tl.where(kmask[None, :], top_v, ninf), axis=1)
        ek = tl.where(kmask[None, :], tl.exp(top_v - mk[:, None]), 0.0)
        top_v = ek / tl.sum(ek, axis=1)[:, None]
        if SOFTMAX_LOW:
            top_v = top_v.to(LDT).to(tl.float32)
    if RENORM:
        top_v = top_v / _renorm_denominator(tl.sum(tl.where(kmask[None, :], top_v, 0.0), axis=1), renorm_min,
                                            renorm_eps)[:, None]
    top_v = top_v * routed_scale
    omask = rmask[:, None] & kmask[None, :]
    if EXPERT_SCALE:
        top_v = top_v * tl.load(expert_scale_ptr + top_i, mask=omask, other=0.0).to(tl.float32)
    if ROUND_TO == 1:
        top_v = top_v.to(tl.bfloat16).to(tl.float32)
    elif ROUND_TO == 2:
        top_v = top_v.to(tl.float16).to(tl.float32)

    offs = rows[:, None] * K + kcols[None, :]
    tl.store(w_ptr + offs, top_v.to(w_ptr.dtype.element_ty), mask=omask)
    tl.store(ids_ptr + offs, top_i.to(tl.int64), mask=omask)
    picked = tl.where(rmask[:, None], picked, 0)
    counts = tl.sum(picked, axis=0)
    if DISPATCH:  # as _scan_kernel and _scatter_kernel do it for one chunk (whose offsets are all 0)
        end = tl.cumsum(counts, axis=0)
        tl.store(expert_count_ptr + cols, counts, mask=cmask)
        tl.store(expert_start_ptr + cols, end - counts, mask=cmask)
        tl.store(expert_end_ptr + cols, end, mask=cmask)
        pos_mat = (end - counts)[None, :] + tl.cumsum(picked, axis=0) - picked
        for k in tl.static_range(K):
            idk = tl.sum(tl.where(kcols[None, :] == k, top_i, 0), axis=1)
            if GIVEN_IDS:
                place_pairs(pos_mat, idk, k, rows, rmask, cols, K, sorted_pair_ptr, pair_pos_ptr,
                            repeats_before(top_i, kcols, idk, k))
            else:
                place_pairs(pos_mat, idk, k, rows, rmask, cols, K, sorted_pair_ptr, pair_pos_ptr)
    else:
        tl.store(counts_ptr + pid * BLOCK_E + cols, counts)


def _selection_rounds(logits, selection_bias, routing, softmax_fp32) -> bool:
    """Whether PyTorch rounds the biased selection scores to 16 bits: the ranked values (the probabilities or
    sigmoid scores, or the logits for topk_softmax, where softmax_fp32=False; the logits for topk_sigmoid) and the
    bias are both in the logits' 16-bit dtype."""
    if selection_bias is None or logits.dtype == torch.float32 or selection_bias.dtype != logits.dtype:
        return False
    return routing == "topk_sigmoid" or not softmax_fp32


def route(logits, selection_bias, *, top_k, routing, softmax_fp32, renormalize, renorm_eps, routed_scale, n_group,
          topk_group, weights_dtype, dispatch=None, renorm_min=0.0, group_top=2, expert_ids=None, expert_scale=None,
          jitter_eps=0.0, round_to=None):
    """(topk_weights [T, K], topk_ids [T, K] int64, chunk_counts [n_chunks, BLOCK_E] int32, BLOCK_T).
    `expert_ids` [T, K]: the ids, given (`mok::fused_moe`'s argument), not chosen. `expert_scale` [E]: the
    weights' per-expert factor. `jitter_eps`: the sparsemixer's. `round_to`: a 16-bit dtype the weights are rounded
    through (`round_weights`, `round_weights_to`), or None.

    `dispatch` (a `Dispatch.unsorted` for these T * K pairs): also sort the pairs into it, in this launch where
    one program holds every token (chunk_counts is then None: its one row is `dispatch.bucket_count`), else
    with `Dispatch.sort`'s two launches after it."""
    T, E = logits.shape
    block_t, block_e = routing_block(E, T)
    n_chunks = cdiv(T, block_t)
    w = torch.empty((T, top_k), dtype=weights_dtype, device=logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=logits.device)
    grouped = n_group > 1
    fused = dispatch is not None and n_chunks == 1
    counts = None if fused else torch.empty((n_chunks, block_e), dtype=torch.int32, device=logits.device)
    if T > 0:
        logits = logits if logits.stride(1) == 1 else logits.contiguous()
        launcher(_route_fwd_kernel)[(n_chunks,)](
            logits, selection_bias if selection_bias is not None else logits, w, ids,
            counts if counts is not None else dispatch.bucket_count,  # fused: not written
            T, E, logits.stride(0), E // n_group if grouped else E, float(renorm_eps), float(routed_scale),
            K=top_k, K_PAD=next_power_of_2(top_k), ROUTING=ROUTING_CODES[routing],
            SOFTMAX_LOW=_runs_low(logits, softmax_fp32),
            HAS_SEL_BIAS=selection_bias is not None, SEL_LOW=_selection_rounds(logits, selection_bias, routing,
                                                                               softmax_fp32),
            N_GROUP=n_group if grouped else 1, TOPK_GROUP=topk_group if grouped else 1,
            G_PAD=next_power_of_2(max(n_group, 2)), GROUP_TOP=group_top, RENORM=renormalize,
            renorm_min=float(renorm_min), **_sparsemixer_args(routing, logits, softmax_fp32, jitter_eps),
            BLOCK_T=block_t, BLOCK_E=block_e, num_warps=routing_warps(block_t, block_e),
            **({} if not fused else dict(
                expert_count_ptr=dispatch.bucket_count, expert_start_ptr=dispatch.bucket_start,
                expert_end_ptr=dispatch.bucket_end, sorted_pair_ptr=dispatch.sorted_pair,
                pair_pos_ptr=dispatch.pair_pos, DISPATCH=True)),
            **({} if expert_ids is None else dict(given_ids_ptr=expert_ids, GIVEN_IDS=True)),
            **({} if expert_scale is None else dict(expert_scale_ptr=expert_scale, EXPERT_SCALE=True)),
            **({} if round_to is None else dict(ROUND_TO=ROUND_CODES[round_to])),
        )
        if dispatch is not None and not fused:
            dispatch.sort(ids, counts, block_t, repeats=expert_ids is not None)
    return w, ids, counts, block_t


@triton.jit
def _route_bwd_kernel(
    logits_ptr, ids_ptr, pair_pos_ptr, dw_part_ptr, dw_extra_ptr, dlogits_ptr,
    T, E, stride_lt, n_parts, TK, renorm_eps, routed_scale,
    K: tl.constexpr, K_PAD: tl.constexpr, ROUTING: tl.constexpr, RENORM: tl.constexpr, HAS_EXTRA: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, renorm_min=0.0,
    expert_scale_ptr=None, dscale_sorted_ptr=None, EXPERT_SCALE: tl.constexpr = False, num_experts=0,
    identity_dot_ptr=None, IDENTITY: tl.constexpr = False, threshold=0.0, LOW: tl.constexpr = False,
    ZERO: tl.constexpr = False,
):
    """d(logits) [T, E] fp32 from d(topk_weights), recomputing the pre-renorm weights from the logits (the
    sparsemixer's, ROUTING 5: each round's softmax over the experts it kept, whose masks are recomputed as the
    forward rounded them, LOW and `threshold` as its SOFTMAX_LOW and `threshold`).

    d(topk_weights) arrives as partial sums over tiles of I ([n_parts, T*K] at each pair's sorted
    position), summed here in a fixed order, plus `dw_extra` (given grads, down-bias term).
    EXPERT_SCALE: the weights were w * s[ids]; each pair's d(weight) * w goes to `dscale_sorted` at its sorted
    position (the caller sums them per expert), and w's gradient is d(weight) * s[ids].
    IDENTITY: pairs whose id is num_experts or more (identity experts) ran no expert: their sorted positions hold
    no partial sums; their d(weight) is their token's <grad_out, x> (`identity_dot_ptr` [T]), plus `dw_extra`.
    ZERO (with IDENTITY): those are zero experts' pairs, which added nothing: their d(weight) is `dw_extra` alone."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    kcols = tl.arange(0, K_PAD)
    rmask = rows < T
    cmask = cols < E
    kmask = kcols < K
    lmask = rmask[:, None] & cmask[None, :]
    omask = rmask[:, None] & kmask[None, :]
    # Rows past T read zeros (not -inf) so that no NaN is computed; columns past E read -inf.
    logit = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_lt + cols[None, :], mask=lmask,
                    other=0.0).to(tl.float32)
    logit = tl.where(cmask[None, :], logit, float("-inf"))
    pk = rows[:, None] * K + kcols[None, :]
    ids = tl.load(ids_ptr + pk, mask=omask, other=0).to(tl.int32)
    pos = tl.load(pair_pos_ptr + pk, mask=omask, other=0)
    d = tl.zeros((BLOCK_T, K_PAD), tl.float32)
    part_ptrs = dw_part_ptr + pos
    pmask = omask
    if IDENTITY:
        pmask = omask & (ids < num_experts)
    # Fixed order over the I-tiles. Unrolled, so that several loads are in flight at once (the adds stay in
    # order: the same bits); one at a time, Mixtral's 112 parts took 51 us at T=256 (NOTES v37).
    for _ in tl.range(0, n_parts, loop_unroll_factor=8):
        d += tl.load(part_ptrs, mask=pmask, other=0.0)
        part_ptrs += TK
    if IDENTITY and not ZERO:
        dot = tl.load(identity_dot_ptr + rows, mask=rmask, other=0.0)
        d += tl.where(omask & (ids >= num_experts), dot[:, None], 0.0)
    if HAS_EXTRA:
        d += tl.load(dw_extra_ptr + pk, mask=omask, other=0.0)

    if ROUTING == 0:
        m = tl.max(logit, axis=1)
        p = tl.where(lmask, tl.exp(logit - m[:, None]), 0.0)
        base = p / tl.sum(p, axis=1)[:, None]
    elif ROUTING == 2 or ROUTING == 3:  # 3 (topk_sigmoid): the same sigmoid, of the picked logits only
        base = tl.where(lmask, 1.0 / (1.0 + tl.exp(-logit)), 0.0)
    elif ROUTING == 4:
        base = tl.where(lmask, tl.sqrt(_softplus(logit)), 0.0)
    else:
        base = logit
    LDT = logits_ptr.dtype.element_ty
    w0 = tl.zeros((BLOCK_T, K_PAD), tl.float32)
    left = logit
    for k in tl.static_range(K):
        idk = tl.sum(tl.where(kcols[None, :] == k, ids, 0), axis=1)
        if ROUTING == 5:
            w0k = _take(_sparsemixer_gates(logit, left, _take(logit, cols, idk), threshold, LOW, LDT), cols, idk)
            left = tl.where(cols[None, :] == idk[:, None], float("-inf"), left)
        else:
            w0k = _take(base, cols, idk)
        w0 = tl.where(kcols[None, :] == k, w0k[:, None], w0)
    if ROUTING == 1:  # base held logits: softmax over the k picked
        mk = tl.max(tl.where(kmask[None, :], w0, float("-inf")), axis=1)
        ek = tl.where(kmask[None, :], tl.exp(w0 - mk[:, None]), 0.0)
        w0 = ek / tl.sum(ek, axis=1)[:, None]
    w0 = tl.where(omask, w0, 0.0)
    if RENORM:
        total = tl.sum(w0, axis=1)
        denom = _renorm_denominator(total, renorm_min, renorm_eps)[:, None]
        w1 = w0 / denom
    else:
        w1 = w0
    if EXPERT_SCALE:
        tl.store(dscale_sorted_ptr + pos, d * (w1 * routed_scale), mask=omask)
        d = d * tl.load(expert_scale_ptr + ids, mask=omask, other=0.0).to(tl.float32)
    d = tl.where(omask, d * routed_scale, 0.0)
    if RENORM:  # the sum's gradient stops where the clamp holds it at renorm_min
        d = (d - tl.where(total >= renorm_min, tl.sum(d * w1, axis=1), 0.0)[:, None]) / denom
    if ROUTING == 1:
        d = w0 * (d - tl.sum(w0 * d, axis=1)[:, None])

    scat = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)  # d scattered to the picked experts
    left = logit
    for k in tl.static_range(K):
        idk = tl.sum(tl.where(kcols[None, :] == k, ids, 0), axis=1)
        dk = tl.sum(tl.where(kcols[None, :] == k, d, 0.0), axis=1)
        if ROUTING == 5:  # w0[k] = p_k[id_k]: d l = sum_k d_k w0_k (onehot(id_k) - p_k)
            dwk = dk * tl.sum(tl.where(kcols[None, :] == k, w0, 0.0), axis=1)
            pk = _sparsemixer_gates(logit, left, _take(logit, cols, idk), threshold, LOW, LDT)
            scat += dwk[:, None] * (tl.where(cols[None, :] == idk[:, None], 1.0, 0.0) - pk)
            left = tl.where(cols[None, :] == idk[:, None], float("-inf"), left)
        else:
            scat += tl.where(cols[None, :] == idk[:, None], dk[:, None], 0.0)  # summed: given ids may repeat
    if ROUTING == 0:
        dl = base * (scat - tl.sum(base * scat, axis=1)[:, None])
    elif ROUTING == 1 or ROUTING == 5:
        dl = scat
    elif ROUTING == 4:  # d sqrt(softplus(l)) = sigmoid(l) / (2 s); 0 where s underflowed to 0
        dl = tl.where(base > 0.0, scat * (1.0 / (1.0 + tl.exp(-logit))) / (2.0 * tl.where(base > 0.0, base, 1.0)),
                      0.0)
    else:  # 2, 3: d logits[t, ids] = d w0 * w0 * (1 - w0)
        dl = scat * base * (1.0 - base)
    # Rounded once from fp32 where the caller asked for the router's dtype (as `.to()` would round it).
    tl.store(dlogits_ptr + rows[:, None].to(tl.int64) * E + cols[None, :], dl.to(dlogits_ptr.dtype.element_ty),
             mask=lmask)


@triton.jit
def _row_dot_kernel(a_ptr, b_ptr, out_ptr, T, H, stride_a, stride_b, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    acc = tl.zeros((BLOCK_T,), tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        m = rmask[:, None] & (cols < H)[None, :]
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_a + cols[None, :], mask=m, other=0.0)
        b = tl.load(b_ptr + rows[:, None].to(tl.int64) * stride_b + cols[None, :], mask=m, other=0.0)
        acc += tl.sum(a.to(tl.float32) * b.to(tl.float32), axis=1)
    tl.store(out_ptr + rows, acc, mask=rmask)


def row_dots(a, b):
    """[T] fp32: <a[t], b[t]> for [T, H] a and b (rows of unit stride), in a fixed order. One pass over both: what
    `(a.float() * b.float()).sum(-1)` gives with four launches and two fp32 copies."""
    T, H = a.shape
    out = torch.empty((T,), dtype=torch.float32, device=a.device)
    if T > 0:
        block_t = 8
        launcher(_row_dot_kernel)[(cdiv(T, block_t),)](a, b, out, T, H, a.stride(0), b.stride(0), BLOCK_T=block_t,
                                                       BLOCK_H=min(512, next_power_of_2(H)), num_warps=4)
    return out


def route_backward(logits, topk_ids, pair_pos, dw_parts, dw_extra, *, routing, renormalize, renorm_eps,
                   routed_scale, out_dtype=torch.float32, renorm_min=0.0, expert_scale=None, num_experts=None,
                   identity_dot=None, softmax_fp32=True, jitter_eps=0.0):
    """d(logits) [T, E], computed in fp32 and stored in `out_dtype` (the router's dtype where nothing else
    needs fp32: one cast launch less); `dw_parts` [n_parts, T*K] fp32 partial d(topk_weights) by sorted
    position. With `expert_scale`: (d(logits), [T*K] fp32 each pair's part of d(expert_scale) at its sorted
    position), which the caller sums per expert (`moe._backward`). `num_experts` (fewer than E, the logits'
    width: identity or zero experts): the pairs of ids from it on have no partial sums; `identity_dot` [T] fp32 is
    their d(weight) (<grad_out, x> of their token, `row_dots`), or None for zero experts (d(weight) 0).
    `softmax_fp32`, `jitter_eps`: the sparsemixer's."""
    T, E = logits.shape
    K = topk_ids.shape[1]
    block_t, block_e = route_backward_block(E, T)
    dl = torch.empty((T, E), dtype=out_dtype, device=logits.device)
    scaled = {}
    if expert_scale is not None:
        dscale_sorted = torch.empty((T * K,), dtype=torch.float32, device=logits.device)
        scaled = dict(expert_scale_ptr=expert_scale, dscale_sorted_ptr=dscale_sorted, EXPERT_SCALE=True)
    if num_experts is not None and num_experts < E:
        scaled.update(num_experts=num_experts, identity_dot_ptr=identity_dot, IDENTITY=True, ZERO=identity_dot is None)
    if T > 0:
        logits = logits if logits.stride(1) == 1 else logits.contiguous()
        launcher(_route_bwd_kernel)[(cdiv(T, block_t),)](
            logits, topk_ids, pair_pos, dw_parts, dw_extra if dw_extra is not None else dw_parts, dl,
            T, E, logits.stride(0), dw_parts.shape[0], T * K, float(renorm_eps), float(routed_scale),
            K=K, K_PAD=next_power_of_2(K), ROUTING=ROUTING_CODES[routing], RENORM=renormalize,
            HAS_EXTRA=dw_extra is not None, BLOCK_T=block_t, BLOCK_E=block_e, renorm_min=float(renorm_min),
            LOW=_runs_low(logits, softmax_fp32), **_sparsemixer_args(routing, logits, softmax_fp32, jitter_eps),
            num_warps=routing_warps(block_t, block_e), **scaled,
        )
    return dl if expert_scale is None else (dl, dscale_sorted)
