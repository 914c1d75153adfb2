"""fuse_moe on blocks whose experts normalise each output row before its routing weight (the op's post_norm):
Muse Spark's input-scaled RMSNorm (scaled_rms, its router's logits scaled and its experts on a projection of the
tokens) and Ergo's RMSNorm per expert (rms, an [E, H] weight); near misses of each, left unfused with their reason."""

import pytest
import torch
import torch.nn.functional as F

from mok_compile.diagnostics import describe_block
from mok_compile.hf_blocks import available, init_moe_weights_, make_block, make_config, new_block
from mok_compile.ops import reference
from mok_compile.passes import fuse_moe
from mok_compile.passes.op_names import tensor_meta

from .helpers import capture, count_fused, run

pytestmark = pytest.mark.skipif(available(["muse_spark", "ergo"]) != ("muse_spark", "ergo"),
                                reason="Muse Spark and Ergo come with transformers 5.25")

TOL = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float32: dict(atol=1e-5, rtol=1e-5)}


def _post_norm_block(family, dtype=torch.float32, impl="grouped_mm", norm=None, experts_forward=None):
    """`family`'s block (weights std 0.2, its norm weight drawn too) captured on a [2, 5, 64] input: (gm,
    example_inputs, eager output, block). `norm(module, rows[, ids])` replaces the post-norm's forward,
    `experts_forward(module, x, ids, weights)` Ergo's experts' forward (near misses)."""
    block = make_block(family, dtype=dtype, experts_implementation=impl)
    init_moe_weights_(block, std=0.2)
    if norm is not None:
        block.experts.post_expert_norm.forward = norm.__get__(block.experts.post_expert_norm)
    if experts_forward is not None:
        block.experts.forward = experts_forward.__get__(block.experts)
    (graph,), eager = capture(block, torch.randn(2, 5, 64, dtype=dtype))
    return (*graph, eager, block)


def _op(gm):
    (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.mok.fused_moe.default]
    return op


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_muse_spark_block_fused(dtype, impl):
    """Muse Spark's block: its router's logits scaled by output_multiplier and its experts on another tensor (the
    tokens projected and normalised) make the logits the op's router argument; its experts' input-scaled RMSNorm is
    the op's scaled_rms (offset 1, its eps, its weight as post_norm_weight). One block fused, output as eager's."""
    gm, example, eager, block = _post_norm_block("muse_spark", dtype, impl)
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    b = report.blocks[0]
    r, e = b.routing, b.experts
    assert (r.routing, r.router_is_logits, r.renormalize, r.renorm_eps) == ("sigmoid_grouped_topk", True, True, 1e-15)
    eps = block.experts.post_expert_norm.eps
    assert (e.post_norm, e.post_norm_eps, e.post_norm_offset) == ("scaled_rms", eps, 1.0)
    assert (b.num_experts, b.hidden, b.intermediate) == (8, 48, 32)
    assert f"post_norm=scaled_rms(eps={eps:g}, offset=1)" in describe_block(b)
    assert "post_expert_norm" in _op(gm).kwargs["post_norm_weight"].name
    assert any(n.op == "call_function" and "linear" in str(n.target) for n in _op(gm).args[1].all_input_nodes)
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL[dtype])


def test_muse_spark_block_at_the_model_width_fused():
    """Muse Spark's experts at the model's own width (moe_hidden_size = hidden_size): its projection back up has the
    combined output's shape and dtype, and lies past the block. Fused, output as eager's."""
    config = make_config("muse_spark", moe_hidden_size=64)
    config._experts_implementation = "grouped_mm"
    block = init_moe_weights_(new_block("muse_spark", config), std=0.2).eval()
    (graph,), eager = capture(block, torch.randn(2, 5, 64))
    report = fuse_moe(*graph)
    assert [(b.fused, b.hidden) for b in report.blocks] == [(True, 64)] and count_fused(graph[0]) == 1, str(report)
    torch.testing.assert_close(run(*graph)[0], eager, **TOL[torch.float32])


def _muse_norm(variant):
    """MuseSparkTextInputScaledRMSNorm's forward as HF writes it ("hf"), or a near miss of it."""

    def forward(self, x):
        scale = (1.0 + self.weight.float()) if variant == "offset_in_fp32" else (1.0 + self.weight).float()
        scaled = x.float() * scale
        v = scaled if variant == "not_rounded" else scaled.type_as(x).float()
        mean_square = v.pow(2).mean(0 if variant == "mean_dim0" else -1, keepdim=True)
        if variant == "pow_half":
            return (v * torch.pow(mean_square + self.eps, -0.5)).type_as(x)
        return (v * torch.rsqrt(mean_square if variant == "no_eps" else mean_square + self.eps)).type_as(x)

    return forward


