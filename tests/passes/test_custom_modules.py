"""fuse_moe on from-scratch MoE modules (loops over nn.ModuleList, stacked weights + bmm) and near misses."""

import operator

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from mok_compile.diagnostics import describe_block
from mok_compile.passes import MoeFusionError, fuse_moe
from mok_compile.passes.op_names import op_name, tensor_meta

from . import models
from .helpers import capture, count_fused, ops_in, run

TOL = dict(atol=1e-5, rtol=1e-5)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture
def capture_dynamic_output_shapes():
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        yield


def _fuse(module, *inputs, **kwargs):
    torch.manual_seed(0)
    (graph,), eager = capture(module.eval(), *inputs)
    gm, example = graph
    report = fuse_moe(gm, example, **kwargs)
    return gm, example, report, eager


def _first(result):
    return result[0] if isinstance(result, tuple) else result


@pytest.mark.usefixtures("capture_dynamic_output_shapes")
@pytest.mark.parametrize("renormalize", [True, False])
def test_index_add_module_loop(renormalize):
    torch.manual_seed(0)
    module = models.IndexAddLoopMoE(renormalize=renormalize)
    gm, example, report, eager = _fuse(module, torch.randn(2, 5, 32))
    assert [(b.fused, b.form) for b in report.blocks] == [(True, "module_loop")], str(report)
    assert report.blocks[0].routing.renormalize is renormalize
    assert report.blocks[0].routing.router_is_logits  # the module returns its router logits
    # Nothing data-dependent is left: no one_hot, no where/nonzero, no index_add_.
    assert not any(op in ("where", "index_add_", "one_hot") or "one_hot" in op for op in ops_in(gm)), gm.code
    out, logits = run(gm, example)
    torch.testing.assert_close(out, eager[0], **TOL)
    torch.testing.assert_close(logits, eager[1], **TOL)


@pytest.mark.usefixtures("capture_dynamic_output_shapes")
def test_sparsemixer_routing_with_a_module_loop():
    """A from-scratch sparsemixer (PhiMoE's inference routing) in front of an expert loop: fused as the op's
    routing="sparsemixer" with its threshold."""
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(models.SparsemixerLoopMoE(), torch.randn(2, 5, 32))
    assert [(b.fused, b.form) for b in report.blocks] == [(True, "module_loop")], str(report)
    assert (report.blocks[0].routing.routing, report.blocks[0].routing.jitter_eps) == ("sparsemixer", 0.2)
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL)


def test_dense_mask_loop():
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(models.DenseMaskMoE(), torch.randn(2, 5, 32))
    assert [(b.fused, b.form) for b in report.blocks] == [(True, "module_loop")], str(report)
    spec = report.blocks[0].routing
    assert spec.routing == "topk_softmax" and not spec.router_is_logits
    assert count_fused(gm) == 1 and sum(op == "linear" or op.endswith("linear") for op in ops_in(gm)) == 0
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL)


def _comparisons_as_methods(gm, method):
    """The graph with each `ids == e` (torch 2.13's `operator.eq`, torch 2.11's method `__eq__`) written as the tensor
    method `method`."""
    import operator

    for n in list(gm.graph.nodes):
        if (n.op == "call_function" and n.target is operator.eq) or (n.op == "call_method" and n.target == "__eq__"):
            with gm.graph.inserting_after(n):
                m = gm.graph.call_method(method, n.args)
            m.meta = dict(n.meta)
            n.replace_all_uses_with(m)
            gm.graph.erase_node(n)
    gm.recompile()
    return gm


@pytest.mark.parametrize("method, fused", [("__eq__", True), ("__ne__", False)])
def test_dense_mask_loop_with_comparison_methods(method, fused):
    """The dense mask loop whose `ids == e` is the method `__eq__` (torch 2.11's Dynamo) fuses as with torch 2.13's
    `operator.eq`; near miss: `ids.__ne__(e)` picks every other slot's weight: no MoE block, the graph untouched."""
    (graph,), eager = capture(models.DenseMaskMoE().eval(), torch.randn(10, 32))
    gm, example = graph
    gm = _comparisons_as_methods(gm, method)
    assert any(n.op == "call_method" and n.target == method for n in gm.graph.nodes)
    before = run(gm, example)[0]
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == ([True] if fused else []) and count_fused(gm) == int(fused), str(report)
    torch.testing.assert_close(run(gm, example)[0], eager if fused else before, **TOL)


def test_dense_mask_loop_with_relu_experts_and_biases():
    torch.manual_seed(0)
    module = models.DenseMaskMoE(expert_cls=models.ReluExpert)
    gm, example, report, eager = _fuse(module, torch.randn(10, 32))
    assert report.blocks[0].fused, str(report)
    assert report.blocks[0].experts.activation == "relu" and not report.blocks[0].experts.gated
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL)


def test_stacked_gather_bmm_sigmoid_routing():
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(models.StackedGatherMoE(), torch.randn(10, 32))
    assert [(b.fused, b.form) for b in report.blocks] == [(True, "batched_mm")], str(report)
    spec = report.blocks[0].routing
    assert (spec.routing, spec.renormalize, spec.routed_scale) == ("sigmoid_grouped_topk", True, 1.5)
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL)


