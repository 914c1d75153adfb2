"""GPU (Triton) kernels of `mok::fused_moe`. Being written."""