def test_muse_spark_norm_written_again_fused():
    """The near misses' own norm, unchanged: fused (they fail on what they change)."""
    gm, example, eager, _ = _post_norm_block("muse_spark", torch.bfloat16, norm=_muse_norm("hf"))
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True] and report.blocks[0].experts.post_norm == "scaled_rms"
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL[torch.bfloat16])


@pytest.mark.parametrize("variant, reason", [
    ("no_eps", "rsqrt does not read the mean of squares plus an eps"),
    ("mean_dim0", "mean is over dim 0"),
    ("not_rounded", "the scaled rows the post-norm normalises are not rounded to the experts' dtype torch.bfloat16"),
    ("offset_in_fp32", "adds its offset to its weight in another dtype"),
    ("pow_half", "0 rsqrt or rms_norm ops and 1 means"),
])
def test_muse_spark_near_miss_norms_not_fused(variant, reason):
    """Near misses of Muse Spark's norm (bf16, where its casts round), each left as it is with its reason."""
    gm, example, eager, _ = _post_norm_block("muse_spark", torch.bfloat16, norm=_muse_norm(variant))
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [False] and count_fused(gm) == 0, str(report)
    assert reason in report.blocks[0].reason, report.blocks[0].reason
    torch.testing.assert_close(run(gm, example)[0], eager, atol=0, rtol=0)


def test_muse_spark_router_scaled_by_a_tensor_not_fused():
    """Near miss of the scaled logits: scaled by a tensor (not a number), they are not a router the pass reads."""
    block = make_block("muse_spark")
    block.gate.output_multiplier = torch.nn.Parameter(torch.tensor(0.5))
    (graph,), eager = capture(block, torch.randn(2, 5, 64))
    gm, example = graph
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [False] and count_fused(gm) == 0, str(report)
    assert "router logits do not come from a linear layer" in report.blocks[0].reason, report.blocks[0].reason


def test_muse_spark_runtime_eps_not_fused():
    """Under dynamic=True Dynamo traces the router's renormalisation eps (and the norms' eps) as graph inputs: left
    unfused with the fix, which fuses it."""
    block = make_block("muse_spark")
    (graph,), _ = capture(block, torch.randn(2, 5, 64), dynamic=True)
    report = fuse_moe(*graph)
    assert [b.fused for b in report.blocks] == [False], str(report)
    assert "specialize_float = True" in report.blocks[0].reason, report.blocks[0].reason
    with torch._dynamo.config.patch(specialize_float=True):
        (graph,), eager = capture(block, torch.randn(2, 5, 64), dynamic=True)
    assert [b.fused for b in fuse_moe(*graph).blocks] == [True]
    torch.testing.assert_close(run(*graph)[0], eager, **TOL[torch.float32])


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_ergo_block_fused(impl):
    """Ergo's block (fp32): each token's rows repeated once per route and run as unit-weight top-1 routes, then an
    RMSNorm per route with its expert's row of an [E, H] weight (the op's rms), then weighted and summed; a sigmoid
    router with a selection bias; relu2 experts in transposed layout; its shared expert outside. Fused, output as
    eager's."""
    gm, example, eager, block = _post_norm_block("ergo", torch.float32, impl)
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    r, e = report.blocks[0].routing, report.blocks[0].experts
    assert (r.routing, r.router_is_logits, r.renorm_eps) == ("sigmoid_grouped_topk", False, 1e-20)
    assert (e.activation, e.gated, e.transposed) == ("relu2", False, True)
    assert (e.post_norm, e.post_norm_eps, e.post_norm_offset) == ("rms", block.experts.post_expert_norm.eps, 0.0)
    assert tuple(_op(gm).kwargs["post_norm_weight"].meta["example_value"].shape) == (8, 64)
    assert sum(1 for n in gm.graph.nodes if "shared_experts" in n.name and n.op == "placeholder" and n.users) == 3
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL[torch.float32])


def _ergo_norm_after_weights(self, hidden_states, top_k_index, top_k_weights):
    """ErgoExperts.forward with its norm applied after the routing weights."""
    K, H = top_k_index.size(1), hidden_states.shape[-1]
    rows = hidden_states.repeat_interleave(K, dim=0)
    flat = top_k_index.reshape(-1, 1)
    y = super(type(self), self).forward(rows, flat, rows.new_ones(flat.shape))
    y = (y.view(-1, K, H) * top_k_weights.unsqueeze(-1)).view(-1, H)
    y = self.post_expert_norm(y, flat.flatten())
    return y.view(-1, K, H).sum(1).to(hidden_states.dtype)


def _ergo_norm_doubled(self, hidden_states, expert_ids):
    """ErgoExpertNorm's forward with the normalised rows doubled before the weight."""
    normalized = F.rms_norm(hidden_states.float(), (hidden_states.shape[-1],), eps=self.eps) * 2.0
    return (normalized * self.weight[expert_ids]).to(hidden_states.dtype)