@pytest.mark.parametrize("module,want", [
    (models.BiasedSoftmaxMoE, dict(routing="softmax_topk", renormalize=True, renorm_min=0.35, routed_scale=1.0)),
    (models.BiasedSigmoidTopKMoE, dict(routing="topk_sigmoid", renormalize=True, renorm_min=0.0, routed_scale=1.0)),
    (models.SigmoidTopKMoE, dict(routing="topk_sigmoid", renormalize=False, renorm_min=0.0, routed_scale=1.5)),
], ids=["ernie_style", "kolibri_style", "sigmoid_topk"])
def test_selection_bias_and_sigmoid_topk_routing(module, want):
    """A selection bias on softmax probabilities or on logits ([1, E] and squeezed, or [E]), the sigmoid of the top-k
    logits, and w / clamp(sum, min): each fused, with the routing read off the graph."""
    torch.manual_seed(0)
    module = module()
    gm, example, report, eager = _fuse(module, torch.randn(24, 32))
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    spec = report.blocks[0].routing
    assert {k: getattr(spec, k) for k in want} == want
    assert "topk" not in " ".join(ops_in(gm))
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL)
    if isinstance(module, models.BiasedSoftmaxMoE):  # both sides of the clamp, and a choice the bias changed
        x = example[[i for i, e in enumerate(example) if e.shape == (24, 32)][0]]
        probs = torch.softmax(F.linear(x, module.router), dim=-1)
        chosen = probs.gather(1, torch.topk(probs + module.choice_bias, 2).indices).sum(-1)
        assert 0 < (chosen < module.norm_min).sum() < 24
        assert not torch.equal(torch.topk(probs, 2).indices, torch.topk(probs + module.choice_bias, 2).indices)


def test_scores_viewed_to_their_own_shape_fused():
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(models.ViewedScoresMoE(), torch.randn(24, 32))
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    op = next(n for n in gm.graph.nodes if n.target is torch.ops.mok.fused_moe.default)
    assert op.args[3] is not None  # the selection bias
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_router_input_cast_then_viewed_fused(dtype):
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(models.CastThenViewRouterMoE().to(dtype), torch.randn(24, 32, dtype=dtype))
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    assert report.blocks[0].routing.router_fp32 is (dtype != torch.float32)
    tol = TOL if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(run(gm, example)[0], eager, **tol)


@pytest.mark.parametrize("router_input", ["normed", "detached"])
def test_router_on_another_input_fused_with_its_logits(router_input):
    """The router reads another tensor than the experts: the op takes the graph's logits (router_is_logits) and
    the experts' input; outputs and every gradient (the router's through the graph, x's through both paths or only
    the experts') equal eager's."""
    torch.manual_seed(0)
    module = models.SeparateRouterInputMoE(router_input=router_input)
    gm, example, report, eager = _fuse(module, torch.randn(24, 32))
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    assert report.blocks[0].routing.router_is_logits
    op = next(n for n in gm.graph.nodes if n.target is torch.ops.mok.fused_moe.default)
    assert op.args[1].op != "placeholder" and tuple(tensor_meta(op.args[1]).shape) == (24, 8)  # the logits
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL)
    _check_gradients(gm, example, module)


def _check_gradients(gm, example, module) -> list:
    """The gradients of x (the graph's first input) and of every parameter through the fused graph equal eager's
    (fp32); returns eager's ([d x, d params...], None where a parameter gets none)."""
    x = torch.randn(*example[0].shape, requires_grad=True)
    params = [e for e in example if isinstance(e, torch.nn.Parameter)]
    grads = []
    for call in (lambda: _first(gm(x, *example[1:])), lambda: module(x)):
        grads.append(torch.autograd.grad(call().pow(2).sum(), [x, *params], allow_unused=True))
    for fused, eager_grad in zip(*grads):
        torch.testing.assert_close(fused, eager_grad, atol=1e-5, rtol=1e-5)
    return grads[1]


def test_separate_router_input_with_a_tall_parameter_after_fused():
    """The experts' activation is found among the block's inputs of T rows, and a later parameter of T rows (the
    ids reach every later layer) is not one: fused, outputs as eager's."""
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(models.RouterInputThenTallLinearMoE(tokens=24), torch.randn(24, 32))
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    assert report.blocks[0].routing.router_is_logits
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL)


def test_experts_on_two_activations_untouched():
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(models.TwoActivationExpertsMoE(), torch.randn(24, 32), torch.randn(24, 32))
    _assert_untouched(gm, example, report, eager, candidates=1)


@pytest.mark.parametrize("scaled_by", ["parameters", "buffer"])
def test_expert_weights_computed_from_parameters_fused(scaled_by):
    """Expert weights the forward computes from parameters (scaled, by a parameter or a buffer, and with a LoRA
    delta) stay in the graph: the op takes the computed weights, and its weight gradients reach the parameters
    through them."""
    torch.manual_seed(0)
    module = models.ComputedWeightsMoE(scaled_by=scaled_by)
    gm, example, report, eager = _fuse(module, torch.randn(24, 32))
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.mok.fused_moe.default]
    gate_up, down = op.args[4], op.args[6]
    assert (op_name(gate_up), op_name(down)) == ("mul", "add"), gm.code  # computed in the graph, before the op
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL)
    grads = _check_gradients(gm, example, module)
    # x's, and every parameter's but the selection bias's (which only chooses): the scale's too, where a parameter
    assert sum(g is not None for g in grads) == 7 - (scaled_by == "buffer")


def test_scores_reshaped_across_tokens_kept_in_the_graph():
    """A choice that mixes tokens' scores (transposed to [E, T] and reshaped back) is no routing the op computes, and
    the top-k alone cannot be fused ("found reshape"); but the weights are the scores gathered at its ids, so the
    choice stays in the graph and the op takes its ids (its near miss, weighted by the scrambled choice, is in
    `test_kept_selection_and_computed_weights_near_misses`)."""
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(models.ScrambledScoresMoE(), torch.randn(24, 32))
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    assert report.blocks[0].kept_selection
    _kept_selection_op(gm)
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL)


