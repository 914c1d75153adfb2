"""The fp32 GEMMs' dot precision (`kernels.moe._precision`): TF32 where torch allows it for matmuls, else tf32x3
(about fp32's accuracy on the tensor cores), or Triton's FMA dot with MOK_FP32_DOT=ieee; 16-bit operands ignore it.
The switch is part of a launch plan's signature, so a plan recorded under one choice is not replayed under the
other. GPU numerics of the default: test_triton_gpu.py (fp32 against the reference); speed:
benchmarks.autocast_layer (NOTES v74)."""

import pytest
import torch

pytest.importorskip("triton")

from mok_compile.kernels import moe, plan  # noqa: E402


def test_fp32_is_tf32x3_by_default(no_tf32, monkeypatch):
    monkeypatch.delenv("MOK_FP32_DOT", raising=False)
    assert moe._precision(torch.float32) == "tf32x3"
    monkeypatch.setenv("MOK_FP32_DOT", "ieee")
    assert moe._precision(torch.float32) == "ieee"


def test_fp32_is_tf32_where_torch_allows_it(no_tf32):
    no_tf32.allow_tf32 = True
    assert moe._precision(torch.float32) == "tf32"


def test_16_bit_operands_and_the_plan_switch():
    assert moe._precision(torch.bfloat16) == moe._precision(torch.float16) == "ieee"
    assert "MOK_FP32_DOT" in plan.SWITCHES
