"""`mok::fused_moe` with identity experts (`identity_experts`, LongCat-Flash's zero-computation experts) and zero
experts (`zero_experts`, Zaya's skip expert), CPU kernels.

The router ranks E + Z choices; a pair sent to one of the last Z runs no expert and adds the token itself, weighted
(identity experts) or nothing (zero experts).
Checked in fp64 against the dense oracle of moe_cases.py (forward, routing weights, every gradient), with gradcheck,
the reference's hand-written backward against autograd through its forward, in bf16 against the reference (LongCat's
rounding: the experts' sum and the identity term each rounded, then added), where every pair is an identity pair,
through torch.compile with dynamic tokens, at zero tokens and in the export decomposition; a router of the wrong
width fails with an error that says what it should be.
"""

import dataclasses

import pytest
import torch

from mok_compile.export.decompose import EXPERTS_FORMS, fused_moe_decomposed
from mok_compile.ops import reference

from .moe_cases import (CASES_BY_NAME, DIFFERENTIABLE, dense_oracle, gradcheck_op, make_args, routing_probe,
                        weights_by_expert)

fused_moe = torch.ops.mok.fused_moe.default


def _with_identity(name, Z=3, kind="identity", **routing):
    case = CASES_BY_NAME[name]
    return dataclasses.replace(case, name=f"{name}_{kind}{Z}",
                               routing=dataclasses.replace(case.routing, **{f"{kind}_experts": Z}, **routing))


# LongCat-Flash's router (fp32 softmax, a selection bias, scaled), and the op's other routings and options with
# identity experts: weights in the input dtype, logits given, groups over all E + Z choices, expert biases.
IDENTITY_CASES = [
    _with_identity("softmax_topk_router_fp32", routed_scale=2.0, renormalize=False),
    _with_identity("softmax_topk_selection_bias_clamp_min"),
    _with_identity("topk_softmax"),
    _with_identity("softmax_topk_logits"),
    _with_identity("sigmoid_4_groups_keep_2", Z=4),
    _with_identity("topk_sigmoid_renorm_scale_wdtype", Z=2),
    dataclasses.replace(_with_identity("softmax_topk"), name="softmax_topk_identity3_expert_bias", expert_bias=True),
]
# Zaya's router (a softmax over E + 1 choices, a selection bias on the probabilities, no renormalisation) and others
# with zero experts, expert biases included (a zero pair adds no bias either).
ZERO_CASES = [
    _with_identity("softmax_topk_logits", Z=2, kind="zero"),
    _with_identity("softmax_topk_selection_bias_clamp_min", Z=1, kind="zero"),
    _with_identity("topk_softmax", Z=2, kind="zero"),
    _with_identity("sigmoid_4_groups_keep_2", Z=4, kind="zero"),
    dataclasses.replace(_with_identity("softmax_topk", kind="zero"), name="softmax_topk_zero3_expert_bias",
                        expert_bias=True),
]
BOTH_CASES = IDENTITY_CASES + ZERO_CASES


def _args(case, T=8, dtype=torch.float64, seed=0, requires_grad=False):
    return make_args(case, T=T, dtype=dtype, seed=seed, requires_grad=requires_grad)


def _both_kinds(ids, E):
    """The routing sends some pairs to experts and some past them (else a test proves less)."""
    assert (ids >= E).any() and (ids < E).any(), ids


