"""`mok::fused_moe` under autocast computes as it does without: the op computes in its operands' dtypes, and its
kernels run with autocast's key excluded. Without that, autocast (a custom op has no autocast kernel, so autocast
falls through to the op's kernels) casts the kernels' inner torch calls: the C++ kernel's router linear ran in bf16
on fp32 operands and then failed on its fp32 output buffer. Forward and backward, bit for bit, on the CPU kernel and
(GPU) the Triton kernels."""

import pytest
import torch

from .moe_cases import CASES_BY_NAME, make_args

CASES = ["softmax_topk_renorm_scale_wdtype", "sigmoid_deepseek_v3", "topk_softmax_router_bias_bf16", "silu_bias"]


def _step(args, kw):
    """(out, topk_weights, topk_ids, every input's gradient (None for the selection bias's)) of one forward and
    backward."""
    args = [None if a is None else a.detach().requires_grad_(a.is_floating_point()) for a in args]
    out, w, ids = torch.ops.mok.fused_moe(*args, **kw)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out)
    (out * go).sum().backward()
    return [out, w, ids] + [a.grad for a in args if a is not None and a.requires_grad]


def _check_unchanged_under_autocast(name, device):
    args, kw = make_args(CASES_BY_NAME[name], T=37, H=32, I=16, seed=1)
    args = [None if a is None else a.to(device) for a in args]
    want = _step(args, kw)
    with torch.autocast(device, dtype=torch.bfloat16):
        got = _step(args, kw)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))


@pytest.mark.parametrize("name", CASES)
def test_the_op_under_cpu_autocast_computes_as_without(name):
    _check_unchanged_under_autocast(name, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name", CASES)
def test_the_op_under_cuda_autocast_computes_as_without(name):
    _check_unchanged_under_autocast(name, "cuda")
