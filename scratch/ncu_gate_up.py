"""One gate_up launch (Triton) and the same GEMM through CUTLASS at the Qwen3 T=4096 shape, for ncu."""
import torch
from mok_compile.kernels import tune, cutlass_gemm, moe
p = tune._Problem(2048, 768, 128, 8, 4096)
cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
p.launch("gate_up", cfg)
a = cutlass_gemm.gather_rows(p.x, p.disp)
w = moe._kn(p.w1, False)
torch.cuda.synchronize()
for _ in range(2):
    p.launch("gate_up", cfg)
    cutlass_gemm.grouped_mm(a, w, p.disp)
torch.cuda.synchronize()