def _check_fp32_mm_router(report, gm):
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    spec = report.blocks[0].routing
    assert (spec.routing, spec.router_fp32, spec.renormalize) == ("topk_sigmoid", True, True)
    assert not report.blocks[0].router_rounded
    op = next(n for n in gm.graph.nodes if n.target is torch.ops.mok.fused_moe.default)
    router, selection_bias = op.args[1], op.args[3]
    assert (router.op, selection_bias.op) == ("placeholder", "placeholder") and "router" in router.name
    assert not any(n.target is torch.mm for n in gm.graph.nodes), gm.code


def test_fp32_out_mm_router_detected():
    """``torch.mm(x, W.t(), out_dtype=torch.float32)`` as the router (its CUDA-only overload: traced on meta
    tensors, structure only): the op gets W with router_fp32."""
    module = models.Fp32MmRouterMoE().to("meta", torch.bfloat16)
    gm, example, report, _ = _fuse(module, torch.empty(24, 32, device="meta", dtype=torch.bfloat16), validate=False)
    _check_fp32_mm_router(report, gm)


def _softcapped_op_by_op():
    module = models.SoftcappedSwiGLUMoE()
    module.in_fp32 = False
    return module


def _swiglu_in_fp64():
    module = models.Fp32SwiGLUMoE()
    module.wide = torch.float64
    return module


def _silu_rounded_to(dtype):
    def make():
        module = models.Fp32SwiGLUMoE()
        module.silu_rounded_to = dtype
        return module

    return make


@pytest.mark.parametrize("make,dtype,act,reason", [
    (models.StackedGatherMoE, torch.bfloat16, "silu", None),
    (models.Fp32SwiGLUMoE, torch.float32, "silu", None),
    (models.Fp32SwiGLUMoE, torch.bfloat16, "silu_fp32", None),
    (_swiglu_in_fp64, torch.bfloat16, None, "the SwiGLU is computed in torch.float64 and rounded once"),
    (_silu_rounded_to(torch.bfloat16), torch.bfloat16, "silu", None),  # op by op, the product in fp32: exact
    (_silu_rounded_to(torch.float16), torch.bfloat16, None, "the SwiGLU's silu is rounded to torch.float16"),
    (models.SoftcappedSwiGLUMoE, torch.bfloat16, "softcapped_swiglu", None),
    (_softcapped_op_by_op, torch.bfloat16, None, "the softcapped_swiglu activation is computed op by op in the "
                                                 "experts'"),
], ids=["silu_bf16", "fp32_silu_fp32", "fp32_silu_bf16", "fp64_silu_bf16", "silu_rounded_bf16", "silu_rounded_fp16",
        "softcapped_fp32_bf16", "softcapped_op_by_op_bf16"])
def test_activation_precision(make, dtype, act, reason):
    """16-bit experts: a SwiGLU computed in fp32 and rounded once (Beam's) is the op's silu_fp32, not its silu, which
    rounds op by op (HF's default); in fp64 it is neither, and a softcapped SwiGLU op by op is not the op's, which is
    in fp32: those are left as they are, with their reasons. In fp32 experts silu and silu_fp32 are one (silu). The
    fused ones: output bitwise eager's in bf16, where the other SwiGLU's rounding is not."""
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(make().to(dtype), torch.randn(24, 32, dtype=dtype))
    if reason is not None:
        _assert_untouched(gm, example, report, eager, candidates=1)
        assert reason in report.rejected[0].reason, report.rejected[0].reason
        return
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    assert report.blocks[0].experts.activation == act
    torch.testing.assert_close(run(gm, example)[0], eager, **(TOL if dtype == torch.float32 else BF16_TOL))


def _rounded_router_module(device, transposed=None):
    module = models.Fp32MmRoundedRouterMoE().to(device, torch.bfloat16)
    if transposed is not None:
        module.transposed = transposed
    module.router.data = module.router.data.float()  # kept in fp32, as HF keeps Ergo's
    return module


def _check_rounded_router(report, gm):
    """The op reads the fp32 router weight rounded to bf16 (the graph's cast, kept outside the op)."""
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    assert report.blocks[0].routing.router_fp32 and report.blocks[0].router_rounded
    assert "router_rounded" in describe_block(report.blocks[0])
    op = next(n for n in gm.graph.nodes if n.target is torch.ops.mok.fused_moe.default)
    router = op.args[1]
    assert router.op != "placeholder" and tensor_meta(router).dtype == torch.bfloat16, gm.code
    (source,) = router.all_input_nodes
    assert source.op == "placeholder" and "router" in source.name and tensor_meta(source).dtype == torch.float32


@pytest.mark.parametrize("transposed", [lambda w: w.T, lambda w: w.mT, lambda w: w.t(), lambda w: w.transpose(-1, 0),
                                        torch.ops.aten.numpy_T, torch.ops.aten.mT],
                         ids=["T", "mT", "t", "transpose", "aten.numpy_T", "aten.mT"])
def test_fp32_out_mm_router_of_a_rounded_weight_detected(transposed):
    """``torch.mm(x, W.to(x.dtype).T, out_dtype=torch.float32)`` with W kept in fp32 (Ergo's router on CUDA; traced on
    meta tensors, structure only), its transpose spelled six ways (torch 2.14's Dynamo writes ``W.T`` and ``W.mT`` as
    the aten ops, earlier ones as attribute reads): the op gets W rounded to bf16, as the GEMM reads it, not W."""
    module = _rounded_router_module("meta", transposed)
    gm, example, report, _ = _fuse(module, torch.empty(24, 32, device="meta", dtype=torch.bfloat16), validate=False)
    _check_rounded_router(report, gm)


