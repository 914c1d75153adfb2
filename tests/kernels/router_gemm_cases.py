"""`router_gemm.matmul` against float64 next to the fp32 GEMM it replaces: one comparison for the interpreted
CPU test (run in a subprocess, which imports this module after setting TRITON_INTERPRET) and the GPU test."""

import torch

from tests.kernels.cases import generator, rel_err

bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
# (M, K, N, a dtype, b dtype, bias, a transposed): the three uses (x @ W^T, dl^T @ x, dl @ W), an fp16 operand,
# sizes that are not multiples of the blocks, strided operands, and empty ones.
CPU_CASES = [(37, 70, 45, bf16, f32, True, False), (45, 37, 70, f32, bf16, False, True),
             (37, 45, 70, f32, f32, False, False), (21, 33, 19, f16, f32, True, False),
             (1, 16, 8, bf16, f32, False, False), (0, 16, 8, bf16, f32, True, False), (9, 0, 8, f32, f32, False, False)]


def compare(M, K, N, da, db, with_bias, a_transposed, device="cpu", seed=0) -> dict:
    from mok_compile.kernels import router_gemm

    g = generator(seed, device)
    a = torch.randn((K, M) if a_transposed else (M, K), generator=g, device=device).to(da)
    a = a.t() if a_transposed else a
    b = (torch.randn(N, K, generator=g, device=device) * max(K, 1) ** -0.5).to(db).t()  # [K, N] view, as W^T
    bias = torch.randn(N, generator=g, device=device) if with_bias else None
    ref = a.double() @ b.double() + (bias.double() if with_bias else 0)
    got = router_gemm.matmul(a, b, bias)
    fp32 = a.float() @ b.float() + (bias if with_bias else 0)
    nonzero = bool(ref.numel() and ref.norm() > 0)
    return dict(case=[M, K, N, str(da), str(db)], shape=list(got.shape), dtype=str(got.dtype),
                err=rel_err(got, ref) if nonzero else 0.0, fp32_err=rel_err(fp32, ref) if nonzero else 0.0,
                zero=bool(ref.numel() == 0 or got.abs().sum() == 0),
                again=bool(torch.equal(got, router_gemm.matmul(a, b, bias))))
