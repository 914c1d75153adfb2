"""`mok::fused_moe` with `round_weights` (routing weights rounded through the input dtype, widened to fp32 again:
Ergo's) and `round_weights_to` (the same through a given 16-bit dtype: a Qwen router's bf16 weights under autocast,
on fp32 experts).

The weights are the unrounded op's, rounded through that dtype; the weighted sum is in fp32 over them; the
gradients are the unrounded op's formula (the rounding reads as the identity). On the C++ kernel, the reference
and the export decomposition; without fp32 weights, with a dtype other than 16 bits, or with both arguments, it is
an error that names them.
"""

import pytest
import torch

from mok_compile.export.decompose import fused_moe_decomposed
from mok_compile.ops import reference

from .moe_cases import CASES_BY_NAME, make_args

fused_moe = torch.ops.mok.fused_moe.default
CASE = CASES_BY_NAME["sigmoid_deepseek_v3"]


def _args(T, dtype, seed=0, round_to=None):
    """The case's arguments, and its keywords with and without the rounding: round_weights_to=`round_to` if given,
    else round_weights (through `dtype`)."""
    args, kw = make_args(CASE, T=T, dtype=dtype, seed=seed)
    rounded = {"round_weights_to": round_to} if round_to is not None else {"round_weights": True}
    return args, {**kw, **rounded}, kw


# (the experts' dtype, round_weights_to): None rounds through the input dtype (round_weights)
ROUNDINGS = [(torch.bfloat16, None), (torch.float16, None), (torch.float32, torch.bfloat16),
             (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("dtype,round_to", ROUNDINGS, ids=lambda d: str(d)[6:])
def test_rounded_weights_are_the_weights_rounded(dtype, round_to):
    args, kw, plain = _args(31, dtype, seed=2, round_to=round_to)
    out, w, ids = fused_moe(*args, **kw)
    _, unrounded, same_ids = fused_moe(*args, **plain)
    assert torch.equal(ids, same_ids) and w.dtype == torch.float32
    assert torch.equal(w, unrounded.to(round_to or dtype).float()) and not torch.equal(w, unrounded)
    ref = reference.fused_moe_reference(*args, **kw)
    for a, b in zip((out, w, ids), ref, strict=True):
        assert torch.equal(a, b)
    decomposed = fused_moe_decomposed(*args, **kw)
    for a, b in zip((w, ids), decomposed[1:], strict=True):
        assert torch.equal(a, b)
    # the decomposition's expert GEMMs sum in another order than the kernel's: fp32 outputs agree to its rounding
    exact = dict(atol=0, rtol=0) if dtype != torch.float32 else dict(atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(decomposed[0], out, **exact)


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
    for rounded in (kw, {**kw, "round_weights": False, "round_weights_to": torch.bfloat16}):
        with pytest.raises(ValueError, match="round_weights and round_weights_to round fp32 weights: they need "
                                             "weights_fp32=True"):
            fused_moe(*args, **{**rounded, "weights_fp32": False})


def test_round_weights_to_takes_a_16_bit_dtype_and_not_round_weights_too():
    args, kw, plain = _args(3, torch.float32, round_to=torch.bfloat16)
    with pytest.raises(ValueError, match="round_weights_to must be torch.bfloat16 or torch.float16"):
        fused_moe(*args, **{**kw, "round_weights_to": torch.float32})
    with pytest.raises(ValueError, match="round_weights .through the input dtype. and round_weights_to cannot be "
                                         "combined"):
        fused_moe(*args, **{**kw, "round_weights": True})
