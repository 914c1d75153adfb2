"""fp32 router GEMMs on the tensor cores: each fp32 operand as the sum of three bf16 pieces.

DeepSeek-V3 keeps its router weight in fp32 and computes logits = linear(x.float(), W) (`router_fp32`).
cuBLAS runs that fp32 GEMM on the CUDA cores (SIMT), and so the logits' recompute and the router's two
gradients: at DeepSeek-V3's T=4096, 1.5 ms of a 28 ms layer step plus 0.27 ms of fp32 copies of x
(NOTES-gpu v18 (3)). Here, instead:

    v = hi + mid + lo   exactly, hi = bf16(v), mid = bf16(v - hi), lo = bf16(v - hi - mid)
                        (fp32's 24 significand bits are three bf16 pieces of 8)
    a @ b = sum of the pieces' products, each exact in fp32: summed by the tensor cores within one K step,
            and the steps' sums added in fp32 on the CUDA cores (Hopper's tensor cores do not accumulate
            fp32 to IEEE precision: one accumulator over all of K was 30x less accurate than cuBLAS)

keeping the products down to 2^-16 of the leading one (hi*hi; hi*mid, mid*hi; hi*lo, lo*hi, mid*mid) and
dropping those at 2^-24 and below, the size of fp32's own rounding: a bf16 operand (x) is one piece, so
x @ W takes 3 products; two fp32 operands take 6. The sums run in another order than cuBLAS's, so the
logits agree with HF's to fp32 rounding, not bit for bit (`tests/kernels/test_router_gemm.py` measures
both against float64: 2-4x closer to it than cuBLAS at DeepSeek-V3's sizes). Where the output has too few
tiles to fill the GPU (the logits up to T=1024), cuBLAS's GEMM is faster and is kept; MOK_ROUTER_GEMM=0
(read per call) keeps it everywhere.

Under the CPU interpreter (whose bf16 dot is unreliable) the pieces are fp32 values rounded to bf16,
multiplied with fp32 dots: the same products, exact either way.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import configs
from .grouped_gemm import _tile_of
from .launch import cdiv, launcher

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def enabled(x: torch.Tensor, router: torch.Tensor) -> bool:
    """Whether the fp32 router GEMMs of x's layer take this path: a 16-bit x and an fp32 router on a
    CUDA device with bf16 tensor cores (or the interpreter), unless MOK_ROUTER_GEMM=0."""
    if os.environ.get("MOK_ROUTER_GEMM", "1") == "0":
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or router.dtype != torch.float32:
        return False
    if _INTERPRET:
        return True
    return x.is_cuda and configs.capability(x.device)[0] >= 8


@triton.jit
def _pieces(v, SPLIT: tl.constexpr, BF16_DOT: tl.constexpr):
    """(hi, mid, lo) of fp32 `v` (SPLIT), or `v` itself three times for a bf16 `v` (only the first is used);
    bf16 for the tensor cores (BF16_DOT), else fp32 holding the same values."""
    DT: tl.constexpr = tl.bfloat16 if BF16_DOT else tl.float32
    if SPLIT:
        hi = v.to(tl.bfloat16).to(tl.float32)
        r = v - hi
        mid = r.to(tl.bfloat16).to(tl.float32)
        lo = (r - mid).to(tl.bfloat16).to(tl.float32)
    else:
        hi = v.to(tl.float32)
        mid = hi
        lo = hi
    return hi.to(DT), mid.to(DT), lo.to(DT)


@triton.jit
def _split_mm_kernel(a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                     stride_cm, stride_cn, A_SPLIT: tl.constexpr, B_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BF16_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr):
    """c[M, N] (fp32) = a @ b (+ bias[N]); an operand with SPLIT is fp32 and taken as three bf16 pieces, one
    without is bf16 and taken as is (module doc). One program per output tile, K in order: deterministic."""
    pid_m, pid_n = _tile_of(tl.program_id(0), N, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * stride_am + kk[None, :] * stride_ak
    b_ptrs = b_ptr + kk[:, None] * stride_bk + rn.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + kk) < K
        a = tl.load(a_ptrs, mask=(rm < M)[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None] & (rn < N)[None, :], other=0.0)
        a_hi, a_mid, a_lo = _pieces(a, A_SPLIT, BF16_DOT)
        b_hi, b_mid, b_lo = _pieces(b, B_SPLIT, BF16_DOT)
        # This K step's products, smallest first, summed by the tensor cores; then added to the fp32 total on
        # the CUDA cores. (Hopper's fp32 accumulation inside the tensor cores is not IEEE: one accumulator
        # over all of K lost ~5 bits at K=7168 (NOTES-gpu v18 (3)); over one BLOCK_K step it stays small.)
        p = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        if A_SPLIT and B_SPLIT:
            p = tl.dot(a_mid, b_mid, p, input_precision="ieee")
        if B_SPLIT:
            p = tl.dot(a_hi, b_lo, p, input_precision="ieee")
        if A_SPLIT:
            p = tl.dot(a_lo, b_hi, p, input_precision="ieee")
        if B_SPLIT:
            p = tl.dot(a_hi, b_mid, p, input_precision="ieee")
        if A_SPLIT:
            p = tl.dot(a_mid, b_hi, p, input_precision="ieee")
        p = tl.dot(a_hi, b_hi, p, input_precision="ieee")
        acc += p
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn.to(tl.int64)[None, :] * stride_cn
    tl.store(c_ptrs, acc, mask=(rm < M)[:, None] & (rn < N)[None, :])


_MIN_TILES = 128


def on_tensor_cores(M: int, N: int) -> bool:
    """Whether an [M, N] output takes the kernel: not where it has too few tiles to fill the GPU, each with a
    long K loop (DeepSeek-V3's logits up to T=1024: 64 or fewer), which cuBLAS's fp32 GEMM does faster
    (NOTES-gpu v18 (3)). Always under the interpreter (its tests)."""
    return _kernel_blocks(M, N) is not None


def _kernel_blocks(M, N):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by how many tiles fill an H200's 132 SMs: 128 x 128
    where that gives two waves (DeepSeek-V3's d(x): T x H), 64 x 128 where one (d(router): E x H), else
    64 x 64 (the logits: T x E); None below _MIN_TILES tiles (`on_tensor_cores`). Measured on an H200 at
    DeepSeek-V3's sizes (NOTES-gpu v18 (3))."""
    if _INTERPRET:
        return 16, 16, 16, 1, 1
    if cdiv(M, 128) * cdiv(N, 128) >= 264:
        return 128, 128, 32, 8, 3
    if cdiv(M, 64) * cdiv(N, 128) >= 132:
        return 64, 128, 64, 4, 3
    return (64, 64, 64, 4, 3) if cdiv(M, 64) * cdiv(N, 64) >= _MIN_TILES else None


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 a @ b (+ bias) for 2-d a [M, K] and b [K, N], each bf16 or fp32 (any strides); fp16 operands
    are taken as fp32 (exact). The accuracy of an fp32 GEMM, on the tensor cores (module doc), or cuBLAS's
    fp32 GEMM where the output has too few tiles to fill the GPU."""
    a = a if a.dtype in (torch.bfloat16, torch.float32) else a.float()
    b = b if b.dtype in (torch.bfloat16, torch.float32) else b.float()
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0:
        return torch.empty((M, N), dtype=torch.float32, device=a.device)
    blocks = _kernel_blocks(M, N)
    if blocks is None:
        a, b = a.float(), b.float()
        return torch.mm(a, b) if bias is None else torch.addmm(bias.float(), a, b)
    bm, bn, bk, warps, stages = blocks
    c = torch.empty((M, N), dtype=torch.float32, device=a.device)
    launcher(_split_mm_kernel)[(cdiv(M, bm) * cdiv(N, bn),)](
        a, b, bias.contiguous() if bias is not None else c, c, M, N, K, a.stride(0), a.stride(1), b.stride(0),
        b.stride(1), c.stride(0), c.stride(1), A_SPLIT=a.dtype == torch.float32, B_SPLIT=b.dtype == torch.float32,
        HAS_BIAS=bias is not None, BF16_DOT=not _INTERPRET, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=8, num_warps=warps, num_stages=stages)
    return c
