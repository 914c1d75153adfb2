"""Edge cases and bad input of `mok::fused_moe`, through the dispatcher.

Shapes and routings that kernels get wrong first (no token, one token, every
token on one expert, experts without tokens, top_k == E, strided inputs, fp16),
checked against the fp64 dense oracle of moe_cases.py; and bad arguments, which
must fail with an error that names the argument.
"""

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mok_compile.ops.spec import ExpertSpec, RoutingSpec

from .moe_cases import (ARG_NAMES, CASES_BY_NAME, DIFFERENTIABLE, Case, dense_oracle, make_args, routing_probe,
                        weights_by_expert)

fused_moe = torch.ops.mok.fused_moe.default

EDGE_CASES = [CASES_BY_NAME[n] for n in ("softmax_topk_renorm_scale_wdtype", "topk_softmax_logits",
                                         "sigmoid_deepseek_v3", "clamped_silu_gpt_oss", "relu2_transposed_bias",
                                         "llama4_weight_on_input", "weight_on_input_softmax_topk_bias",
                                         "sparsemixer_phimoe_bf16")]


def _present(args):
    return [i for i in DIFFERENTIABLE if args[i] is not None]


def _run(args, kw, probe_seed=2):
    """Op outputs and the gradients of a loss on out and on the routing weights."""
    out, w, ids = fused_moe(*args, **kw)
    T, H = out.shape
    E = args[4].shape[0]
    probe_out = torch.randn(T, H, generator=torch.Generator().manual_seed(probe_seed), dtype=torch.float64)
    probe_route = routing_probe(T, E)
    loss = (out.double() * probe_out).sum() + (w.double() * probe_route.gather(1, ids)).sum()
    grads = torch.autograd.grad(loss, [args[i] for i in _present(args)])
    return out, w, ids, dict(zip((ARG_NAMES[i] for i in _present(args)), grads)), (probe_out, probe_route)


def _check_against_oracle(args, kw, rtol=1e-10, atol=1e-12):
    """fp64 op vs the dense oracle: chosen experts, weights, output and every gradient."""
    out, w, ids, grads, (probe_out, probe_route) = _run(args, kw)
    ref_out, ref_w = dense_oracle(args, kw)
    got_w = weights_by_expert(w, ids)
    assert set(got_w) == set(ref_w), "chosen experts differ from the oracle"
    torch.testing.assert_close(out, ref_out, rtol=rtol, atol=atol)
    for key, val in ref_w.items():
        torch.testing.assert_close(got_w[key], val, rtol=rtol, atol=atol)
    if out.numel():
        ref_loss = (ref_out * probe_out).sum() + sum(v * probe_route[t, e] for (t, e), v in ref_w.items())
        ref_grads = torch.autograd.grad(ref_loss, [args[i] for i in _present(args)])
        for (name, g), r in zip(grads.items(), ref_grads):
            torch.testing.assert_close(g, r, rtol=rtol * 10, atol=atol * 10, msg=lambda m: f"grad {name}: {m}")
    return out, w, ids, grads


# ----------------------------------------------------------------------------- token counts


@pytest.mark.parametrize("case", EDGE_CASES, ids=str)
def test_zero_tokens(case):
    args, kw = make_args(case, T=0, requires_grad=True)
    out, w, ids, grads, _ = _run(args, kw)
    K = kw["top_k"]
    assert out.shape == (0, 12) and out.dtype == args[0].dtype
    assert w.shape == (0, K) and ids.shape == (0, K) and ids.dtype == torch.int64
    for name, g in grads.items():
        i = ARG_NAMES.index(name)
        assert g.shape == args[i].shape and g.dtype == args[i].dtype
        assert not g.any(), f"grad {name} must be zero without tokens"


@pytest.mark.parametrize("case", EDGE_CASES, ids=str)
def test_one_token(case):
    args, kw = make_args(case, T=1, dtype=torch.float64, requires_grad=True)
    _check_against_oracle(args, kw)


# ----------------------------------------------------------------------------- skewed routing


def _one_expert_preferred(case, favourite, T=16, top_k=1):
    """Inputs where every token prefers expert `favourite` by a wide margin (fp64, no ties)."""
    routing = dataclasses.replace(case.routing, top_k=top_k)
    args, kw = make_args(dataclasses.replace(case, routing=routing), T=T, dtype=torch.float64)
    args = [None if a is None else a.clone() for a in args]
    x, router = args[0], args[1]
    x += 3.0  # a shared direction in every token...
    if kw["router_is_logits"]:
        router[:, favourite] += 30.0
    else:  # ...that only the favourite's router row is aligned with; the others are orthogonal to it and
        # small, so that under group-limited routing the favourite's group also wins (its score is top-2 summed)
        router -= router.mean(dim=1, keepdim=True)
        router *= 0.2
        router[favourite] = 1.0
    if args[3] is not None:  # sigmoid scores saturate at 1: the selection bias must carry the favourite's group
        args[3][favourite] += 1.0
    for i in _present(args):
        args[i].requires_grad_()
    return args, kw