@pytest.mark.gpu
def test_fp32_out_mm_router_fused_on_the_gpu():
    torch.manual_seed(0)
    module = models.Fp32MmRouterMoE().to("cuda", torch.bfloat16)
    gm, example, report, eager = _fuse(module, torch.randn(64, 32, device="cuda", dtype=torch.bfloat16))
    _check_fp32_mm_router(report, gm)
    torch.testing.assert_close(run(gm, example)[0], eager, atol=2e-2, rtol=2e-2)
    torch.manual_seed(0)
    module = _rounded_router_module("cuda")
    gm, example, report, eager = _fuse(module, torch.randn(64, 32, device="cuda", dtype=torch.bfloat16))
    _check_rounded_router(report, gm)
    torch.testing.assert_close(run(gm, example)[0], eager, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("module,reason", [
    (models.ClampedMaxRenormMoE, "clamped sum other than clamp(sum, min=m)"),
    (models.BiasedWeightsMoE, "not the unbiased softmax probabilities gathered at the chosen experts"),
], ids=["clamp_max", "biased_weights"])
def test_selection_bias_near_misses(module, reason):
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(module(), torch.randn(24, 32))
    _assert_untouched(gm, example, report, eager, candidates=1)
    assert reason in report.rejected[0].reason, report.rejected[0].reason


def test_group_limited_selection_fused():
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(models.GroupLimitedMoE(), torch.randn(24, 32))
    assert [b.fused for b in report.blocks] == [True], str(report)
    spec = report.blocks[0].routing
    assert (spec.routing, spec.n_group, spec.topk_group, spec.group_top) == ("sigmoid_grouped_topk", 4, 2, 2)
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL)


def _kept_selection_op(gm):
    """The op of a block fused with its selection kept: its expert ids are the graph's own top-k's."""
    (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.mok.fused_moe.default]
    ids = op.kwargs["expert_ids"]
    assert ids.target is operator.getitem and ids.args[1] == 1 and ids.args[0].target is torch.topk, gm.code
    return op


@pytest.mark.parametrize("kw,bias_shift", [(dict(fill=0.0), 0.0), (dict(fill=0.0), -1.0), (dict(group_top=3), 0.0)],
                         ids=["zero_fill", "zero_fill_kept_scores_negative", "top3_group_score"])
def test_group_limited_selection_the_op_cannot_make_fused_keeping_it(kw, bias_shift):
    """Selections the op does not compute stay in the graph, and the op takes their ids (`expert_ids`) with the
    sigmoid scores' gathered, renormalised, scaled weights. AXK2's router is DeepSeek-V3's group-limited selection
    with the dropped groups filled with 0, where a selection bias can make kept choice values negative: a dropped
    expert (0) then outranks a kept one, and dropped experts tie, so which of them is picked only torch.topk decides.
    A group score of each group's top 3 is another selection the op has no form for."""
    torch.manual_seed(0)
    module = models.GroupLimitedMoE(**kw)
    with torch.no_grad():
        module.choice_bias.add_(bias_shift)
    x = torch.randn(24, 32)
    gm, example, report, eager = _fuse(module, x)
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    block = report.blocks[0]
    assert block.given_ids and block.kept_selection and "selection_kept" in describe_block(block)
    spec = block.routing
    assert (spec.routing, spec.n_group, spec.renormalize, spec.routed_scale) == ("sigmoid_grouped_topk", 1, True, 1.5)
    assert spec.router_is_logits  # the selection reads the graph's logits: the op takes them
    _kept_selection_op(gm)
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL)
    if bias_shift:  # dropped experts, tied at 0, were chosen over kept ones: what no kernel's own top-k could match
        with torch.no_grad():
            choice = F.linear(x, module.router).float().sigmoid() + module.choice_bias
            ids = module.route(x)[1].view(24, -1)
        assert (choice.gather(1, ids) < 0).any()


@pytest.mark.gpu
def test_group_limited_selection_kept_in_the_graph_on_the_gpu():
    """The kept selection on CUDA in bf16 (Triton kernels, the graph's own top-k's ids): fused, outputs as eager's,
    with dropped experts (tied at 0) chosen."""
    torch.manual_seed(0)
    module = models.GroupLimitedMoE(fill=0.0).to("cuda", torch.bfloat16)
    with torch.no_grad():
        module.choice_bias.sub_(1.0)
    gm, example, report, eager = _fuse(module, torch.randn(64, 32, device="cuda", dtype=torch.bfloat16))
    assert [b.fused for b in report.blocks] == [True] and report.blocks[0].kept_selection, str(report)
    _kept_selection_op(gm)
    torch.testing.assert_close(run(gm, example)[0], eager, **BF16_TOL)


@pytest.mark.parametrize("make,reason", [
    (lambda: models.GroupLimitedMoE(fill=0.0, weights_from="choice"), "fills the other groups with 0.0"),
    (lambda: models.ScrambledScoresMoE(weights_from="choice"),
     "router logits do not come from a linear layer in this graph (found reshape"),
    (lambda: models.ComputedWeightsMoE(scaled_by="activation"), "computed without the router, joins the routed output"),
], ids=["zero_fill_weights_of_the_choice", "scrambled_weights_of_the_choice", "weights_scaled_by_the_tokens"])
def test_kept_selection_and_computed_weights_near_misses(make, reason):
    """Near misses, untouched: a selection the op cannot make, kept in the graph, but weights gathered from the
    biased (or scrambled) choice values, which the op does not compute (its given ids take unbiased scores), with the
    top-k's own reason; and an expert weight scaled by a statistic of the block's tokens, which is no weight computed
    before the block."""
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(make(), torch.randn(24, 32))
    _assert_untouched(gm, example, report, eager, candidates=1)
    assert reason in report.rejected[0].reason, report.rejected[0].reason