@pytest.mark.parametrize("kwargs, reason", [
    (dict(experts_forward=_ergo_norm_after_weights), "normalises values the routing weights reach"),
    (dict(norm=_ergo_norm_doubled), "scaled by 0 norm weights"),
], ids=["after_weights", "doubled"])
def test_ergo_near_miss_norms_not_fused(kwargs, reason):
    """Near misses of Ergo's per-route norm, each left as it is with its reason."""
    gm, example, eager, _ = _post_norm_block("ergo", **kwargs)
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [False] and count_fused(gm) == 0, str(report)
    assert reason in report.blocks[0].reason, report.blocks[0].reason
    torch.testing.assert_close(run(gm, example)[0], eager, atol=0, rtol=0)


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_ergo_bf16_block_fused_with_rounded_weights(impl):
    """In bf16 Ergo rounds its routing weights to bf16, widens them again and weighs the bf16 rows in fp32: the op's
    round_weights. Fused, output as eager's; and on its own rows the op with round_weights is Ergo's experts bit
    for bit, where neither unrounded fp32 weights nor bf16 ones are."""
    gm, example, eager, block = _post_norm_block("ergo", torch.bfloat16, impl)
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    r = report.blocks[0].routing
    assert (r.weights_fp32, r.round_weights, r.round_weights_to) == (True, True, None)
    assert "weights_rounded" in describe_block(report.blocks[0])
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL[torch.bfloat16])

    x = torch.randn(10, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))

    def op_output(weights_fp32, round_weights):
        experts = block.experts
        out, _, _ = reference.fused_moe_reference(
            x, block.gate(x)[0], None, block.gate.e_score_correction_bias, experts.up_proj, None, experts.down_proj,
            None, top_k=2, routing="sigmoid_grouped_topk", router_is_logits=True, renormalize=True, renorm_eps=1e-20,
            routed_scale=block.gate.routed_scaling_factor, weights_fp32=weights_fp32, round_weights=round_weights,
            activation="relu2", gated=False, transposed=True, post_norm="rms",
            post_norm_eps=experts.post_expert_norm.eps, post_norm_weight=experts.post_expert_norm.weight)
        return out

    with torch.no_grad():
        want = block.experts(x, *reversed(block.gate(x)[1:]))
        assert torch.equal(op_output(True, True), want)
        assert not torch.equal(op_output(True, False), want)
        assert not torch.equal(op_output(False, False), want)


@pytest.mark.gpu
def test_ergo_bf16_block_fused_on_cuda():
    """At inference on CUDA Ergo's router is ``torch.mm(x, W.to(x.dtype).T, out_dtype=torch.float32)`` of its fp32
    weight: fused, the op reading the weight rounded to bf16 (its cast kept outside the op), output as eager's."""
    block = make_block("ergo", dtype=torch.bfloat16)
    init_moe_weights_(block, std=0.2)
    assert block.gate.linear.weight.dtype == torch.float32  # as HF keeps it
    block = block.to("cuda")
    (graph,), eager = capture(block, torch.randn(2, 64, 64, dtype=torch.bfloat16, device="cuda"))
    gm, example = graph
    assert any(n.kwargs.get("out_dtype") == torch.float32 for n in gm.graph.nodes), gm.code  # the CUDA router
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    router = _op(gm).args[1]
    assert router.op != "placeholder" and tensor_meta(router).dtype == torch.bfloat16, gm.code
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL[torch.bfloat16])


def _ergo_router_through_fp16(self, hidden_states):
    """ErgoTopkRouter's forward with its weights rounded to fp16 (not the experts' bf16) and widened again."""
    logits, weights, ids = type(self).forward(self, hidden_states)
    return logits, weights.to(torch.float16).float(), ids


def test_ergo_bf16_weights_rounded_to_another_dtype_not_fused():
    """Near miss: Ergo's weights rounded to bf16 and widened, then rounded to fp16 and widened again: the op rounds
    them once."""
    block = make_block("ergo", dtype=torch.bfloat16)
    init_moe_weights_(block, std=0.2)
    block.gate.forward = _ergo_router_through_fp16.__get__(block.gate)
    (graph,), eager = capture(block, torch.randn(2, 5, 64, dtype=torch.bfloat16))
    report = fuse_moe(*graph)
    assert [b.fused for b in report.blocks] == [False] and count_fused(graph[0]) == 0, str(report)
    assert "rounded to torch.bfloat16, then to torch.float16: the op rounds them once" in report.blocks[0].reason, \
        report.blocks[0].reason
    torch.testing.assert_close(run(*graph)[0], eager, atol=0, rtol=0)
