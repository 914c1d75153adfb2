"""`router_gemm.matmul` (fp32 operands as three bf16 pieces on the tensor cores) against float64, next to the
fp32 GEMM it replaces: it must be as accurate. On the CPU under TRITON_INTERPRET=1 (in a subprocess: the variable
must be set before Triton is imported) and on the GPU at DeepSeek-V3's router sizes."""

import pytest

from tests.kernels.interpreted import background, run_interpreted, script_argv

pytest.importorskip("triton")


def _check(results, slack):
    for r in results:
        M, K, N = r["case"][:3]
        assert r["shape"] == [M, N] and r["dtype"] == "torch.float32", r
        assert r["again"], r  # bitwise the same on a second call
        if M and N and K:
            # An fp32-accurate GEMM: dropping even the 2^-16 products (mid * mid) would show as ~1e-5 here.
            assert r["err"] <= slack * r["fp32_err"] + 1e-8, r
        elif M and N:
            assert r["zero"], r  # K = 0: the bias alone, zero here


_CPU_RUN = ("import json\nfrom tests.kernels.router_gemm_cases import CPU_CASES, compare\n"
            "print(json.dumps([compare(*c) for c in CPU_CASES]))")


@background(script_argv(_CPU_RUN))
def test_split_pieces_match_an_fp32_gemm_interpreted():
    results = run_interpreted(_CPU_RUN)
    assert len(results) == 7
    _check(results, slack=1.5)


def test_router_gemm_switch(monkeypatch):
    import torch

    from mok_compile.kernels import router_gemm

    x, w = torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(3, 4)
    assert not router_gemm.enabled(x, w)  # a CPU tensor outside the interpreter: the C++ kernels' business
    assert not router_gemm.enabled(x.float(), w) and not router_gemm.enabled(x, w.bfloat16())
    if torch.cuda.is_available():
        assert router_gemm.enabled(x.cuda(), w.cuda()) == (torch.cuda.get_device_capability()[0] >= 8)
        monkeypatch.setenv("MOK_ROUTER_GEMM", "0")
        assert not router_gemm.enabled(x.cuda(), w.cuda())


def test_small_outputs_stay_on_cublas():
    """DeepSeek-V3 (H=7168, E=256): the logits take the kernel from T=2048 on (below, too few tiles: cuBLAS was
    faster on the H200), the router's gradients at any T from 256."""
    from mok_compile.kernels import router_gemm

    E, H = 256, 7168
    assert [router_gemm.on_tensor_cores(T, E) for T in (1, 256, 1024, 2048, 4096)] == [False] * 3 + [True] * 2
    assert router_gemm.on_tensor_cores(E, H) and all(router_gemm.on_tensor_cores(T, H) for T in (256, 4096))


@pytest.mark.parametrize("blocks", [(64, 128, 32, 4, 3), (128, 128, 32, 8, 3)])
def test_compiles_to_wgmma_for_hopper(blocks):
    """On the CPU, for sm_90 (the GPU run is where a compile error would show otherwise): bf16 tensor-core
    dots, 3 per K step with one fp32 operand and 6 with two."""
    from mok_compile.kernels.router_gemm import _split_mm_kernel as fn
    from tests.kernels.sm90 import compile_for_sm90

    bm, bn, bk, warps, stages = blocks
    counts = {}
    for a_split, b_split in [(False, True), (True, False), (True, True)]:
        types = dict(a_ptr="*fp32" if a_split else "*bf16", b_ptr="*fp32" if b_split else "*bf16", bias_ptr="*fp32",
                     c_ptr="*fp32", **dict.fromkeys(("stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm",
                                                     "stride_cn"), "i64"))
        consts = dict(A_SPLIT=a_split, B_SPLIT=b_split, HAS_BIAS=True, BF16_DOT=True, BLOCK_M=bm, BLOCK_N=bn,
                      BLOCK_K=bk, GROUP_M=8)
        ptx = compile_for_sm90(fn, consts, types, ("a_ptr", "b_ptr", "c_ptr"), num_warps=warps, num_stages=stages).asm["ptx"]
        assert ".bf16.bf16" in ptx
        counts[a_split, b_split] = ptx.count("wgmma.mma_async")
    assert counts[False, True] == counts[True, False] > 0 and counts[True, True] == 2 * counts[False, True], counts


@pytest.mark.gpu
def test_split_pieces_match_an_fp32_gemm_on_the_gpu():
    """DeepSeek-V3's router at T=4096 (H=7168, E=256): logits, d(router), d(x); bf16 tensor cores, and cuBLAS's
    fp32 as the yardstick. Hopper's fp32 accumulation of the pieces is not IEEE-exact: within 2x of cuBLAS."""
    import torch

    from mok_compile.kernels import router_gemm
    from tests.kernels.router_gemm_cases import compare

    bf16, f32 = torch.bfloat16, torch.float32
    cases = [(4096, 7168, 256, bf16, f32, True, False), (256, 4096, 7168, f32, bf16, False, True),
             (4096, 256, 7168, f32, f32, False, False)]
    assert all(router_gemm.on_tensor_cores(M, N) for M, _, N, *_ in cases)
    cases.append((1, 7168, 256, bf16, f32, False, False))  # T=1: cuBLAS
    _check([compare(*c, device="cuda") for c in cases], slack=2.0)