@pytest.mark.parametrize("case", EDGE_CASES, ids=str)
def test_all_tokens_to_one_expert(case):
    fav = 2
    args, kw = _one_expert_preferred(case, fav, top_k=1)
    out, w, ids, grads = _check_against_oracle(args, kw)
    assert (ids == fav).all()
    others = [e for e in range(args[4].shape[0]) if e != fav]
    for name in ("gate_up_proj", "gate_up_bias", "down_proj", "down_bias"):
        if name in grads:
            assert not grads[name][others].any(), f"{name}: experts without tokens got a gradient"
            assert grads[name][fav].abs().sum() > 0

    args, kw = _one_expert_preferred(case, fav, top_k=2)
    _, _, ids, _ = _check_against_oracle(args, kw)
    assert (ids == fav).any(dim=-1).all()


@pytest.mark.parametrize("case", EDGE_CASES, ids=str)
def test_experts_without_tokens_get_zero_grad(case):
    routing = dataclasses.replace(case.routing, top_k=1, n_group=1, topk_group=1)
    case = dataclasses.replace(case, routing=routing, num_experts=8)
    args, kw = make_args(case, T=3, dtype=torch.float64, requires_grad=True)
    _, _, ids, grads = _check_against_oracle(args, kw)
    used = set(ids.flatten().tolist())
    unused = [e for e in range(8) if e not in used]
    assert len(unused) >= 5
    for name in ("gate_up_proj", "gate_up_bias", "down_proj", "down_bias"):
        if name in grads:
            assert not grads[name][unused].any()
            assert all(grads[name][e].abs().sum() > 0 for e in used)


@pytest.mark.parametrize("case", [
    Case("softmax_renorm_all", RoutingSpec(top_k=4, renormalize=True)),
    Case("topk_softmax_all", RoutingSpec(top_k=4, routing="topk_softmax"), ExpertSpec(activation="gelu_tanh")),
    Case("sigmoid_groups_all", RoutingSpec(top_k=4, routing="sigmoid_grouped_topk", n_group=2, topk_group=2,
                                           renormalize=True, routed_scale=2.0), selection_bias=True),
    Case("topk_sigmoid_weight_on_input_all", RoutingSpec(top_k=4, routing="topk_sigmoid", renormalize=True,
                                                         weight_on_input=True), ExpertSpec(transposed=True)),
], ids=str)
def test_top_k_equals_num_experts(case):
    args, kw = make_args(case, dtype=torch.float64, requires_grad=True)
    _, w, ids, _ = _check_against_oracle(args, kw)
    assert torch.equal(ids.sort(dim=-1)[0], torch.arange(4).expand_as(ids))
    if kw["renormalize"] or kw["routing"] == "topk_softmax":
        torch.testing.assert_close(w.sum(-1), torch.full_like(w[:, 0], kw["routed_scale"]))


# ----------------------------------------------------------------------------- memory layout, fp16


def _strided_copy(t: torch.Tensor, how: str) -> torch.Tensor:
    """Same values, non-contiguous storage: a transposed view or a slice with step 2."""
    if t.dim() == 1 or how == "slice":
        big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        view = big[..., ::2]
    else:
        view = torch.zeros(*t.shape[:-2], t.shape[-1], t.shape[-2], dtype=t.dtype).transpose(-1, -2)
    view.copy_(t.detach())
    assert not view.is_contiguous()
    return view


@pytest.mark.parametrize("how", ["transpose", "slice"])
@pytest.mark.parametrize("case", [CASES_BY_NAME[n] for n in ("clamped_silu_gpt_oss", "sigmoid_logits_groups",
                                                              "sigmoid_deepseek_v3", "relu2",
                                                              "weight_on_input_renorm_scale_logits")], ids=str)
def test_non_contiguous_inputs(case, how):
    args, kw = make_args(case, T=7)
    base = [None if a is None else a.clone().requires_grad_(i in DIFFERENTIABLE) for i, a in enumerate(args)]
    strided = [None if a is None else _strided_copy(a, how).requires_grad_(i in DIFFERENTIABLE)
               for i, a in enumerate(args)]
    want_out, want_w, want_ids, want_grads, _ = _run(base, kw)
    out, w, ids, grads, _ = _run(strided, kw)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(w, want_w)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("case", [CASES_BY_NAME[n] for n in ("softmax_topk_renorm_scale_wdtype", "topk_softmax",
                                                              "sigmoid_4_groups_keep_2", "clamped_silu_gpt_oss",
                                                              "llama4_weight_on_input")],
                         ids=str)