def test_softmax_group_limited_gathered_fused():
    """Mistral4's router: only the top-k's ids are used, the weights are the probabilities gathered there (the same
    values: the 0-filled groups are never chosen over a probability)."""
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(models.SoftmaxGroupLimitedMoE(), torch.randn(24, 32))
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    spec = report.blocks[0].routing
    assert (spec.routing, spec.n_group, spec.topk_group, spec.group_top) == ("softmax_topk", 4, 2, 2)
    assert (spec.renormalize, spec.renorm_eps, spec.routed_scale) == (True, 1e-20, 1.5)
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL)


def test_softmax_group_limited_gathered_from_logits_untouched():
    """Near miss: the ids come from the probabilities but the weights are the logits gathered there."""
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(models.SoftmaxGroupLimitedMoE(gather_from="logits"), torch.randn(24, 32))
    _assert_untouched(gm, example, report, eager, candidates=1)
    assert "not the unbiased softmax probabilities gathered at the chosen experts" in report.rejected[0].reason


def test_sqrt_softplus_router_clamped_swiglu_fused():
    """DeepSeek-V4's routed experts: sqrt(softplus) scores with a selection bias, renormalised (+1e-20) and scaled,
    the SwiGLU clamped at a limit the inputs cross (gate from above, up on both sides)."""
    torch.manual_seed(0)
    module = models.SqrtSoftplusMoE()
    gm, example, report, eager = _fuse(module, torch.randn(24, 32))
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    routing, experts = report.blocks[0].routing, report.blocks[0].experts
    assert (routing.routing, routing.softmax_fp32, routing.renorm_eps, routing.routed_scale) == (
        "sqrtsoftplus_topk", True, 1e-20, 1.5)
    assert (experts.activation, experts.limit) == ("clamped_swiglu", 0.5)
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL)
    with torch.no_grad():  # the limit clamped some gate from above and some up from below
        h = torch.einsum("eih,th->tei", module.w_in, example[0])
        assert (h[..., :16] > 0.5).any() and (h[..., 16:] < -0.5).any()


@pytest.mark.parametrize("variant, reason", [
    ("softplus", "softplus without its square root"),
    ("beta", "beta or threshold other than PyTorch's defaults"),
    ("cast", "softplus and its sqrt run in different dtypes"),
    ("swapped_clamps", "is not silu(gate.clamp(max=L)) * up.clamp(-L, L)"),
])
def test_sqrt_softplus_near_misses_untouched(variant, reason):
    gm, example, report, eager = _fuse(models.SqrtSoftplusMoE(variant=variant), torch.randn(24, 32))
    _assert_untouched(gm, example, report, eager, candidates=1)
    assert reason in report.rejected[0].reason, report.rejected[0].reason


def _tokens(T, vocab=50):
    ids = torch.randint(0, vocab, (T,), generator=torch.Generator().manual_seed(1))
    ids[:3] = torch.tensor([0, 1, 2])  # rows that name expert 5 twice
    return ids


def test_hash_routed_module_fused_with_given_ids():
    """Experts looked up by token id, weighted by the softmax probabilities gathered at them (softmax_topk with given
    ids): fused; the table lookup stays in the graph as the op's expert_ids."""
    torch.manual_seed(0)
    routing, lookup = _fused_with_given_ids(models.HashRoutedMoE(), _tokens(24))
    assert (routing.routing, routing.renormalize, routing.routed_scale) == ("softmax_topk", True, 1.5)
    assert lookup.target is operator.getitem and "table" in lookup.args[0].name


def _fused_with_given_ids(module, tokens):
    """Fuse `module` (x [24, 32], token ids): one block, fused with given ids, the graph's output as eager's.
    Returns its RoutingSpec and the node the op takes as expert_ids."""
    (graph,), eager = capture(module.eval(), torch.randn(24, 32), tokens)
    gm, example = graph
    report = fuse_moe(gm, example)
    assert [(b.fused, b.given_ids) for b in report.blocks] == [(True, True)] and count_fused(gm) == 1, str(report)
    (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.mok.fused_moe.default]
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL)
    return report.blocks[0].routing, op.kwargs["expert_ids"]


class _Submodule(torch.nn.Module):
    """`moe` as a submodule, so that its nodes have a module path ("moe")."""

    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, *args):
        return self.moe(*args)


@pytest.mark.parametrize("variant, form", [("topk_weights", "hash_routing"), ("biased", None)])
def test_hash_routed_near_misses_untouched(variant, form):
    """Weights that are not the scores at the looked-up ids: reported (as hash routing where no scores are gathered
    at the ids, which needs the lookup's module path; by the reason for a bias added to the gathered scores), the
    graph left as it was."""
    module = _Submodule(models.HashRoutedMoE(variant=variant)).eval()
    (graph,), eager = capture(module, torch.randn(24, 32), _tokens(24))
    gm, example = graph
    report = fuse_moe(gm, example)
    _assert_untouched(gm, example, report, eager, candidates=1)
    if form:
        assert report.rejected[0].form == form
    else:
        assert "selection bias" in report.rejected[0].reason, report.rejected[0].reason


