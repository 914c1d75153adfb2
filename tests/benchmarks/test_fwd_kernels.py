"""The forward kernel split (`benchmarks.fwd_kernels`) on the CPU: which profiled kernels count as expert GEMMs, and
its shape argument. The profiling itself needs a GPU."""

import pytest

from benchmarks.fwd_kernels import BACKWARD_GEMM_MARKERS, launch_order, parse_shapes, split_gemms

# Names as `engines.kernel_times` cuts them (60 characters): CUTLASS's, the router's and inductor's from an H200
# profile (NOTES v41 (5)); the CUDA gate_up's is its C++ symbol, mangled.
CUTLASS = "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kern"
SM90_GATE_UP = "_ZN8mok_sm9014gate_up_kernelE14CUtensorMap_stNS_6ParamsE"
ROUTER = "nvjet_sm90_tst_8x128_64x12_1x2_h_bz_TNN"
INDUCTOR_ACT = "triton_poi_fused__grouped_mm_ge_masked_fill_mul_silu_split_"


def test_the_expert_gemms_are_cutlass_tritons_grouped_gemm_and_the_cuda_gate_up():
    times = {CUTLASS: 16.0, "_grouped_gemm_kernel": 1.5, SM90_GATE_UP: 2.0, "_activation_rows_kernel": 0.7,
             "_combine_kernel": 0.1, ROUTER: 0.04}
    split = split_gemms(times)
    assert split["gemm_ms"] == pytest.approx(19.5)
    assert split["other_ms"] == pytest.approx(0.84)
    assert split["busy_ms"] == pytest.approx(20.34)
    assert list(split["other_kernels"]) == ["_activation_rows_kernel", "_combine_kernel", ROUTER]


def test_the_router_gemm_and_inductors_fused_activation_are_other_work():
    """Near misses: the router's cuBLAS GEMM is a GEMM but not an expert one, and inductor names its SiLU-mul after
    the `_grouped_mm` it reads; neither is an expert GEMM, nor is the op's backward gate_up kernel."""
    split = split_gemms({ROUTER: 0.04, INDUCTOR_ACT: 0.68, "_gate_up_bwd_kernel": 0.3})
    assert split["gemm_ms"] == 0
    assert split["other_ms"] == pytest.approx(1.02)


def test_shapes_are_layer_benchmark_names_with_a_token_count():
    assert parse_shapes("mixtral:16384,qwen3:4096") == [("mixtral", 16384), ("qwen3", 4096)]
    for bad in ("mixtral", "mixtral:", "mixtral:0", "mixtral:4k", "qwen9:4096"):
        with pytest.raises(SystemExit, match="is not name:T"):
            parse_shapes(bad)


def test_the_backward_counts_the_fused_gate_up_backward_and_the_weight_gradients_as_expert_gemms():
    """In a training step the op's `_gate_up_bwd_kernel` and its weight-gradient kernels (Triton's `_wgrad_kernel`,
    the CUDA `wgrad_kernel`) are expert GEMMs; the forward's split (near miss) keeps them as other work."""
    times = {"_gate_up_bwd_kernel": 0.6, "_wgrad_kernel": 0.8, "_ZN8mok_sm9012wgrad_kernelE14CUtensorMap_st": 0.5,
             "_grouped_gemm_kernel": 0.9, "_route_bwd_kernel": 0.02, ROUTER: 0.04}
    split = split_gemms(times, BACKWARD_GEMM_MARKERS)
    assert split["gemm_ms"] == pytest.approx(2.8)
    assert list(split["other_kernels"]) == [ROUTER, "_route_bwd_kernel"]
    assert split_gemms(times)["gemm_ms"] == pytest.approx(0.9)


def test_launch_order_averages_each_position_over_the_calls():
    # Two calls of three kernels, given out of order; the same name twice in one call stays two positions.
    kernels = [("gemm", 12.0, 0.3), ("route", 0.0, 0.01), ("gemm", 1.0, 0.5), ("gemm", 2.0, 0.2),
               ("route", 10.0, 0.03), ("gemm", 11.0, 0.7)]
    assert launch_order(kernels, 2) == [("route", pytest.approx(0.02)), ("gemm", pytest.approx(0.6)),
                                        ("gemm", pytest.approx(0.25))]


def test_launch_order_refuses_calls_that_launched_different_kernels():
    with pytest.raises(ValueError, match="do not split into 2 calls"):
        launch_order([("a", 0.0, 1.0), ("b", 1.0, 1.0), ("a", 2.0, 1.0)], 2)
    with pytest.raises(ValueError, match="launched different kernels"):
        launch_order([("a", 0.0, 1.0), ("b", 1.0, 1.0), ("b", 2.0, 1.0), ("a", 3.0, 1.0)], 2)