def test_fp16(case):
    """fp16 runs, keeps HF's dtypes, and is as close to the fp64 oracle as fp16 allows."""
    args, kw = make_args(case, T=8, dtype=torch.float16, requires_grad=True)
    out, w, ids, grads, (probe_out, probe_route) = _run(args, kw)
    assert out.dtype == torch.float16 and w.dtype == (torch.float32 if kw["weights_fp32"] else torch.float16)
    args64 = [None if a is None else a.detach().double().requires_grad_(a.requires_grad) for a in args]
    ref_out, ref_w = dense_oracle(args64, kw)
    assert set(weights_by_expert(w, ids)) == set(ref_w), "fp16 routing differs from the fp64 oracle"
    scale = ref_out.abs().max().item()
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-2, atol=1e-2 * scale)
    ref_loss = (ref_out * probe_out).sum() + sum(v * probe_route[t, e] for (t, e), v in ref_w.items())
    present = _present(args64)
    for i, r in zip(present, torch.autograd.grad(ref_loss, [args64[i] for i in present])):
        g = grads[ARG_NAMES[i]]
        assert g.dtype == args[i].dtype
        rel = ((g.double() - r).norm() / r.norm()).item()
        assert rel < 1e-2, f"grad {ARG_NAMES[i]}: relative error {rel:.2e} in fp16"


# ----------------------------------------------------------------------------- bad input


def _bad(case_name="softmax_topk", **kw_changes):
    args, kw = make_args(CASES_BY_NAME[case_name], T=5, H=12, I=4)
    return list(args), {**kw, **kw_changes}


def _raises(args, kw, match, exc=ValueError):
    with pytest.raises(exc, match=match) as info:
        fused_moe(*args, **kw)
    assert "mok.fused_moe" in str(info.value)
    return info


def _set(args, name, value):
    args[ARG_NAMES.index(name)] = value
    return args


BAD_TENSORS = [
    # (case, argument, how to break it, expected message)
    ("softmax_topk", "hidden_states", lambda t: t.unsqueeze(0), r"hidden_states must be 2-D"),
    ("softmax_topk", "hidden_states", lambda t: t.to(torch.int32), r"hidden_states has unsupported dtype"),
    ("softmax_topk", "gate_up_proj", lambda t: t.bfloat16(), r"gate_up_proj dtype torch.bfloat16 differs"),
    ("softmax_topk", "down_proj", lambda t: t.double(), r"down_proj dtype torch.float64 differs"),
    ("softmax_topk", "gate_up_proj", lambda t: t[:, :6], r"gate_up_proj has shape \(4, 6, 12\)"),
    ("softmax_topk", "gate_up_proj", lambda t: t[0], r"gate_up_proj must be 3-D"),
    ("softmax_topk", "down_proj", lambda t: t[:3], r"down_proj has 3 experts but gate_up_proj has 4"),
    ("softmax_topk", "down_proj", lambda t: t[:, :10], r"down_proj has shape \(4, 10, 4\)"),
    ("softmax_topk", "router", lambda t: t[:, :10], r"router weight must be \[4, 12\]"),
    ("softmax_topk", "router", lambda t: t.t(), r"router weight must be \[4, 12\]"),
    ("softmax_topk", "router", lambda t: t.bfloat16(), r"router dtype torch.bfloat16 differs.*router_fp32=True"),
    ("softmax_topk", "router", lambda t: t.to(torch.int64), r"router dtype torch.int64 differs"),
    ("softmax_topk_logits", "router", lambda t: t[:, :3], r"router \(logits\) must be \[T, 4\]"),
    ("softmax_topk_logits", "router", lambda t: t.to(torch.int32), r"router has unsupported dtype"),
    ("softmax_topk_logits", "router_bias", lambda _: torch.zeros(4), r"router_bias must be None"),
    ("topk_softmax_router_bias_bf16", "router_bias", lambda t: t[:3], r"router_bias must have shape \[4\]"),
    ("topk_softmax_router_bias_bf16", "router_bias", lambda t: t.float(), r"router_bias dtype torch.float32"),
    ("clamped_silu_gpt_oss", "gate_up_bias", lambda t: t[:, :4], r"gate_up_bias must have shape \[4, 8\]"),
    ("clamped_silu_gpt_oss", "gate_up_bias", lambda t: t.double(), r"gate_up_bias dtype torch.float64 differs"),
    ("clamped_silu_gpt_oss", "down_bias", lambda t: t[:2], r"down_bias must have shape \[4, 12\]"),
    ("clamped_silu_gpt_oss", "down_bias", lambda t: t.half(), r"down_bias dtype torch.float16 differs"),
    ("sigmoid_deepseek_v3", "selection_bias", lambda t: t[:3], r"selection_bias must have shape \[4\]"),
    ("sigmoid_deepseek_v3", "selection_bias", lambda t: t.to(torch.int64), r"selection_bias has unsupported dtype"),
    ("softmax_topk_selection_bias_clamp_min", "selection_bias", lambda t: t[None],
     r"selection_bias must have shape \[4\], got \(1, 4\)"),
]


