"""`mok::fused_moe` with `round_weights` (Ergo's routing weights: rounded to the input dtype, widened to fp32 again).

The weights are the unrounded op's, rounded through the input dtype; the weighted sum is in fp32 over them; the
gradients are the unrounded op's formula (the rounding reads as the identity). On the C++ kernel, the reference
and the export decomposition; without fp32 weights the flag is an error that names it.
"""

import pytest
import torch

from mok_compile.export.decompose import fused_moe_decomposed
from mok_compile.ops import reference

from .moe_cases import CASES_BY_NAME, make_args

fused_moe = torch.ops.mok.fused_moe.default
CASE = CASES_BY_NAME["sigmoid_deepseek_v3"]


def _args(T, dtype, seed=0):
    """The case's arguments, and its keywords with and without round_weights."""
    args, kw = make_args(CASE, T=T, dtype=dtype, seed=seed)
    return args, {**kw, "round_weights": True}, {**kw, "round_weights": False}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rounded_weights_are_the_weights_rounded(dtype):
    args, kw, plain = _args(31, dtype, seed=2)
    out, w, ids = fused_moe(*args, **kw)
    _, unrounded, same_ids = fused_moe(*args, **plain)
    assert torch.equal(ids, same_ids) and w.dtype == torch.float32
    assert torch.equal(w, unrounded.to(dtype).float()) and not torch.equal(w, unrounded)
    ref = reference.fused_moe_reference(*args, **kw)
    for a, b in zip((out, w, ids), ref, strict=True):
        assert torch.equal(a, b)
    decomposed = fused_moe_decomposed(*args, **kw)
    for a, b in zip((out, w, ids), decomposed, strict=True):
        assert torch.equal(a, b)


def test_rounding_reads_as_the_identity_in_the_backward():
    """The backward of rounded weights is the unrounded op's formula at the rounded weights."""
    args, kw, plain = _args(13, torch.bfloat16, seed=4)
    out, w, ids = fused_moe(*args, **kw)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    rounded = torch.ops.mok.fused_moe_backward(go, None, *args, w, ids, **kw)
    unrounded = torch.ops.mok.fused_moe_backward(go, None, *args, w, ids, **plain)
    for a, b in zip(rounded, unrounded, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_round_weights_needs_fp32_weights():
    args, kw, _ = _args(3, torch.bfloat16)
    with pytest.raises(ValueError, match="round_weights=True rounds fp32 weights: it needs weights_fp32=True"):
        fused_moe(*args, **{**kw, "weights_fp32": False})