@pytest.mark.parametrize("case", BOTH_CASES, ids=str)
def test_identity_experts_match_the_dense_oracle(case):
    """fp64: the output, the weights (by choice) and every gradient equal the oracle's."""
    args, kw = _args(case, requires_grad=True)
    out, w, ids = fused_moe(*args, **kw)
    _both_kinds(ids, case.num_experts)
    ref_out, ref_weights = dense_oracle(args, kw)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    got_weights = weights_by_expert(w, ids)
    assert got_weights.keys() == ref_weights.keys()
    R = case.num_experts + kw.get("identity_experts", 0) + kw.get("zero_experts", 0)
    probe, w_probe = torch.randn_like(out), routing_probe(out.shape[0], R)
    loss = (out * probe).sum() + sum(v * w_probe[t, e] for (t, e), v in got_weights.items())
    ref_loss = (ref_out * probe).sum() + sum(v * w_probe[t, e] for (t, e), v in ref_weights.items())
    present = [args[i] for i in DIFFERENTIABLE if args[i] is not None]
    for g, r in zip(torch.autograd.grad(loss, present), torch.autograd.grad(ref_loss, present), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("case", IDENTITY_CASES[::3] + ZERO_CASES[::2], ids=str)
def test_identity_experts_gradcheck(case):
    assert gradcheck_op(*_args(case, T=5, requires_grad=True))


@pytest.mark.parametrize("case", BOTH_CASES, ids=str)
def test_reference_backward_is_autograd_through_the_reference_forward(case):
    """The reference's hand-written backward (the oracle of the kernels) against autograd through its forward."""
    args, kw = _args(case, requires_grad=True)
    out, w, ids = reference.fused_moe_reference(*args, **kw)
    go, gw = torch.randn_like(out), torch.randn_like(w)
    present = [args[i] for i in DIFFERENTIABLE if args[i] is not None]
    auto = torch.autograd.grad((out * go).sum() + (w * gw).sum(), present)
    plain = [None if t is None else t.detach() for t in args]
    grads = reference.fused_moe_backward_reference(go, gw, *plain, w.detach(), ids, **kw)
    written = [grads[j] for j, i in enumerate(DIFFERENTIABLE) if args[i] is not None]
    for g, r in zip(written, auto, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", IDENTITY_CASES[:3] + ZERO_CASES[:2], ids=str)
def test_identity_experts_bf16_match_the_reference(case):
    """bf16 on the C++ kernel: the output within one rounding of the reference (which rounds as LongCat does), the
    routing identical, the gradients within bf16 rounding of the reference backward's."""
    args, kw = _args(case, T=16, dtype=torch.bfloat16, requires_grad=True)
    out, w, ids = fused_moe(*args, **kw)
    ref_out, ref_w, ref_ids = reference.fused_moe_reference(*args, **kw)
    _both_kinds(ids, case.num_experts)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w)
    torch.testing.assert_close(out, ref_out, rtol=2e-2, atol=2e-2)
    go = torch.randn_like(out)
    present = [args[i] for i in DIFFERENTIABLE if args[i] is not None]
    grads = torch.autograd.grad((out * go).sum(), present)
    plain = [None if t is None else t.detach() for t in args]
    ref = reference.fused_moe_backward_reference(go, None, *plain, w.detach(), ids, **kw)
    for g, r in zip(grads, [ref[j] for j, i in enumerate(DIFFERENTIABLE) if args[i] is not None], strict=True):
        torch.testing.assert_close(g.float(), r.float(), rtol=2e-2, atol=2e-2)


def _past_the_experts(case):
    """The case's arguments (fp64, with gradients) with a selection bias that sends every pair past the experts."""
    args, kw = _args(case, requires_grad=True)
    bias = args[3].detach().clone()
    bias[case.num_experts:] += 100.0
    return (*args[:3], bias, *args[4:]), kw


def test_every_pair_an_identity_pair():
    """A selection bias that sends every pair to an identity expert: out = x * (w summed), exactly as the reference
    rounds it, the expert weights get no gradient and x gets w summed times the output's gradient."""
    case = IDENTITY_CASES[1]
    E = case.num_experts
    args, kw = _past_the_experts(case)
    out, w, ids = fused_moe(*args, **kw)
    assert (ids >= E).all()
    torch.testing.assert_close(out, args[0] * w.sum(-1, keepdim=True), rtol=1e-12, atol=1e-14)
    d_x, d_gu, d_down = torch.autograd.grad(out.sum(), (args[0], args[4], args[6]))
    assert not d_gu.any() and not d_down.any()
    ref_out, ref_weights = dense_oracle(args, kw)
    torch.testing.assert_close(d_x, torch.autograd.grad(ref_out.sum(), args[0])[0], rtol=1e-10, atol=1e-12)


def test_every_pair_a_zero_pair():
    """A selection bias that sends every pair to a zero expert: the output is 0, no expert weight or x gets a
    gradient from it, and the router's gradient comes from the routing weights' own gradient alone."""
    case = ZERO_CASES[3]  # sigmoid scores in 4 groups of 2, a selection bias: the zero experts fill 2 groups
    E = case.num_experts
    args, kw = _past_the_experts(case)
    out, w, ids = fused_moe(*args, **kw)
    assert (ids >= E).all() and not out.any()
    d_x, d_router, d_gu, d_down = torch.autograd.grad(out.sum(), (args[0], args[1], args[4], args[6]),
                                                      retain_graph=True)
    assert not d_x.any() and not d_router.any() and not d_gu.any() and not d_down.any()
    gw = torch.randn_like(w)
    d_router = torch.autograd.grad((w * gw).sum(), args[1])[0]
    _, ref_weights = dense_oracle(args, kw)
    ref = sum(v * gw[t, list(ids[t]).index(e)] for (t, e), v in ref_weights.items())
    torch.testing.assert_close(d_router, torch.autograd.grad(ref, args[1])[0], rtol=1e-10, atol=1e-12)


def test_given_ids_may_name_identity_experts():
    """Given expert ids (hash routing) that name identity experts too, a row naming one twice: as the dense oracle,
    forward and gradients."""
    case = IDENTITY_CASES[2]  # topk_softmax: no selection bias (given ids allow none)
    args, kw = _args(case, requires_grad=True)
    E, T = case.num_experts, args[0].shape[0]
    ids = torch.tensor([[0, 5], [6, 6], [4, 1], [3, 2], [5, 4], [1, 1], [6, 0], [2, 3]])[:T]
    kw = {**kw, "expert_ids": ids}
    out, w, got_ids = fused_moe(*args, **kw)
    assert torch.equal(got_ids, ids) and (ids >= E).any()
    ref_out, _ = dense_oracle(args, kw)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    present = [args[i] for i in DIFFERENTIABLE if args[i] is not None]
    probe = torch.randn_like(out)
    for g, r in zip(torch.autograd.grad((out * probe).sum(), present),
                    torch.autograd.grad((ref_out * probe).sum(), present), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)


def test_without_identity_choices_nothing_changes():
    """Identity choices that are never taken (their logits far below every expert's, so their probabilities are
    exactly 0) give the bits of the plain op on the experts' logits."""
    case = IDENTITY_CASES[3]  # the router argument is the logits
    args, kw = _args(case)
    E = case.num_experts
    never = args[1].detach().clone()
    never[:, E:] = -1e4
    with_rows = fused_moe(args[0], never, *args[2:], **kw)
    plain = fused_moe(args[0], never[:, :E].contiguous(), *args[2:], **{**kw, "identity_experts": 0})
    for a, b in zip(with_rows, plain):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", [IDENTITY_CASES[0], ZERO_CASES[1]], ids=str)
def test_identity_experts_compile_with_dynamic_tokens(case):
    """The fake kernels take identity and zero experts: compiled (aot_eager, dynamic token count), forward and
    backward as eager."""
    args, kw = _args(case, T=7, requires_grad=True)

    def f(x, *weights):
        return fused_moe(x, *weights, **kw)[0]

    compiled = torch.compile(f, backend="aot_eager", dynamic=True, fullgraph=True)
    for T in (7, 3):
        x = args[0][:T].detach().requires_grad_()
        got, want = compiled(x, *args[1:]), f(x, *args[1:])
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0],
                                   rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("case", [IDENTITY_CASES[0], ZERO_CASES[1]], ids=str)