@pytest.mark.parametrize("case_name, arg, breaks, match", BAD_TENSORS,
                         ids=[f"{a}-{m.split(' ')[-1][:20]}" for _, a, _, m in BAD_TENSORS])
def test_bad_tensor_names_the_argument(case_name, arg, breaks, match):
    args, kw = _bad(case_name)
    current = args[ARG_NAMES.index(arg)]
    _raises(_set(args, arg, breaks(current)), kw, match)


def test_router_logits_with_wrong_token_count():
    args, kw = _bad("softmax_topk_logits")
    _raises(_set(args, "router", args[1][:3]), kw, r"router logits have 3 rows but hidden_states has 5", RuntimeError)


@pytest.mark.parametrize("transposed", [True, False])
def test_wrong_layout_flag_is_caught(transposed):
    """Weights stored in one layout but passed with the other `transposed` flag (H=12, I=4: no shape coincidence)."""
    case = CASES_BY_NAME["silu_transposed" if transposed else "softmax_topk"]
    args, kw = make_args(case, T=5)
    _raises(list(args), {**kw, "transposed": not transposed}, rf"gate_up_proj has shape .*transposed={not transposed}")


@pytest.mark.parametrize("changes, match", [
    (dict(top_k=5), r"top_k=5 must be between 1 and the number of experts E=4"),
    (dict(top_k=0), r"top_k=0 must be between 1"),
    (dict(routing="softmax"), r"routing='softmax' is not supported"),
    (dict(activation="swish"), r"activation='swish' is not supported for gated experts"),
    (dict(activation="relu2"), r"activation='relu2' is not supported for gated experts"),
    (dict(renormalize=True, renorm_min=-1.0), r"renorm_min must be a finite number >= 0, got -1.0"),
    (dict(renormalize=True, renorm_min=float("inf")), r"renorm_min must be a finite number >= 0, got inf"),
    (dict(routing="topk_softmax", n_group=2), r"n_group=2 \(group-limited routing\) is only supported with "
                                              r"routing in \('softmax_topk', 'sigmoid_grouped_topk', "
                                              r"'sqrtsoftplus_topk'\)"),
    (dict(routing="topk_sigmoid", n_group=2, topk_group=1),
     r"n_group=2 \(group-limited routing\) is only supported with routing in"),
    (dict(n_group=2, group_top=3), r"group_top must be 1 \(group max\) or 2 \(sum of the top 2\), got 3"),
    (dict(activation="softcapped_swiglu", limit=0.0), r"softcapped_swiglu divides by its caps: alpha \(the gate's\) "
                                                      r"and limit \(up's\) must be > 0, got 1.702 and 0.0"),
], ids=lambda v: str(v) if isinstance(v, dict) else "")
def test_bad_scalar_names_the_argument(changes, match):
    args, kw = _bad()
    _raises(args, {**kw, **changes}, match)


@pytest.mark.parametrize("changes, match", [
    (dict(n_group=3), r"n_group=3 must divide E=4"),
    (dict(n_group=4), r"n_group=4 must divide E=4 into groups of at least 2"),
    (dict(top_k=3, topk_group=1), r"topk_group=1 \(n_group=2\) leaves fewer than top_k=3 experts"),
], ids=str)
def test_bad_groups_name_the_argument(changes, match):
    args, kw = _bad("sigmoid_deepseek_v3")
    _raises(args, {**kw, **changes}, match)


def test_interleaved_needs_gated_experts():
    args, kw = make_args(CASES_BY_NAME["relu2"], T=5)
    _raises(list(args), {**kw, "interleaved": True}, r"interleaved=True needs gated experts")


def test_device_mismatch_names_the_argument():
    args, kw = _bad()
    _raises(_set(args, "down_proj", args[6].to("meta")), kw, r"down_proj is on meta but hidden_states is on cpu")


def test_fake_kernel_rejects_bad_input_too():
    """Under torch.compile the fake kernel runs the same checks, so errors surface at trace time."""
    args, kw = make_args(CASES_BY_NAME["silu_transposed"], T=5)
    with FakeTensorMode() as mode:
        fake = [None if a is None else mode.from_tensor(a) for a in args]
        with pytest.raises(ValueError, match=r"gate_up_proj has shape .*transposed=False"):
            fused_moe(*fake, **{**kw, "transposed": False})