def test_modulo_hash_module_fused_with_given_ids():
    """Ids from arithmetic on token ids ((a * token + b) % E per slot, no table): computed from integers alone, so they
    are given ids too; fused with sigmoid scores at them (sigmoid_grouped_topk with given ids), the hash left in the
    graph."""
    tokens = _tokens(24)
    assert ((tokens * 7 + 1) % 8 == (tokens * 3 + 5) % 8).any()  # some token's two slots name one expert
    routing, ids = _fused_with_given_ids(models.ModuloHashMoE(), tokens)
    assert (routing.routing, routing.renormalize, routing.routed_scale) == ("sigmoid_grouped_topk", False, 1.5)
    assert ids.target is torch.stack


def test_activation_dependent_hash_untouched():
    """Near miss: the hash also reads the hidden states (their argmax), so the ids are neither a top-k's nor given:
    no block is anchored, and the graph stays as it was."""
    gm, example, report, eager = _fuse(models.ModuloHashMoE(variant="activation"), torch.randn(24, 32), _tokens(24))
    _assert_untouched(gm, example, report, eager, candidates=0)


def test_shared_expert_stays_outside():
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(models.SharedExpertMoE(), torch.randn(10, 32))
    assert len(report.fused) == 1 and not report.rejected, str(report)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder" and "shared" in n.name]
    assert len(names) == 4  # three shared-expert weights and the shared gate, still used outside the op
    assert sum("sigmoid" in op for op in ops_in(gm)) == 1
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL)


def test_viewed_shared_expert_stays_outside():
    """The shared expert's output joins the routed one through a view and a sum (AFMoE): fused without it."""
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(models.ViewedSharedExpertMoE(), torch.randn(2, 5, 32))
    assert len(report.fused) == 1 and not report.rejected, str(report)
    shared = [n for n in gm.graph.nodes if n.op == "placeholder" and "shared" in n.name]
    assert len(shared) == 3 and all(n.users for n in shared)  # still used outside the op
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL)


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("module", [models.SquaredOutputMoE, models.PostNormMoE], ids=["squared", "post_norm"])
def test_ops_after_the_block_stay_outside(module, validate):
    """What follows the experts' sum (a square; a post-norm's no-op cast and its pow in fp32) is not taken for the
    block's output: the block fuses without it, also on the structural proof alone (validate=False)."""
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(module(), torch.randn(10, 32), validate=validate)
    assert len(report.fused) == 1 and not report.rejected, str(report)
    assert any("pow" in op for op in ops_in(gm))
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL)


@pytest.mark.parametrize("validate", [True, False], ids=["validate", "structural"])
def test_constant_scales_around_the_block(validate):
    """Weights divided by a number fold into the op's routed_scale (1.5 / 3 here); the experts' sum multiplied by a
    number after the block stays in the graph (a product with a number never combines)."""
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(models.DividedWeightsMoE(), torch.randn(10, 32), validate=validate)
    assert len(report.fused) == 1 and not report.rejected, str(report)
    assert report.blocks[0].routing.routed_scale == pytest.approx(0.5)
    assert any(n.op == "call_function" and "mul" in str(n.target) and 2.0 in n.args for n in gm.graph.nodes), gm.code
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL)


def test_weights_divided_by_a_tensor_not_fused():
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(models.TensorDividedWeightsMoE(), torch.randn(10, 32))
    _assert_untouched(gm, example, report, eager, candidates=1)
    assert "temperature" in report.rejected[0].reason  # named as an input the supported forms do not have


def test_validate_false_gives_the_same_rewrite():
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(models.StackedGatherMoE(), torch.randn(10, 32), validate=False)
    assert len(report.fused) == 1
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL)


# ----------------------------------------------------------------------------- near misses


def _assert_untouched(gm, example, report, eager, candidates):
    assert not report.fused and count_fused(gm) == 0, str(report)
    assert counters["mok"]["fused_moe"] == 0
    assert counters["mok"]["rejected_moe"] == candidates == len(report.rejected)
    got, want = run(gm, example), eager
    for g, w in zip(got if isinstance(got, (tuple, list)) else [got], want if isinstance(want, tuple) else [want]):
        assert torch.equal(g, w)


@pytest.mark.parametrize("module,shape", [(models.DenseMLP(), (10, 32)), (models.TopKSampler(), (10, 32)),
                                          (models.TopKTokenPruning(), (10, 32))],
                         ids=["dense_mlp", "topk_sampling", "topk_token_pruning"])
def test_not_an_moe(module, shape):
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(module, torch.randn(shape))
    _assert_untouched(gm, example, report, eager, candidates=0)


class _Residual(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, h):
        return h + self.block(h)


def test_residual_sum_stays_outside_the_block():
    """``h + moe(h)``: the sum with the block's own input has its shape and depends on nothing else, but the op
    computes the experts' sum only; the block ends before the residual (before, the probe rejected the block)."""
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(_Residual(models.StackedGatherMoE()), torch.randn(10, 32))
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    h = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert any(n.target is operator.add and h in n.args for n in gm.graph.nodes), gm.code  # the residual, outside
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL)


class _DetachedTopKMoE(models.StackedGatherMoE):
    """The top-k of detached logits, its values' softmax the weights: eager gives the router no gradient."""

    def route(self, x):
        values, ids = torch.topk(F.linear(x, self.router).detach(), self.top_k, dim=-1)
        return torch.softmax(values, dim=-1), ids.reshape(-1)


def test_weights_from_a_detached_top_k_not_fused():
    """Near miss: a detach before the top-k whose values become the weights (the op's weights would carry the
    router's gradient, eager's carry none): left as it is, with the reason."""
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(_DetachedTopKMoE(), torch.randn(10, 32))
    _assert_untouched(gm, example, report, eager, candidates=1)
    assert "computed from a detached value" in report.rejected[0].reason, report.rejected[0].reason