def test_identity_experts_at_zero_tokens(case):
    args, kw = _args(case, T=0, requires_grad=True)
    out, w, ids = fused_moe(*args, **kw)
    assert out.shape == (0, 12) and w.shape == ids.shape == (0, 2)
    present = [args[i] for i in DIFFERENTIABLE if args[i] is not None]
    assert all(not g.any() for g in torch.autograd.grad(out.sum(), present))


@pytest.mark.parametrize("case", [IDENTITY_CASES[0], ZERO_CASES[4]], ids=str)
@pytest.mark.parametrize("form", EXPERTS_FORMS)
def test_identity_experts_in_the_export_decomposition(form, case):
    args, kw = _args(case)
    out, w, ids = fused_moe(*args, **kw)
    d_out, d_w, d_ids = fused_moe_decomposed(*args, experts_form=form, **kw)
    _both_kinds(ids, case.num_experts)
    assert torch.equal(d_ids, ids)
    torch.testing.assert_close(d_w, w, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(d_out, out, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case, change, match", [
    (IDENTITY_CASES[2], {"identity_experts": 2},
     r"router weight must be \[6, 12\] \(4 experts \+ 2 identity experts\)"),
    (IDENTITY_CASES[2], {"identity_experts": 0}, r"router weight must be \[4, 12\], got shape \(7, 12\)"),
    (IDENTITY_CASES[2], {"identity_experts": -1}, "identity_experts must be >= 0"),
    (IDENTITY_CASES[2], {"weight_on_input": True}, "identity_experts is not supported with weight_on_input"),
    (IDENTITY_CASES[2], {"expert_scale": torch.ones(4, dtype=torch.float64)},
     "expert_scale is not supported with identity_experts"),
    (IDENTITY_CASES[2], {"top_k": 8},
     r"top_k=8 must be between 1 and the number of experts E=7 \(4 experts \+ 3 identity experts\)"),
    (ZERO_CASES[2], {"zero_experts": 1}, r"router weight must be \[5, 12\] \(4 experts \+ 1 zero experts\)"),
    (ZERO_CASES[2], {"zero_experts": -1}, "zero_experts must be >= 0"),
    (ZERO_CASES[2], {"identity_experts": 3}, "identity_experts and zero_experts cannot be combined"),
    (ZERO_CASES[2], {"weight_on_input": True}, "zero_experts is not supported with weight_on_input"),
    (ZERO_CASES[2], {"expert_scale": torch.ones(4, dtype=torch.float64)},
     "expert_scale is not supported with zero_experts"),
    (ZERO_CASES[2], {"top_k": 7},
     r"top_k=7 must be between 1 and the number of experts E=6 \(4 experts \+ 2 zero experts\)"),
], ids=str)
def test_bad_identity_and_zero_experts_are_named(case, change, match):
    args, kw = _args(case)
    with pytest.raises(ValueError, match=match):
        fused_moe(*args, **{**kw, **change})
