"""Which GEMM engine each stage takes (`configs.engine`): thresholds, weight layout, MOK_GEMM_ENGINE."""

import pytest

from mok_compile.kernels import configs


@pytest.fixture(autouse=True)
def no_forced_engine(monkeypatch):
    monkeypatch.delenv("MOK_GEMM_ENGINE", raising=False)


def test_thresholds_by_rows_per_expert():
    assert configs.engine("gathered", 256) == "triton" and configs.engine("gathered", 512) == "cutlass"
    assert configs.engine("down", 511) == "triton" and configs.engine("down", 512) == "cutlass"
    assert configs.engine("dgrad", 511) == "triton" and configs.engine("dgrad", 512) == "cutlass"
    assert configs.engine("wgrad", 32) == "triton" and configs.engine("wgrad", 64) == "cutlass"


def test_gathered_stage_takes_cutlass_only_for_wide_experts():
    mixtral, gpt_oss, qwen3 = 4096 * 14336, 2880 * 2880, 2048 * 768
    assert configs.engine("gathered", 1024, expert_size=mixtral) == "cutlass"
    assert configs.engine("gathered", 256, expert_size=mixtral) == "triton"  # the row threshold still holds
    for size in (gpt_oss, qwen3):
        assert configs.engine("gathered", 10_000, expert_size=size) == "triton"
        assert configs.engine("down", 512, expert_size=size) == "cutlass"  # the other stages do not look at it


def test_transposed_weights_take_cutlass_weight_gradients_at_any_size():
    assert configs.engine("wgrad", 1, transposed=True) == "cutlass"
    assert configs.engine("wgrad", 1, transposed=False) == "triton"
    # only the weight gradient depends on the layout
    for stage in ("gathered", "down", "dgrad"):
        assert configs.engine(stage, 32, transposed=True) == "triton"


def test_forced_engines(monkeypatch):
    monkeypatch.setenv("MOK_GEMM_ENGINE", "triton")
    assert configs.engine("wgrad", 10_000, transposed=True) == "triton"
    monkeypatch.setenv("MOK_GEMM_ENGINE", "gathered=cutlass,sorted=triton")
    assert configs.engine("gathered", 1) == "cutlass"
    assert configs.engine("down", 10_000) == "triton" and configs.engine("dgrad", 10_000) == "triton"
    assert configs.engine("wgrad", 1) == "triton"  # not named: the threshold decides
    monkeypatch.setenv("MOK_GEMM_ENGINE", "sorted=triton,dgrad=cutlass")  # a stage's own entry wins
    assert configs.engine("down", 10_000) == "triton" and configs.engine("dgrad", 1) == "cutlass"
    monkeypatch.setenv("MOK_GEMM_ENGINE", "down=cuda")
    with pytest.raises(ValueError, match="stage 'down' must be one of triton, cutlass, got 'cuda'"):
        configs.engine("down", 1)
    monkeypatch.setenv("MOK_GEMM_ENGINE", "down=sm90")  # the Hopper CUDA kernels: forward gate_up and wgrad only
    with pytest.raises(ValueError, match="stage 'down' must be one of triton, cutlass, got 'sm90'"):
        configs.engine("down", 1)


def test_gate_up_engine(monkeypatch):
    """The forward gate_up follows the gathered stage unless MOK_GEMM_ENGINE names it: the Hopper CUDA kernel
    ('sm90') only on request (configs.gate_up_engine: not faster in the layer, NOTES v28)."""
    monkeypatch.delenv("MOK_GEMM_ENGINE", raising=False)
    assert configs.gate_up_engine("triton") == "triton" and configs.gate_up_engine("cutlass") == "cutlass"
    monkeypatch.setenv("MOK_GEMM_ENGINE", "triton")
    assert configs.gate_up_engine("cutlass") == "triton"
    monkeypatch.setenv("MOK_GEMM_ENGINE", "gate_up=sm90")
    assert configs.gate_up_engine("triton") == "sm90"
    assert configs.engine("gathered", 1) == "triton"  # the backward's gathered GEMMs are not forced by it
    monkeypatch.setenv("MOK_GEMM_ENGINE", "gate_up=cuda")
    with pytest.raises(ValueError, match="stage 'gate_up' must be one of sm90, triton, cutlass"):
        configs.gate_up_engine("triton")


def test_cuda_weight_gradients_only_on_request(monkeypatch):
    """The weight gradients take the Hopper CUDA kernel ('sm90') only when MOK_GEMM_ENGINE names it (slower than
    CUTLASS in the layer, NOTES v29); `moe._engines` then falls back to CUTLASS for a call that does not fit it."""
    import torch

    from mok_compile.kernels import moe

    for rows in (1, 64, 10_000):
        assert configs.engine("wgrad", rows) != "sm90" and configs.engine("wgrad", rows, transposed=True) != "sm90"
    monkeypatch.setenv("MOK_GEMM_ENGINE", "wgrad=sm90")
    assert configs.engine("wgrad", 1) == "sm90" and configs.engine("down", 1) == "triton"
    monkeypatch.setattr(moe.cutlass_gemm, "eligible", lambda *args: True)  # as for bf16 on Hopper
    x, w1, w2 = torch.zeros(4, 64), torch.zeros(8, 128, 64), torch.zeros(8, 64, 64)  # on the CPU: does not fit
    kw = dict(transposed=False, gated=True, activation="silu", interleaved=False)
    assert moe._engines(x, w1, w2, 64, 256.0, kw)["wgrad"] == "cutlass"
    monkeypatch.setattr(moe.wgrad_sm90, "eligible", lambda *args: True)
    monkeypatch.setattr(moe.wgrad_sm90, "available", lambda: True)
    assert moe._engines(x, w1, w2, 64, 256.0, kw)["wgrad"] == "sm90"