class _BatchRoutedMoE(models.StackedGatherMoE):
    """Routed on [B, S, H] (logits [B, S, E], as Zaya routes), its experts on the tokens flattened to [B * S, H]."""

    def forward(self, x):
        B, S, H = x.shape
        logits = F.linear(x, self.router)
        values, ids = torch.topk(logits, self.top_k, dim=-1)
        w = torch.softmax(values, dim=-1).reshape(-1, self.top_k)
        flat = x.reshape(-1, H)
        y = self.experts(flat.repeat_interleave(self.top_k, dim=0), ids.reshape(-1))
        return (y.view(B * S, self.top_k, H) * w.unsqueeze(-1)).sum(dim=1).view(B, S, H)


@pytest.mark.parametrize("validate", [True, False], ids=["validate", "structural"])
def test_logits_of_batched_tokens(validate):
    """Logits [B, S, E] of a router on [B, S, H], experts on the tokens flattened: fused with the logits the op's
    router argument viewed as [B * S, E]; on the structure alone it is left as it is (that the flattened logits'
    rows meet the experts' tokens only the probe proves), with the reason."""
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(_BatchRoutedMoE(), torch.randn(2, 5, 32), validate=validate)
    if validate:
        assert [b.fused for b in report.blocks] == [True] and report.blocks[0].routing.router_is_logits, str(report)
        torch.testing.assert_close(run(gm, example)[0], eager, **TOL)
    else:
        _assert_untouched(gm, example, report, eager, candidates=1)
        assert "only the probe proves" in report.rejected[0].reason, report.rejected[0].reason


class _ScaledResidual(torch.nn.Module):
    """Zaya's residual scaling after its MoE block: ``(moe(h) + b) * s + h`` with b and s [H] parameters."""

    def __init__(self, block, hidden=32):
        super().__init__()
        self.block = block
        self.bias = torch.nn.Parameter(torch.randn(hidden) * 0.1)
        self.scale = torch.nn.Parameter(1 + torch.randn(hidden) * 0.1)

    def forward(self, h):
        return (self.block(h) + self.bias) * self.scale + h


@pytest.mark.parametrize("validate", [True, False], ids=["validate", "structural"])
def test_vector_bias_and_scale_after_the_block_stay_outside(validate):
    """A bias and a scale of [H] applied to the experts' sum are past the block (the combine multiplies by routing
    weights, never by a vector the block takes as it is): fused without them (before, the region took them in and
    the experts' match rejected the block)."""
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(_ScaledResidual(models.StackedGatherMoE()), torch.randn(10, 32),
                                       validate=validate)
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    params = [n for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith("l_self_parameters_")]
    assert len(params) == 2 and all(n.users for n in params), gm.code  # still read, outside the op
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL)


@pytest.mark.parametrize("pooled", [False, True], ids=["keys", "pools"])
def test_sparse_attention_top_k_before_an_moe_is_not_a_block(pooled):
    """The attention's top-k indices reach the MoE's grouped GEMMs through the attention's matmuls and the residual:
    not an expert choice; nor does indexing a 3-D integer table with them make one. The MoE is fused, nothing else
    is reported."""
    torch.manual_seed(0)  # bf16: torch._grouped_mm's only dtype here
    module = models.TopKAttentionThenMoE(pooled=pooled).to(torch.bfloat16)
    gm, example, report, eager = _fuse(module, torch.randn(12, 32, dtype=torch.bfloat16))
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    assert sum(1 for n in gm.graph.nodes if "topk" in str(n.target)) == 1  # the attention's, left in place
    torch.testing.assert_close(run(gm, example)[0], eager, atol=2e-2, rtol=2e-2)


def test_tanh_experts_not_fused():
    torch.manual_seed(0)
    module = models.DenseMaskMoE(expert_cls=lambda h, i: models.SwiGLUExpert(h, i, act=torch.tanh))
    gm, example, report, eager = _fuse(module, torch.randn(10, 32))
    _assert_untouched(gm, example, report, eager, candidates=1)
    assert "'tanh'" in report.rejected[0].reason


def test_routing_weight_on_expert_input_not_fused():
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(models.WeightOnInputMoE(), torch.randn(10, 32))
    _assert_untouched(gm, example, report, eager, candidates=1)
    assert "before the down projection" in report.rejected[0].reason


def test_squared_routing_weight_not_fused():
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(models.SquaredWeightsMoE(), torch.randn(10, 32))
    _assert_untouched(gm, example, report, eager, candidates=1)
    assert "routing weights go through 'mul'" in report.rejected[0].reason


def test_viewed_shared_expert_inside_the_slots_not_fused():
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(models.SharedInEverySlotMoE(), torch.randn(2, 5, 32))
    _assert_untouched(gm, example, report, eager, candidates=1)
    assert "a shared expert stays outside" in report.rejected[0].reason


def test_strict_raises_naming_block_and_reason():
    torch.manual_seed(0)
    (graph,), _ = capture(models.SquaredWeightsMoE().eval(), torch.randn(10, 32))
    with pytest.raises(MoeFusionError, match="was not fused: routing weights go through"):
        fuse_moe(*graph, strict=True)


class _Chain(torch.nn.Module):
    def __init__(self, *blocks):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)  # no residual: each block's output is the next block's whole input
        return x


def test_chained_blocks_are_separate_regions():
    """A block ends before the next block's router, even when everything downstream depends only on its input."""
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(_Chain(models.StackedGatherMoE(), models.StackedGatherMoE(),
                                              models.SentinelMaskMoE()), torch.randn(10, 32))
    assert [(b.fused, b.form) for b in report.blocks] == [(True, "batched_mm")] * 3, str(report)
    assert count_fused(gm) == 3
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL)


