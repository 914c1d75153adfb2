"""`mok::fused_moe` with a per-expert weight scale (`expert_scale`, Gemma 4's `per_expert_scale`) on the CPU kernels.

Each routing weight, after the renormalisation and `routed_scale`, is multiplied by its expert's value; the scale
gets a gradient. Checked in fp64 against the dense oracle of moe_cases.py (forward, routing weights, every gradient,
the scale's included), with gradcheck, the reference's hand-written backward against autograd through its forward,
in bf16 against the reference, through torch.compile with dynamic tokens, at zero tokens and in the export
decomposition; a bad scale fails with an error that names it.
"""

import dataclasses

import pytest
import torch

from mok_compile.export.decompose import EXPERTS_FORMS, fused_moe_decomposed
from mok_compile.ops import reference

from .moe_cases import (CASES_BY_NAME, DIFFERENTIABLE, check_learned_against_the_dense_oracle,
                         check_learned_compiles_with_dynamic_tokens, check_learned_reference_backward,
                         gradcheck_learned, make_args)

fused_moe = torch.ops.mok.fused_moe.default

SCALE_CASES = [CASES_BY_NAME[n] for n in ("softmax_topk_renorm_scale_wdtype", "topk_softmax", "sigmoid_deepseek_v3",
                                          "topk_sigmoid_renorm_scale_wdtype", "sqrtsoftplus_deepseek_v4_bf16",
                                          "softmax_topk_groups_bias_bf16", "topk_softmax_logits",
                                          "clamped_silu_gpt_oss")]


def _scaled(case, T=6, dtype=torch.float64, seed=0, requires_grad=False):
    """The case's arguments and keywords with an expert scale in (0.5, 1.5) (a parameter, where `requires_grad`)."""
    args, kw = make_args(case, T=T, dtype=dtype, seed=seed, requires_grad=requires_grad)
    gen = torch.Generator().manual_seed(seed + 7)
    scale = (torch.rand(case.num_experts, generator=gen, dtype=torch.float64) + 0.5).to(dtype or case.dtype)
    return args, {**kw, "expert_scale": scale.requires_grad_(requires_grad)}


def _differentiable(args, kw):
    return [args[i] for i in DIFFERENTIABLE if args[i] is not None] + [kw["expert_scale"]]


@pytest.mark.parametrize("case", SCALE_CASES, ids=str)
def test_expert_scale_matches_the_dense_oracle(case):
    """fp64: the output, the weights (by expert) and every gradient, the scale's included, equal the oracle's."""
    args, kw = _scaled(case, requires_grad=True)
    check_learned_against_the_dense_oracle(args, kw, "expert_scale")


@pytest.mark.parametrize("case", SCALE_CASES[::3], ids=str)
def test_expert_scale_gradcheck(case):
    args, kw = _scaled(case, T=4, requires_grad=True)
    assert gradcheck_learned(args, kw, "expert_scale")


@pytest.mark.parametrize("case", SCALE_CASES, ids=str)
def test_reference_backward_is_autograd_through_the_reference_forward(case):
    """The reference's hand-written backward (the oracle of the kernels) against autograd through its forward."""
    args, kw = _scaled(case, requires_grad=True)
    check_learned_reference_backward(args, kw, "expert_scale")


def test_expert_scale_bf16_matches_the_reference():
    """bf16 on the C++ kernel, with a bf16 scale (Gemma 4's parameter): within one rounding of the reference; the
    scale's gradient is bf16."""
    args, kw = _scaled(CASES_BY_NAME["softmax_topk_renorm_scale_wdtype"], T=9, dtype=torch.bfloat16,
                       requires_grad=True)
    out, w, ids = fused_moe(*args, **kw)
    ref_out, ref_w, _ = reference.fused_moe_reference(*args, **kw)
    torch.testing.assert_close(out, ref_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w, ref_w)
    d_scale = torch.autograd.grad(out.float().sum(), kw["expert_scale"])[0]
    plain = [None if t is None else t.detach() for t in args]
    ref = reference.fused_moe_backward_reference(torch.ones_like(out), None, *plain, w.detach(), ids,
                                                 **{**kw, "expert_scale": kw["expert_scale"].detach()})[7]
    assert d_scale.dtype == torch.bfloat16
    torch.testing.assert_close(d_scale, ref, rtol=1e-2, atol=1e-2)


def test_without_the_scale_nothing_changes():
    """A scale of ones gives the unscaled op's bits, and no gradient slot for a scale that was not given."""
    args, kw = _scaled(SCALE_CASES[0])
    ones = dict(kw, expert_scale=torch.ones_like(kw["expert_scale"]))
    plain = {k: v for k, v in kw.items() if k != "expert_scale"}
    for a, b in zip(fused_moe(*args, **ones), fused_moe(*args, **plain)):
        assert torch.equal(a, b)
    out, w, ids = fused_moe(*args, **plain)
    grads = torch.ops.mok.fused_moe_backward(torch.ones_like(out), None, *args, w, ids, **plain)
    assert len(grads) == 9 and grads[7] is None


def test_expert_scale_compiles_with_dynamic_tokens():
    """The fake kernels take the scale: compiled (aot_eager, dynamic token count), forward and backward as eager."""
    args, kw = _scaled(SCALE_CASES[0], T=7, requires_grad=True)
    check_learned_compiles_with_dynamic_tokens(args, kw, "expert_scale")


def test_expert_scale_at_zero_tokens():
    args, kw = _scaled(SCALE_CASES[0], T=0, requires_grad=True)
    out, w, ids = fused_moe(*args, **kw)
    assert out.shape == (0, 12) and w.shape == ids.shape == (0, 2)
    grads = torch.autograd.grad(out.sum(), _differentiable(args, kw))
    assert all(not g.any() for g in grads) and grads[-1].shape == kw["expert_scale"].shape


@pytest.mark.parametrize("form", EXPERTS_FORMS)
def test_expert_scale_in_the_export_decomposition(form):
    args, kw = _scaled(CASES_BY_NAME["sigmoid_deepseek_v3"])
    out, w, ids = fused_moe(*args, **kw)
    d_out, d_w, d_ids = fused_moe_decomposed(*args, experts_form=form, **kw)
    assert torch.equal(d_ids, ids)
    torch.testing.assert_close(d_w, w, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(d_out, out, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("scale, kw, match", [
    (torch.ones(5, dtype=torch.float64), {}, r"expert_scale must be \[E=4\], got shape \(5,\)"),
    (torch.ones(1, 4, dtype=torch.float64), {}, r"expert_scale must be \[E=4\], got shape \(1, 4\)"),
    (torch.ones(4, dtype=torch.int64), {}, "expert_scale has unsupported dtype torch.int64"),
    (torch.ones(4, dtype=torch.float64), {"weight_on_input": True}, "not supported with weight_on_input"),
])
def test_bad_expert_scale_is_named(scale, kw, match):
    case = dataclasses.replace(SCALE_CASES[0])
    args, base = _scaled(case)
    with pytest.raises(ValueError, match=match):
        fused_moe(*args, **{**base, **kw, "expert_scale": scale})