@pytest.mark.parametrize("top_k", [1, 2])
def test_dense_weight_on_input_from_scratch(top_k):
    """Llama4's dense weight-on-input form without transformers: fused by structure, the side MLP and its
    in-place add of the routed sum stay outside the op."""
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(models.DenseScaledInputMoE(top_k=top_k), torch.randn(2, 5, 32))
    assert [(b.fused, b.form) for b in report.blocks] == [(True, "dense_bmm")], str(report)
    spec = report.blocks[0].routing
    assert (spec.routing, spec.weight_on_input, spec.top_k) == ("topk_sigmoid", True, top_k)
    assert report.blocks[0].experts.transposed and report.blocks[0].experts.activation == "silu"
    assert count_fused(gm) == 1
    ops = ops_in(gm)
    assert not any(op in ("repeat", "scatter_") or "bmm" in op or "topk" in op for op in ops), gm.code
    assert "add_" in ops, gm.code  # the side MLP's output still receives the routed sum in place
    torch.testing.assert_close(_first(run(gm, example)), eager, **TOL)


def test_dense_weight_on_input_with_computed_weights_fused():
    """The dense form whose expert weights carry a LoRA delta computed after the routing (PEFT's LoRA on Llama4's
    experts, traced): the ids reach a bmm over weights computed from parameters alone, so the block is a candidate
    (`region.dispatch_evidence`), and fused with the op taking the computed weights; outputs and every gradient as
    eager's. Its near miss, the weight also scaled by the tokens, is in `test_dense_weight_on_input_near_misses`."""
    torch.manual_seed(0)
    module = models.DenseScaledInputMoE(variant="lora")
    gm, example, report, eager = _fuse(module, torch.randn(2, 5, 32))
    assert [(b.fused, b.form) for b in report.blocks] == [(True, "dense_bmm")], str(report)
    (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.mok.fused_moe.default]
    assert (op_name(op.args[4]), op_name(op.args[6])) == ("add", "add"), gm.code  # W + B @ A, before the op
    torch.testing.assert_close(_first(run(gm, example)), eager, **TOL)
    grads = _check_gradients(gm, example, module)
    assert all(g is not None for g in grads), [g is None for g in grads]


@pytest.mark.parametrize("variant,reason", [
    ("zero_fill", "-inf"),
    ("scores_after", None),  # the ids reach no expert matmul: not even a candidate block
    ("scores_twice", "used elsewhere"),
    ("expert_bias", "bias"),
    ("lora_by_tokens", None),  # a weight scaled by the tokens is no expert weight: not a candidate either
])
def test_dense_weight_on_input_near_misses(variant, reason):
    """Look-alikes of the dense form that are not a sparse weight-on-input MoE: not fused, graph unchanged."""
    torch.manual_seed(0)
    gm, example, report, eager = _fuse(models.DenseScaledInputMoE(variant=variant), torch.randn(2, 5, 32))
    assert not report.fused, str(report)
    if reason is not None:
        assert [b.fused for b in report.blocks] == [False], str(report)
        assert reason in report.blocks[0].reason, report.blocks[0].reason
    assert count_fused(gm) == 0
    torch.testing.assert_close(_first(run(gm, example)), eager, atol=0, rtol=0)


def test_dense_weight_on_input_wrong_score_layout_fails_the_probe():
    """The structure fits, but the scores are transposed wrongly (token-major instead of expert-major rows), so
    expert e of token t gets another pair's score: only the probe can tell, and it must refuse."""

    class Misaligned(models.DenseScaledInputMoE):
        def forward(self, hidden_states):
            B, S, H = hidden_states.shape
            x = hidden_states.reshape(-1, H)
            logits = F.linear(x, self.proj_score)
            top, idx = torch.topk(logits, self.top_k, dim=1)
            scores = torch.sigmoid(torch.full_like(logits, float("-inf")).scatter_(1, idx, top).float()).to(x.dtype)
            xin = (x.repeat(self.num_experts, 1) * scores.reshape(-1, 1)).view(self.num_experts, -1, H)
            gate, up = torch.bmm(xin, self.w_in).chunk(2, dim=-1)
            y = torch.bmm(up * F.silu(gate), self.w_out)
            return (self.side(x) + y.reshape(self.num_experts, -1, H).sum(dim=0)).view(B, S, H)

    torch.manual_seed(0)
    gm, example, report, eager = _fuse(Misaligned(), torch.randn(2, 5, 32))
    assert [b.fused for b in report.blocks] == [False], str(report)
    assert "probe" in report.blocks[0].reason, report.blocks[0].reason
    torch.testing.assert_close(_first(run(gm, example)), eager, atol=0, rtol=0)


def test_dense_weight_on_input_dynamic_tokens():
    """dynamic=True: the dense form fuses with a symbolic token count (repeat/view sizes stay symbolic)."""
    torch.manual_seed(0)
    module = models.DenseScaledInputMoE(top_k=2).eval()
    (graph,), eager = capture(module, torch.randn(2, 5, 32), dynamic=True)
    gm, example = graph
    report = fuse_moe(gm, example)
    assert [(b.fused, b.form) for b in report.blocks] == [(True, "dense_bmm")], str(report)
    op, = [n for n in gm.graph.nodes if n.target is torch.ops.mok.fused_moe.default]
    assert isinstance(op.meta["val"][0].shape[0], torch.SymInt)
    torch.testing.assert_close(_first(run(gm, example)), eager, **TOL)
