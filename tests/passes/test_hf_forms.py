"""fuse_moe on transformers 5.x MoE blocks and models: grouped_mm (bf16), grouped_mm_fallback (fp32), batched_mm."""

import dataclasses
import functools

import pytest
import torch
from torch._dynamo.utils import counters

from mok_compile.diagnostics import describe_block
from mok_compile.hf_blocks import FAMILIES, available, init_moe_weights_, make_block, make_config, routed_parts
from mok_compile.ops import reference
from mok_compile.passes import fuse_moe
from mok_compile.passes.op_names import module_path, op_name, tensor_meta

from .helpers import capture, count_fused, ops_in, run
from .models import sparsemixer

TOL = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float32: dict(atol=1e-5, rtol=1e-5)}
EXPECTED_FORM = {("grouped_mm", torch.bfloat16): "grouped_mm", ("grouped_mm", torch.float32): "grouped_mm_fallback",
                 ("batched_mm", torch.bfloat16): "batched_mm", ("batched_mm", torch.float32): "batched_mm"}


def _output(result):
    return result[0] if isinstance(result, tuple) else result


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_block_fused(family, dtype, impl):
    block = make_block(family, dtype=dtype, experts_implementation=impl)
    x = torch.randn(2, 5, 64, dtype=dtype)
    (graph,), eager = capture(block, x)
    gm, example = graph
    report = fuse_moe(gm, example)

    assert [b.fused for b in report.blocks] == [True], str(report)
    assert counters["mok"]["fused_moe"] == 1 and counters["mok"]["rejected_moe"] == 0
    assert count_fused(gm) == 1
    assert not any("topk" in op or "grouped_mm" in op or "bmm" in op for op in ops_in(gm)), gm.code
    torch.testing.assert_close(_output(run(gm, example)), _output(eager), **TOL[dtype])

    block_report = report.blocks[0]
    assert block_report.form == EXPECTED_FORM[(impl, dtype)]
    assert (block_report.num_experts, block_report.top_k, block_report.hidden, block_report.intermediate) == (8, 2, 64, 32)
    _, _, routing, experts = routed_parts(family, block)
    assert block_report.experts == experts
    got = dataclasses.asdict(block_report.routing)
    want = dataclasses.asdict(routing)
    if dtype == torch.float32:  # fp32 router / fp32 weights are the same computation for fp32 inputs
        for key in ("router_fp32", "softmax_fp32", "weights_fp32"):
            got.pop(key), want.pop(key)
    assert got == want


def test_bf16_block_is_bitwise_identical():
    """grouped_mm in bf16: the fused op (reference kernel on CPU) reproduces the HF block bit for bit."""
    block = make_block("qwen3_moe", dtype=torch.bfloat16)
    (graph,), eager = capture(block, torch.randn(3, 7, 64, dtype=torch.bfloat16))
    fuse_moe(*graph)
    assert torch.equal(_output(run(*graph)), _output(eager))


def test_router_scores_output_replaced_by_op_weights():
    """GPT-OSS returns the top-k routing weights; they become the op's second output (no routing left in the graph)."""
    block = make_block("gpt_oss", dtype=torch.float32)
    (graph,), eager = capture(block, torch.randn(2, 5, 64))
    gm, example = graph
    fuse_moe(gm, example)
    assert not any("topk" in op or "softmax" in op for op in ops_in(gm)), gm.code
    out, scores = run(gm, example)
    torch.testing.assert_close(out, eager[0], **TOL[torch.float32])
    torch.testing.assert_close(scores, eager[1], **TOL[torch.float32])


def _fused_block(block_cls, config, dtype):
    """`block_cls(config)` with random weights in `dtype` (grouped_mm experts), captured on a [2, 5, 64] input and
    fused: (block, x, gm, example_inputs, the fused block's RoutingSpec, eager output); exactly one block fused."""
    config._experts_implementation = "grouped_mm"
    block = init_moe_weights_(block_cls(config)).to(dtype).eval()
    x = torch.randn(2, 5, 64, dtype=dtype)
    (graph,), eager = capture(block, x)
    gm, example = graph
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True], str(report)
    return block, x, gm, example, report.blocks[0].routing, eager


def _model(family, dtype, **overrides):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(make_config(family, **overrides))
    return init_moe_weights_(model).to(dtype).eval()


@pytest.mark.parametrize("family,dtype", [("mixtral", torch.bfloat16), ("qwen3_moe", torch.float32),
                                          ("gpt_oss", torch.float32)])
def test_model_with_router_logits_for_aux_loss(family, dtype):
    """output_router_logits=True: the logits stay in the graph and feed the op (router_is_logits=True)."""
    model = _model(family, dtype, output_router_logits=True)
    ids = torch.randint(0, 128, (2, 7))
    (graph,), eager = capture(model, ids, use_cache=False)
    gm, example = graph
    report = fuse_moe(gm, example)
    assert len(report.fused) == 2 and not report.rejected, str(report)
    assert [b.name for b in report.blocks] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all(b.routing.router_is_logits for b in report.blocks)
    aux_loss, logits = run(gm, example)[:2]
    torch.testing.assert_close(logits, eager.logits, **TOL[dtype])
    torch.testing.assert_close(aux_loss, eager.aux_loss, **TOL[dtype])


@pytest.mark.parametrize("family", ["qwen2_moe", "granitemoe"])
def test_model_dynamic_tokens_stay_symbolic(family):
    model = _model(family, torch.float32)
    ids = torch.randint(0, 128, (2, 7))
    (graph,), eager = capture(model, ids, use_cache=False, dynamic=True)
    gm, example = graph
    report = fuse_moe(gm, example)
    assert len(report.fused) == 2, str(report)
    ops = [n for n in gm.graph.nodes if n.target is torch.ops.mok.fused_moe.default]
    assert all(isinstance(n.meta["val"][0].shape[0], torch.SymInt) for n in ops)
    torch.testing.assert_close(run(gm, example)[0], eager.logits, **TOL[torch.float32])
    # The same graph runs at another sequence length.
    other = torch.randint(0, 128, (3, 4))
    with torch.no_grad():
        want = model(other, use_cache=False).logits
        got = gm(*[other if e is example[0] else e for e in _with_sizes(example, ids, other)])[0]
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_runtime_routed_scale_fused_as_a_node():
    """Under dynamic=True Dynamo traces DeepSeek-V3's float `routed_scaling_factor` as a graph input (a SymFloat read
    with `.item()`): fused, the op reading that node as its `routed_scale` (the report holds the traced value), its
    token count symbolic, the graph's output as eager's."""
    block = make_block("deepseek_v3")
    (graph,), eager = capture(block, torch.randn(2, 5, 64), dynamic=True)
    gm, example = graph
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True] and report.blocks[0].routing.routed_scale == 2.5, str(report)
    (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.mok.fused_moe.default]
    assert isinstance(op.kwargs["routed_scale"], torch.fx.Node)
    assert isinstance(op.meta["val"][0].shape[0], torch.SymInt)
    torch.testing.assert_close(_output(run(gm, example)), _output(eager), **TOL[torch.float32])


class _TwoScales(torch.nn.Module):
    """A near miss of the above: the weights scaled by a float attribute and then by a constant."""

    def __init__(self, block):
        super().__init__()
        self.block, self.factor = block, 1.5

    def forward(self, x):
        gate = self.block.gate
        _, w, ids = gate(x.view(-1, x.shape[-1]))
        w = (w / gate.routed_scaling_factor) * self.factor * 2.0  # a runtime float, then a constant
        return self.block.experts(x.view(-1, x.shape[-1]), ids, w)


def test_runtime_scale_with_another_scale_not_fused():
    block = make_block("deepseek_v3")
    (graph,), eager = capture(_TwoScales(block), torch.randn(2, 5, 64), dynamic=True)
    gm, example = graph
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [False] and count_fused(gm) == 0, str(report)
    assert "specialize_float = True" in report.blocks[0].reason, report.blocks[0].reason
    torch.testing.assert_close(_output(run(gm, example)), _output(eager), atol=0, rtol=0)


def _with_sizes(example, old, new):
    """Example inputs with the traced sizes of `old` replaced by those of `new` (SymInt placeholders)."""
    from mok_compile.passes.validate import concrete

    sizes = {concrete(s): n for s, n in zip(old.shape, new.shape)}
    out = []
    for e in example:
        if isinstance(e, torch.Tensor):
            out.append(new if e is old else e)
        else:
            out.append(sizes.get(concrete(e), concrete(e)))
    return out


def test_deepseek_v3_model_keeps_shared_experts_outside():
    model = _model("deepseek_v3", torch.bfloat16, num_key_value_heads=4, _attn_implementation="eager")
    ids = torch.randint(0, 128, (2, 7))
    (graph,), eager = capture(model, ids, use_cache=False)
    gm, example = graph
    report = fuse_moe(gm, example)
    assert len(report.fused) == 2, str(report)
    assert all(b.routing.routing == "sigmoid_grouped_topk" and b.routing.n_group == 2 for b in report.blocks)
    # Shared experts: three linears per layer still in the graph, outside the op.
    shared = [n for n in gm.graph.nodes if "shared_experts" in n.name and n.op == "placeholder"]
    assert len(shared) == 6 and all(n.users for n in shared)
    torch.testing.assert_close(run(gm, example)[0], eager.logits, **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_afmoe_block_fused_with_its_shared_experts_outside(dtype):
    """AfmoeSparseMoeBlock routes first, then runs its shared experts, and adds their output to the routed one after a
    `.view(B, S, H)` of each: the routed part is one op (sigmoid scores, selection bias, renormalised and scaled),
    the shared experts stay in the graph."""
    import transformers as tf
    from transformers.models.afmoe.modeling_afmoe import AfmoeSparseMoeBlock

    config = tf.AfmoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                            num_shared_experts=1, route_scale=2.5)
    _, _, gm, example, routing, eager = _fused_block(AfmoeSparseMoeBlock, config, dtype)
    assert (routing.routing, routing.renormalize, routing.routed_scale) == ("sigmoid_grouped_topk", True, 2.5)
    shared = [n for n in gm.graph.nodes if "shared_experts" in n.name and n.op == "placeholder"]
    assert len(shared) == 3 and all(n.users for n in shared)
    torch.testing.assert_close(_output(run(gm, example)), eager, **TOL[dtype])


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_deepseek_v2_block_fused(dtype, method):
    """DeepseekV2Moe: fp32 softmax, top-k, scaled (greedy); group_limited_greedy first keeps the best topk_group of
    n_group groups by their largest probability and fills the others with 0 (never chosen over a probability)."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
    import transformers as tf

    grouped = method == "group_limited_greedy"
    config = tf.DeepseekV2Config(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                                 n_shared_experts=1, topk_method=method, n_group=4 if grouped else 1,
                                 topk_group=1, routed_scaling_factor=2.5, num_attention_heads=4,
                                 kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                 v_head_dim=16)
    block, x, gm, example, routing, eager = _fused_block(DeepseekV2Moe, config, dtype)
    assert (routing.routing, routing.routed_scale, routing.n_group, routing.group_top) == (
        "softmax_topk", 2.5, 4 if grouped else 1, 1 if grouped else 2)
    torch.testing.assert_close(_output(run(gm, example)), eager, **TOL[dtype])
    if grouped:  # the groups changed some token's choice
        with torch.no_grad():
            probs = block.gate(x.view(-1, 64))[0].float().softmax(-1)
            assert not torch.equal(block.gate(x.view(-1, 64))[2].sort(-1)[0], probs.topk(2)[1].sort(-1)[0])


@pytest.mark.parametrize("n_group", [1, 4], ids=["ungrouped", "grouped"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_mistral4_block_fused(dtype, n_group):
    """Mistral4MoE (transformers >= 5.25): softmax in the router's dtype, the best topk_group of n_group groups by
    the sum of their top 2 (the others filled with 0), the probabilities gathered at the top-k's ids, renormalised
    (+1e-20) and scaled; a shared expert outside the op."""
    modeling = pytest.importorskip("transformers.models.mistral4.modeling_mistral4")
    import transformers as tf

    config = tf.Mistral4Config(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                               n_shared_experts=1, n_group=n_group, topk_group=2 if n_group > 1 else 1,
                               routed_scaling_factor=2.5, num_attention_heads=4, kv_lora_rank=16, q_lora_rank=None,
                               qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    block, x, gm, example, routing, eager = _fused_block(modeling.Mistral4MoE, config, dtype)
    assert (routing.routing, routing.n_group, routing.group_top, routing.renorm_eps, routing.routed_scale) == (
        "softmax_topk", n_group, 2, 1e-20, 2.5)
    assert routing.softmax_fp32 == (dtype == torch.float32) and routing.weights_fp32 == (dtype == torch.float32)
    torch.testing.assert_close(_output(run(gm, example)), eager, **TOL[dtype])
    if n_group > 1:  # the groups changed some token's choice
        with torch.no_grad():
            logits, _, ids = block.gate(x.view(-1, 64))
            assert not torch.equal(ids.sort(-1)[0], logits.softmax(-1).topk(2)[1].sort(-1)[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_axk2_block_fused_keeping_its_selection(dtype):
    """AXK2MoE (transformers >= 5.25): DeepSeek-V3's group-limited selection under a selection bias, but the groups
    it drops filled with 0. With the bias making kept choice values negative, dropped experts (tied at 0) outrank
    kept ones, and which of the tied ones torch.topk picks it alone decides: the selection stays in the graph, and
    the op takes its ids (`expert_ids`) and the logits, and weights them as AXK2 does (sigmoid scores gathered at
    the ids, renormalised (+1e-20), scaled)."""
    if not available(["axk2"]):
        pytest.skip("AXK2 is in transformers from 5.25 on")
    block = make_block("axk2", dtype=dtype)  # the router in fp32, as HF keeps it
    torch.manual_seed(0)
    with torch.no_grad():
        block.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.1 - 0.6)
    x = torch.randn(2, 5, 64, dtype=dtype)
    (graph,), eager = capture(block, x)
    gm, example = graph
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True] and report.blocks[0].kept_selection, str(report)
    routing = report.blocks[0].routing
    assert (routing.routing, routing.n_group, routing.router_is_logits, routing.renorm_eps, routing.routed_scale) == (
        "sigmoid_grouped_topk", 1, True, 1e-20, 2.5)
    got = _output(run(gm, example))
    if dtype == torch.bfloat16:
        assert torch.equal(got, eager)
    torch.testing.assert_close(got, eager, **TOL[dtype])
    with torch.no_grad():  # the 0 fill changed some token's choice against a fill with -inf, the op's own
        logits, _, ids = block.gate(x.view(-1, 64))
        choice = logits.sigmoid() + block.gate.e_score_correction_bias
        own = reference._grouped_choice(choice, n_group=4, topk_group=2, group_top=2).topk(2, dim=-1)[1]
        assert not torch.equal(ids.sort(-1)[0], own.sort(-1)[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_deepseek_v4_block_fused(dtype):
    """DeepseekV4SparseMoeBlock (transformers >= 5.25) past its hash-routed layers: sqrt(softplus) scores in the
    router's dtype, an fp32 selection bias, the unbiased scores gathered at the top-k's ids, renormalised (+1e-20) and
    scaled by 1.5; the SwiGLU clamped at 10 (gate from above, up on both sides); a shared expert outside the op."""
    pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

    block = make_block("deepseek_v4", dtype=dtype)
    assert block.gate.e_score_correction_bias.dtype == torch.float32  # as HF loads it in a bf16 model
    x = torch.randn(2, 5, 64, dtype=dtype)
    (graph,), eager = capture(block, x)
    gm, example = graph
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    _, _, routing, experts = routed_parts("deepseek_v4", block)
    r, e = report.blocks[0].routing, report.blocks[0].experts
    assert (r.routing, r.renormalize, r.renorm_eps, r.routed_scale) == ("sqrtsoftplus_topk", True, 1e-20, 1.5)
    assert (e.activation, e.limit) == ("clamped_swiglu", 10.0) and e == experts
    if dtype == torch.bfloat16:
        assert r == routing
    assert sum(1 for n in gm.graph.nodes if "shared_experts" in n.name and n.op == "placeholder" and n.users) == 3
    torch.testing.assert_close(_output(run(gm, example)), eager, **TOL[dtype])


def _hash_block(impl, dtype=torch.float32, seed=0):
    """A hash-routed DeepSeek-V4 block (transformers >= 5.25) whose token-id table names some expert twice in a row."""
    modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    config = make_config("deepseek_v4", num_layers=3, mlp_layer_types=["hash_moe", "moe", "moe"])
    config._experts_implementation = impl
    block = init_moe_weights_(modeling.DeepseekV4SparseMoeBlock(config, layer_idx=0)).to(dtype).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        block.gate.tid2eid.copy_(torch.randint(0, 8, (128, 2), generator=g))
        block.gate.tid2eid[:8] = 3  # tokens 0-7 go to expert 3 twice
    ids = torch.randint(0, 128, (2, 5), generator=g)
    ids[0, 0] = 5
    return block, ids


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_deepseek_v4_hash_routed_block_fused(impl, dtype):
    """A hash-routed DeepSeek-V4 block (its ids looked up by token id, no top-k), in either experts form: fused with
    the looked-up ids as the op's `expert_ids`; the lookup stays in the graph, the scores gathered at the ids weight
    them (sqrt-softplus, renormalised, scaled by 1.5). A token whose table row names one expert twice runs it twice,
    as HF does."""
    block, ids = _hash_block(impl, dtype)
    x = torch.randn(2, 5, 64, dtype=dtype)
    (graph,), eager = capture(block, x, ids)
    gm, example = graph
    report = fuse_moe(gm, example)
    assert [(b.fused, b.name) for b in report.blocks] == [(True, "<compiled module>")], str(report)
    assert count_fused(gm) == 1
    (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.mok.fused_moe.default]
    looked_up = op.kwargs["expert_ids"]
    assert op_name(looked_up) == "long" and op_name(looked_up.args[0]) == "getitem"
    r = report.blocks[0].routing
    assert (r.routing, r.renormalize, r.renorm_eps, r.routed_scale, r.top_k) == ("sqrtsoftplus_topk", True, 1e-20,
                                                                                 1.5, 2)
    assert report.blocks[0].given_ids and "sqrtsoftplus_topk(renorm, scale=1.5, ids_given)" in describe_block(
        report.blocks[0])
    torch.testing.assert_close(_output(run(gm, example)), eager, **TOL[dtype])


def test_deepseek_v4_hash_routed_block_dynamic_tokens():
    """The hash block traced with a symbolic token count: fused, the op's output and its ids' rows symbolic, and the
    graph runs at another token count with other ids. (Floats specialised: under dynamic=True Dynamo would otherwise
    trace the clamp limit as an input, which the op needs as a constant; such blocks are reported saying so.)"""
    block, ids = _hash_block("grouped_mm")
    x = torch.randn(2, 5, 64)
    with torch._dynamo.config.patch(specialize_float=True):
        (graph,), eager = capture(block, x, ids, dynamic=True)
    gm, example = graph
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.mok.fused_moe.default]
    assert isinstance(op.meta["val"][0].shape[0], torch.SymInt)
    assert isinstance(tensor_meta(op.kwargs["expert_ids"]).shape[0], torch.SymInt)
    torch.testing.assert_close(_output(run(gm, example)), eager, **TOL[torch.float32])
    x2, ids2 = torch.randn(3, 4, 64), torch.randint(0, 128, (3, 4))
    with torch.no_grad():
        want = block(x2, ids2)
    assert sum(e is x for e in example) == 1 and sum(e is ids for e in example) == 1
    args = [x2 if e is x else ids2 if e is ids else e for e in _with_sizes(example, x, x2)]
    torch.testing.assert_close(_output(gm(*args)), want, **TOL[torch.float32])


def test_deepseek_v4_hash_routed_block_needs_the_gather_at_its_ids():
    """Near miss: a hash-routed block whose weights are the scores gathered at other ids (the table's ids reversed)
    is not the op's given-ids routing: reported, the graph left as it was."""
    block, ids = _hash_block("grouped_mm")

    def reversed_gather(self, hidden_states, input_ids):  # DeepseekV4HashRouter.forward but for the flip
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        indices = self.tid2eid[input_ids.reshape(-1)].long()
        w = self.score_fn(logits).gather(1, indices.flip(-1))
        return logits, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.routed_scaling_factor, indices

    block.gate.forward = reversed_gather.__get__(block.gate)
    x = torch.randn(2, 5, 64)
    (graph,), eager = capture(block, x, ids)
    gm, example = graph
    report = fuse_moe(gm, example)
    assert [(b.fused, b.form) for b in report.blocks] == [(False, "hash_routing")], str(report)
    assert "looked up in a table by token id" in report.blocks[0].reason
    assert count_fused(gm) == 0
    assert torch.equal(_output(run(gm, example)), eager)


def test_deepseek_v4_hash_routed_layers_fused():
    """A DeepSeek-V4 model whose first layer routes by a token-id table (hash routing) and the next two by a top-k:
    all three fused in one graph, the hash layer with the looked-up ids."""
    pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    from transformers import AutoModelForCausalLM

    config = make_config("deepseek_v4", num_layers=3, mlp_layer_types=["hash_moe", "moe", "moe"])
    config._experts_implementation = "grouped_mm"
    model = init_moe_weights_(AutoModelForCausalLM.from_config(config)).eval()
    with torch.no_grad():
        model.model.layers[0].mlp.gate.tid2eid.copy_(torch.randint(0, 8, (128, 2)))
    ids = torch.randint(0, 128, (2, 7))
    (graph,), eager = capture(model, ids, use_cache=False)
    gm, example = graph
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True, True, True] and count_fused(gm) == 3, str(report)
    assert report.blocks[0].name == "model.layers.0.mlp"
    given = [n for n in gm.graph.nodes if n.target is torch.ops.mok.fused_moe.default and "expert_ids" in n.kwargs]
    assert len(given) == 1
    torch.testing.assert_close(run(gm, example)[0], eager.logits, **TOL[torch.float32])


def test_deepseek_v4_sparse_attention_top_k_is_not_a_block():
    """DeepSeek-V4's compressed-sparse-attention layers take a top-k of compressed keys (the indexer) before each MoE
    layer: both MoE layers fused, the indexer's top-k neither fused nor reported."""
    pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    from transformers import AutoModelForCausalLM

    config = make_config("deepseek_v4", num_layers=2, index_topk=4, sliding_window=8,
                         layer_types=["compressed_sparse_attention"] * 2)
    config._experts_implementation = "grouped_mm"
    model = init_moe_weights_(AutoModelForCausalLM.from_config(config)).eval()
    ids = torch.randint(0, 128, (1, 96), generator=torch.Generator().manual_seed(0))
    (graph,), eager = capture(model, ids, use_cache=False)
    gm, example = graph
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True, True] and count_fused(gm) == 2, str(report)
    indexer_topks = [n for n in gm.graph.nodes if "topk" in str(n.target) and "indexer" in (module_path(n) or "")]
    assert len(indexer_topks) == 2
    torch.testing.assert_close(run(gm, example)[0], eager.logits, **TOL[torch.float32])


@pytest.mark.parametrize("expert_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_lfm2_moe_block_fused(dtype, expert_bias):
    """Lfm2MoeSparseMoeBlock: the sigmoid of the logits in the model's dtype (not fp32), an fp32 selection bias,
    the gathered scores cast to the logits' dtype (a no-op) before the renormalisation (+1e-6); without the bias,
    the top-k values are the weights."""
    modeling = pytest.importorskip("transformers.models.lfm2_moe.modeling_lfm2_moe")
    import transformers as tf

    config = tf.Lfm2MoeConfig(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_experts=8,
                              num_experts_per_tok=2, use_expert_bias=expert_bias, routed_scaling_factor=1.5)
    _, x, gm, example, r, eager = _fused_block(modeling.Lfm2MoeSparseMoeBlock, config, dtype)
    assert (r.routing, r.softmax_fp32, r.renormalize, r.renorm_eps, r.routed_scale) == (
        "sigmoid_grouped_topk", dtype == torch.float32, True, 1e-6, 1.5)
    torch.testing.assert_close(_output(run(gm, example)), eager, **TOL[dtype])


# Blocks of transformers 5.25 model types checked by the survey of NOTES v55, each from its default config cut to
# hidden 64, 8 experts, top-2: (model type, modeling module, block class, what the pass should read off the graph
# (routing, renormalize), the block's other constructor arguments).
MORE_TYPES = [
    ("dots1", "dots1", "Dots1MoE", ("sigmoid_grouped_topk", False), {}),
    ("step3p7", "step3p7", "Step3p7SparseMoeBlock", ("sigmoid_grouped_topk", True), {"layer_idx": 0}),
    ("kimi_linear", "kimi_linear", "KimiLinearMoE", ("sigmoid_grouped_topk", True), {}),
    ("bailing_hybrid", "bailing_hybrid", "BailingHybridMoE", ("sigmoid_grouped_topk", True), {"layer_idx": 0}),
    ("glm_moe_dsa", "glm_moe_dsa", "GlmMoeDsaMoE", ("sigmoid_grouped_topk", True), {}),
    ("minimax_m3_vl", "minimax_m3_vl", "MiniMaxM3VLSparseMoeBlock", ("sigmoid_grouped_topk", True), {}),
    ("granitemoehybrid", "granitemoehybrid", "GraniteMoeHybridMoE", ("topk_softmax", False), {}),
    ("qwen4_exp", "qwen4_exp", "Qwen4ExpTextSparseMoeBlock", ("softmax_topk", True), {}),
    ("qwen3_omni_moe", "qwen3_omni_moe", "Qwen3OmniMoeThinkerTextSparseMoeBlock", ("softmax_topk", True), {}),
    ("ernie4_5_vl_moe", "ernie4_5_vl_moe", "Ernie4_5_VLMoeMoeBlock", ("softmax_topk", True), {}),  # text tokens
    ("dots3_note", "dots3_note", "Dots3NoteTextMoE", ("sigmoid_grouped_topk", True), {}),  # its text model's
]
_CUT = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            n_routed_experts=8, num_experts=8, num_local_experts=8, moe_num_experts=8, num_experts_per_tok=2,
            moe_k=2, n_group=1, topk_group=1, n_shared_experts=1, num_shared_experts=1)


def _text_config(model_type):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    while getattr(config, "thinker_config", None) is not None or getattr(config, "text_config", None) is not None:
        config = getattr(config, "thinker_config", None) or config.text_config
    for name, value in _CUT.items():
        if getattr(config, name, "absent") != "absent" and not isinstance(getattr(config, name), (bool, float)):
            setattr(config, name, [value, value // 2] if isinstance(getattr(config, name), list) else value)
    return config


@pytest.mark.parametrize("model_type,module,block,want,kwargs", MORE_TYPES, ids=[t[0] for t in MORE_TYPES])
def test_more_hf_types_block_fused(model_type, module, block, want, kwargs):
    """One block of each: fused, its routing read off the graph, the output equal to the block's own."""
    modeling = pytest.importorskip(f"transformers.models.{module}.modeling_{module}")
    # transformers' `use_experts_implementation` wraps the experts' forward (its dispatch to grouped_mm)
    if not any(name.endswith("Experts") and hasattr(getattr(cls, "forward", None), "__wrapped__")
               for name, cls in vars(modeling).items()):
        pytest.skip(f"{model_type}'s experts take no experts implementation (grouped_mm) in this transformers")
    block_cls = functools.partial(getattr(modeling, block), **kwargs)
    _, x, gm, example, routing, eager = _fused_block(block_cls, _text_config(model_type), torch.float32)
    assert (routing.routing, routing.renormalize) == want
    torch.testing.assert_close(_output(run(gm, example)), _output(eager), **TOL[torch.float32])


def test_dots3_note_vision_block_fused():
    """dots3_note's vision tower's MoE (its per-layer config cut to 8 experts; an fp32 sigmoid router, a selection
    bias, renormalised and scaled): fused, its output equal to the block's own."""
    modeling = pytest.importorskip("transformers.models.dots3_note.modeling_dots3_note")
    from transformers import AutoConfig

    config = AutoConfig.for_model("dots3_note").vision_config
    for name, value in dict(hidden_size=64, num_local_experts=8, moe_intermediate_size=32).items():
        setattr(config, name, value)
    _, x, gm, example, routing, eager = _fused_block(functools.partial(modeling.Dots3NoteVisionMoE, layer_idx=0),
                                                     config, torch.float32)
    assert (routing.routing, routing.renormalize, routing.router_fp32) == ("sigmoid_grouped_topk", True, False)
    torch.testing.assert_close(_output(run(gm, example)), _output(eager), **TOL[torch.float32])


def _longcat_block(zero_experts, dtype=torch.float32):
    if not available(["longcat_flash"]):
        pytest.skip("LongCat-Flash's experts take transformers' experts implementations from 5.25 on")
    modeling = pytest.importorskip("transformers.models.longcat_flash.modeling_longcat_flash")
    config = modeling.LongcatFlashConfig(hidden_size=64, expert_ffn_hidden_size=32, n_routed_experts=8,
                                         zero_expert_num=zero_experts, num_experts_per_tok=2, routed_scaling_factor=2.0)
    return modeling.LongcatFlashMoE, config


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_longcat_flash_block_without_zero_experts_fused(dtype):
    """LongcatFlashMoE without zero-computation experts: an fp32 softmax router whose scores are viewed to their own
    shape before the selection bias is added, scaled weights."""
    block_cls, config = _longcat_block(0)
    _, x, gm, example, routing, eager = _fused_block(block_cls, config, dtype)
    assert (routing.routing, routing.router_fp32, routing.routed_scale) == ("softmax_topk", dtype != torch.float32,
                                                                             2.0)
    torch.testing.assert_close(_output(run(gm, example)), eager, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_longcat_flash_zero_computation_experts_fused(dtype):
    """LongCat-Flash's zero-computation experts (router outputs past the experts' count; a token sent to one passes
    through, weighted, added to the experts' output): the op's identity_experts. One block fused, its output
    bitwise eager's (the op rounds the experts' sum and the identity term as LongCat does), the report says so."""
    block_cls, config = _longcat_block(4)
    config._experts_implementation = "grouped_mm"
    block = init_moe_weights_(block_cls(config)).to(dtype).eval()
    (graph,), eager = capture(block, torch.randn(2, 5, 64, dtype=dtype))
    gm, example = graph
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True], str(report)
    routing = report.blocks[0].routing
    assert (routing.identity_experts, routing.router_fp32, routing.routed_scale) == (4, dtype != torch.float32, 2.0)
    assert "E=8" in describe_block(report.blocks[0]) and "identity_experts=4" in describe_block(report.blocks[0])
    assert torch.equal(_output(run(gm, example)), eager)
    (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.mok.fused_moe.default]
    assert op.kwargs["identity_experts"] == 4 and tensor_meta(op.args[4]).shape[0] == 8


def test_longcat_flash_identity_experts_need_the_probe():
    """validate=False (structure only) does not take router outputs past the experts as identity experts: the
    structure does not show which ids they are or what they add; the block is left as it is, with that reason."""
    block_cls, config = _longcat_block(4)
    config._experts_implementation = "grouped_mm"
    block = init_moe_weights_(block_cls(config)).eval()
    (graph,), eager = capture(block, torch.randn(2, 5, 64))
    gm, example = graph
    report = fuse_moe(gm, example, validate=False)
    assert [b.fused for b in report.blocks] == [False] and "only the probe proves" in report.blocks[0].reason
    torch.testing.assert_close(_output(run(gm, example)), eager, atol=0, rtol=0)


def _longcat_variant(identity_term):
    """LongcatFlashMoE whose zero-computation experts' pairs are zeroed for the experts as HF does it, and whose
    identity term is `identity_term(x, weights, mask)` (None: nothing added; MoE++'s zero experts, which output 0)."""
    modeling = pytest.importorskip("transformers.models.longcat_flash.modeling_longcat_flash")

    class Variant(modeling.LongcatFlashMoE):
        def forward(self, hidden_states):
            shape = hidden_states.shape
            hidden_states = hidden_states.reshape(-1, shape[-1])
            _, weights, ids = self.router(hidden_states)
            mask = ids >= self.num_routed_experts
            term = identity_term(hidden_states, weights, mask)
            ids = torch.where(mask, (ids - self.num_routed_experts) * self.num_routed_experts // self.zero_expert_num,
                              ids)
            out = self.experts(hidden_states, ids, weights.masked_fill(mask, 0.0))
            if term is not None:
                out = out + term.to(out.dtype)
            return out.reshape(shape)

    return Variant


_DISPROVED = ("taken as 4 identity experts (LongCat-Flash's zero-computation experts), then as 4 zero experts "
              "(Zaya's skip expert), the probe disproves both")


@pytest.mark.parametrize("term, reason", [
    (lambda x, w, mask: x * w.sum(dim=-1, keepdim=True), _DISPROVED),  # every weight summed, not the identity pairs'
    (lambda x, w, mask: x * (2 * w.masked_fill(~mask, 0.0).sum(dim=-1, keepdim=True)),  # twice the token
     "routing weights are not multiplied with the expert output"),
], ids=["all_weights", "twice"])
def test_longcat_flash_near_miss_identity_terms_not_fused(term, reason):
    """Near misses of LongCat-Flash's zero-computation experts: the router has more outputs than there are experts,
    but what a pair sent past the experts adds is not the token times its weight. Left as they are, with the
    reason."""
    _, config = _longcat_block(4)
    config._experts_implementation = "grouped_mm"
    block = init_moe_weights_(_longcat_variant(term)(config)).eval()
    (graph,), eager = capture(block, torch.randn(2, 5, 64))
    gm, example = graph
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [False] and count_fused(gm) == 0, str(report)
    assert reason in report.blocks[0].reason, report.blocks[0].reason
    torch.testing.assert_close(_output(run(gm, example)), eager, atol=0, rtol=0)


def test_longcat_flash_variant_with_hf_identity_term_fused():
    """The near misses' module with LongCat-Flash's own identity term: fused (the near misses fail on their term)."""
    block_cls = _longcat_variant(lambda x, w, mask: x * w.masked_fill(~mask, 0.0).sum(dim=-1, keepdim=True))
    _, config = _longcat_block(4)
    block, x, gm, example, routing, eager = _fused_block(block_cls, config, torch.float32)
    assert (routing.identity_experts, routing.zero_experts) == (4, 0)
    torch.testing.assert_close(_output(run(gm, example)), eager, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_longcat_flash_variant_with_zero_experts_fused(dtype):
    """The near misses' module adding nothing for the pairs past the experts (MoE++'s zero experts): the probe
    disproves identity experts and proves zero experts; fused with `zero_experts=4`, the output eager's."""
    _, config = _longcat_block(4)
    block, x, gm, example, routing, eager = _fused_block(_longcat_variant(lambda x, w, mask: None), config, dtype)
    assert (routing.identity_experts, routing.zero_experts) == (0, 4)
    torch.testing.assert_close(_output(run(gm, example)), eager, **TOL[dtype])


def _phimoe_block(dtype=torch.float32, impl="grouped_mm", sparsemixer=None, train=False, dynamic=False):
    """PhiMoE's block (routed by its sparsemixer, weights std 0.2 so that logits spread), captured on a [2, 5, 64]
    input: (gm, example_inputs, eager output). `sparsemixer`: a function replacing HF's (near misses); `train`: the
    block in training mode (its sparsemixer samples); `dynamic`: captured with dynamic=True."""
    modeling = pytest.importorskip("transformers.models.phimoe.modeling_phimoe")
    block = make_block("phimoe", dtype=dtype, experts_implementation=impl)
    init_moe_weights_(block, std=0.2)
    block.train(train)
    with pytest.MonkeyPatch.context() as patch:
        if sparsemixer is not None:
            patch.setattr(modeling, "sparsemixer", sparsemixer)
        torch.manual_seed(0)
        (graph,), eager = capture(block, torch.randn(2, 5, 64, dtype=dtype), dynamic=dynamic)
    return (*graph, eager)


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_phimoe_sparsemixer_fused(dtype, impl):
    """PhiMoE at inference: its sparsemixer's two rounds (the largest logit left, a softmax over the logits within
    2 * jitter_eps of it, relatively) read as the op's routing="sparsemixer", its threshold as jitter_eps; the output
    bitwise eager's (the C++ kernel runs the sparsemixer op for op), but with fp32 batched_mm, whose sums HF orders
    otherwise."""
    gm, example, eager = _phimoe_block(dtype, impl)
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    assert report.blocks[0].routing == dataclasses.replace(
        routed_parts("phimoe", make_block("phimoe"))[2], softmax_fp32=dtype == torch.float32,
        weights_fp32=dtype == torch.float32)
    assert "sparsemixer(jitter_eps=0.1)" in describe_block(report.blocks[0])
    if dtype == torch.bfloat16 or impl == "grouped_mm":
        assert torch.equal(_output(run(gm, example)), eager)
    torch.testing.assert_close(_output(run(gm, example)), eager, **TOL[dtype])


def test_phimoe_sparsemixer_written_again_fused():
    """The near misses' own sparsemixer, unchanged: fused (they fail on what they change)."""
    gm, example, eager = _phimoe_block(sparsemixer=sparsemixer())
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True], str(report)
    torch.testing.assert_close(_output(run(gm, example)), eager, **TOL[torch.float32])


@pytest.mark.parametrize("change, reason", [
    (dict(compare=torch.ge), "a sparsemixer mask is not (top - scores) / scores.abs().clamp(min=top) > threshold"),
    (dict(factor="abs"), "a sparsemixer mask is not"),
    (dict(second="scores"), "does not run on the scores without the earlier picks"),
    (dict(order=(1, 0)), "not its rounds' weights concatenated in the order of its picks"),
], ids=["ge", "no_clamp", "same_expert_twice", "weights_swapped"])
def test_phimoe_near_miss_sparsemixers_not_fused(change, reason):
    """Near misses of the sparsemixer, each left as it is with its reason."""
    gm, example, eager = _phimoe_block(sparsemixer=sparsemixer(**change))
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [False] and count_fused(gm) == 0, str(report)
    assert reason in report.blocks[0].reason, report.blocks[0].reason
    torch.testing.assert_close(_output(run(gm, example)), eager, atol=0, rtol=0)


def test_phimoe_runtime_threshold_fused_as_a_node():
    """Under dynamic=True Dynamo traces PhiMoE's float `router_jitter_noise` as a graph input (a SymFloat read with
    `.item()`, doubled for the threshold): fused, the op reading that node as its `jitter_eps` (the report holds the
    traced value); a threshold that is 3 times it is not the op's, and is left unfused with the fix."""
    gm, example, eager = _phimoe_block(dynamic=True)
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True] and report.blocks[0].routing.jitter_eps == 0.1, str(report)
    (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.mok.fused_moe.default]
    assert isinstance(op.kwargs["jitter_eps"], torch.fx.Node)
    torch.testing.assert_close(_output(run(gm, example)), eager, **TOL[torch.float32])

    gm, example, eager = _phimoe_block(sparsemixer=sparsemixer(times=3), dynamic=True)
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [False] and count_fused(gm) == 0, str(report)
    assert "specialize_float = True" in report.blocks[0].reason, report.blocks[0].reason


def test_phimoe_training_form_not_fused():
    """In training mode PhiMoE's sparsemixer samples its picks (a Gumbel max of random noise): found, left as it is,
    and the reason says so."""
    gm, example, _ = _phimoe_block(train=True)
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [False] and count_fused(gm) == 0, str(report)
    assert "training form samples its picks at random" in report.blocks[0].reason, report.blocks[0].reason


def _inkling2_block(dtype, activation=None):
    """Inkling2's MoE block (fp32 router with sigmoid scores and a selection bias, its softcapped SwiGLU), captured
    on a [2, 5, 64] input: (gm, example_inputs, eager output). `activation`: a (gate, up) -> act function replacing
    its own (near misses)."""
    modeling = pytest.importorskip("transformers.models.inkling2.modeling_inkling2")
    config = modeling.Inkling2TextConfig(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8,
                                         num_local_experts=8, num_experts_per_tok=2)
    config._experts_implementation = "grouped_mm"
    block = init_moe_weights_(modeling.Inkling2SparseMoeBlock(config)).to(dtype).eval()
    block.gate.float()  # fp32 in HF's bf16 model too: the router computes on x.float()
    if activation is not None:
        block.experts.act_fn.forward = activation
    (graph,), eager = capture(block, torch.randn(2, 5, 64, dtype=dtype))
    return (*graph, eager)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_inkling2_softcapped_swiglu_fused(dtype):
    """Inkling2's experts: tanh(g / 4) * 4 * sigmoid(g) * tanh(u / 25) * 25 in fp32, rounded once (the op's
    softcapped_swiglu, gate cap in `alpha`, up cap in `limit`), behind an fp32 sigmoid router with a selection bias,
    renormalised (+1e-20) and scaled."""
    gm, example, eager = _inkling2_block(dtype)
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True], str(report)
    e, r = report.blocks[0].experts, report.blocks[0].routing
    assert (e.activation, e.alpha, e.limit) == ("softcapped_swiglu", 4.0, 25.0)
    assert (r.routing, r.renormalize, r.routed_scale) == ("sigmoid_grouped_topk", True, 8.0)
    torch.testing.assert_close(_output(run(gm, example)), eager, **TOL[dtype])


def _beam_block(dtype, impl, default_gate=False):
    """Beam's MoE block (DeepSeek-V3's routing; its experts' SwiGLU in fp32, rounded once), its router in fp32 as HF
    keeps it, captured on a [2, 5, 64] input: (gm, example_inputs, eager output, block). `default_gate`: transformers'
    default `_apply_gate` (op by op in the experts' dtype) in place of Beam's."""
    modeling = pytest.importorskip("transformers.models.beam.modeling_beam")
    config = modeling.BeamConfig(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                                 n_group=2, topk_group=1)
    config._experts_implementation = impl
    block = init_moe_weights_(modeling.BeamMoE(config)).to(dtype).eval()
    block.gate.float()
    if default_gate:
        from transformers.integrations import moe

        block.experts._apply_gate = moe._default_apply_gate.__get__(block.experts)
    (graph,), eager = capture(block, torch.randn(2, 5, 64, dtype=dtype))
    return (*graph, eager, block)


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("dtype,default_gate,act", [
    (torch.bfloat16, False, "silu_fp32"), (torch.bfloat16, True, "silu"), (torch.float32, False, "silu"),
], ids=["bf16", "bf16_default_gate", "fp32"])
def test_beam_swiglu_in_fp32_fused(dtype, default_gate, act, impl):
    """Beam's experts compute their SwiGLU in fp32 and round once, ``(silu(g.float()) * u.float()).to(dt)``: in bf16
    the op's silu_fp32, and with transformers' default gate (op by op) its silu; in fp32 the two are one (silu). Fused,
    output bitwise eager's in bf16 (where the two SwiGLUs differ on random rows, so each is told from the other), as
    eager's in fp32."""
    gm, example, eager, block = _beam_block(dtype, impl, default_gate)
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    assert report.blocks[0].experts.activation == act
    if dtype == torch.float32:  # (batched_mm sums in another order in fp32)
        torch.testing.assert_close(_output(run(gm, example)), eager, **TOL[dtype])
    else:
        assert torch.equal(_output(run(gm, example)), eager)

        h = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).to(dtype) * 4
        a, b = (reference.activate(h, activation=name, gated=True, interleaved=False, alpha=0.0, limit=0.0)
                for name in ("silu", "silu_fp32"))
        assert not torch.equal(a, b)


def _softcap(v, cap, mul_cap=None):
    return torch.tanh(v / cap) * (cap if mul_cap is None else mul_cap)


@pytest.mark.parametrize("activation, reason", [
    (lambda g, u: (_softcap(g.float(), 4.0, 5.0) * torch.sigmoid(g.float()) * _softcap(u.float(), 25.0)).to(g.dtype),
     "not tanh(v / c) * c"),  # the cap multiplies back by another constant
    (lambda g, u: (_softcap(g.float(), 4.0) * torch.sigmoid(u.float()) * _softcap(u.float(), 25.0)).to(g.dtype),
     "probe: outputs differ"),  # the sigmoid of up (the halves' roles swapped)
    (lambda g, u: (_softcap(g.float(), 4.0) * torch.sigmoid(u.float() * 2) * _softcap(u.float(), 25.0)).to(g.dtype),
     "not supported"),  # another op in the activation
    (lambda g, u: (_softcap(g.float(), 4.0) * torch.sigmoid(g.float()) * _softcap(g.float(), 25.0)).to(g.dtype),
     "does not cap two values"),  # up unused: the gate twice
])
def test_inkling2_near_miss_softcaps_not_fused(activation, reason):
    """Near misses of the softcapped SwiGLU, each left as it is with its reason."""
    gm, example, eager = _inkling2_block(torch.float32, activation)
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [False] and count_fused(gm) == 0, str(report)
    assert reason in report.blocks[0].reason, report.blocks[0].reason
    torch.testing.assert_close(_output(run(gm, example)), eager, atol=0, rtol=0)


def _gemma4_model(router: str = "hf"):
    """Gemma 4 cut to 2 layers. `router`: "hf" (Gemma4TextRouter), "unscaled" (one that leaves its per-expert weight
    scale out) or "rounded_scale" (one that rounds the gathered scale to bf16 before multiplying); everything else as
    Gemma4TextRouter computes it."""
    modeling = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
    from transformers import AutoModelForCausalLM

    class Router(modeling.Gemma4TextRouter):
        def forward(self, hidden_states):
            hidden_states = self.norm(hidden_states) * self.scale * self.scalar_root_size
            probs = torch.nn.functional.softmax(self.proj(hidden_states), dim=-1, dtype=torch.float32)
            weights, ids = torch.topk(probs, k=self.config.top_k_experts, dim=-1)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            if router == "rounded_scale":
                weights = weights * self.per_expert_scale[ids].to(torch.bfloat16)
            return probs, weights, ids

    config = modeling.Gemma4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, enable_moe_block=True, num_experts=8, top_k_experts=2,
        moe_intermediate_size=32, hidden_size_per_layer_input=0, layer_types=["sliding_attention", "full_attention"],
        sliding_window=32, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config)
    if router != "hf":
        for layer in model.model.layers:
            replaced = Router(config)
            replaced.load_state_dict(layer.router.state_dict())
            layer.router = replaced
    init_moe_weights_(model).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("router.scale") or name.endswith("per_expert_scale"):
                p.uniform_(0.5, 1.5)
    model.set_experts_implementation("grouped_mm")
    return model


def _fused_ops(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.mok.fused_moe.default]


def test_gemma4_moe_fused_without_its_per_expert_scale():
    """Gemma 4's layer routes on one normalisation of the residual and runs its experts on another: the logits
    are the op's router argument (router_is_logits) and the router's norm and linear stay in the graph. With the
    per-expert weight scale left out of the router, both layers fuse; logits equal eager's."""
    model = _gemma4_model("unscaled")
    (graph,), eager = capture(model, torch.randint(0, 128, (2, 7)), use_cache=False)
    gm, example = graph
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True, True] and count_fused(gm) == 2, str(report)
    assert all(b.routing.router_is_logits and b.experts.activation == "gelu_tanh" for b in report.blocks)
    assert all("expert_scale" not in n.kwargs for n in _fused_ops(gm))
    assert not any(b.expert_scale for b in report.blocks)
    torch.testing.assert_close(run(gm, example)[0], eager.logits, **TOL[torch.float32])


def test_gemma4_moe_fused_with_its_per_expert_scale():
    """Gemma 4 as it is multiplies the renormalised weights by a learned per-expert scale gathered at the ids: the
    parameter is the op's `expert_scale`. Both layers fuse; logits equal eager's."""
    model = _gemma4_model("hf")
    (graph,), eager = capture(model, torch.randint(0, 128, (2, 7)), use_cache=False)
    gm, example = graph
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True, True] and count_fused(gm) == 2, str(report)
    scales = [n.kwargs.get("expert_scale") for n in _fused_ops(gm)]
    assert all(s is not None and s.op == "placeholder" and "per_expert_scale" in s.name for s in scales), scales
    assert all(b.expert_scale and "softmax_topk(renorm, logits_kept, expert_scale)" in describe_block(b)
               for b in report.blocks), str(report)
    torch.testing.assert_close(run(gm, example)[0], eager.logits, **TOL[torch.float32])


def test_gemma4_moe_with_a_rounded_per_expert_scale_not_fused():
    """Near miss: a router that rounds the gathered scale to bf16 in the block (the op multiplies by the scale as
    it is): left as it is, with that reason."""
    model = _gemma4_model("rounded_scale")
    (graph,), eager = capture(model, torch.randint(0, 128, (2, 7)), use_cache=False)
    gm, example = graph
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [False, False] and count_fused(gm) == 0, str(report)
    assert all("per-expert scale rounded to torch.bfloat16 in the block" in b.reason for b in report.blocks)
    torch.testing.assert_close(run(gm, example)[0], eager.logits, atol=0, rtol=0)


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["renorm", "no_renorm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kolibri1_block_fused(dtype, norm_topk_prob):
    """Kolibri1SparseMoeBlock chooses on fp32 logits plus a selection bias and weighs by the sigmoid of the unbiased
    chosen logits (topk_sigmoid with a selection bias); its shared experts stay in the graph. (transformers >= 5.24.)"""
    modeling = pytest.importorskip("transformers.models.kolibri1.modeling_kolibri1")
    import transformers as tf

    config = tf.Kolibri1Config(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                               shared_expert_intermediate_size=32, norm_topk_prob=norm_topk_prob)
    _, x, gm, example, routing, eager = _fused_block(modeling.Kolibri1SparseMoeBlock, config, dtype)
    assert (routing.routing, routing.renormalize, routing.router_fp32) == ("topk_sigmoid", norm_topk_prob,
                                                                            dtype != torch.float32)
    assert sum(1 for n in gm.graph.nodes if "shared_experts" in n.name and n.op == "placeholder" and n.users) == 3
    torch.testing.assert_close(_output(run(gm, example)), eager, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_openai_privacy_filter_block_fused(dtype):
    """OpenAIPrivacyFilterMLP: an fp32 router with a bias, the softmax of the top-k logits divided by top_k,
    GPT-OSS's clamped SwiGLU on gate and up halves (not interleaved), transposed weights with biases, and the
    experts' sum multiplied by top_k after the experts: routed_scale = 1 / top_k, and that product stays in the
    graph. (transformers >= 5.24.)"""
    modeling = pytest.importorskip("transformers.models.openai_privacy_filter.modeling_openai_privacy_filter")

    config = modeling.OpenAIPrivacyFilterConfig(hidden_size=64, intermediate_size=32, num_local_experts=8,
                                                num_experts_per_tok=2, vocab_size=128, pad_token_id=0,
                                                bos_token_id=1, eos_token_id=1)
    _, x, gm, example, routing, eager = _fused_block(modeling.OpenAIPrivacyFilterMLP, config, dtype)
    assert (routing.routing, routing.routed_scale, routing.router_fp32) == ("topk_softmax", 0.5,
                                                                             dtype != torch.float32)
    assert any(n.op == "call_function" and 2 in n.args and "mul" in str(n.target) for n in gm.graph.nodes), gm.code
    out, scores = run(gm, example)
    torch.testing.assert_close(out, eager[0], **TOL[dtype])
    torch.testing.assert_close(scores, eager[1], **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flex_olmo_post_norm_model_fused(dtype):
    """FlexOlmo normalises each block's output (post-norm). In fp32 the RMSNorm's ``.to(float32)`` is a no-op and its
    ``.pow(2)`` has the output's shape and dtype: the block still ends at the experts' sum, both layers fuse."""
    import transformers as tf

    config = tf.AutoConfig.for_model("flex_olmo", hidden_size=64, intermediate_size=32, num_experts=8,
                                     num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                                     num_hidden_layers=2, vocab_size=128, pad_token_id=0)
    config._experts_implementation = "grouped_mm"
    model = init_moe_weights_(tf.AutoModelForCausalLM.from_config(config)).to(dtype).eval()
    ids = torch.randint(0, 128, (2, 7))
    (graph,), eager = capture(model, ids, use_cache=False)
    gm, example = graph
    report = fuse_moe(gm, example)
    assert len(report.fused) == 2 and not report.rejected, str(report)
    torch.testing.assert_close(run(gm, example)[0], eager.logits, **TOL[dtype])


LLAMA4_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=0, rtol=0)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_llama4_dense_weight_on_input_block_fused(impl, top_k, dtype):
    """Llama4TextMoe: dense routing (-inf scatter of the top-k logits, sigmoid, scores on the repeated input, every
    expert runs, sum over experts) is one fused op with weight_on_input; the shared expert and its in-place add of
    the routed sum stay outside. bf16: the reference reproduces HF bitwise (same products, same rounding)."""
    import transformers as tf
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    from mok_compile.ops.spec import ExpertSpec, RoutingSpec

    config = tf.Llama4TextConfig(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=top_k,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config._experts_implementation = impl
    torch.manual_seed(0)
    block = init_moe_weights_(Llama4TextMoe(config)).to(dtype).eval()
    (graph,), eager = capture(block, torch.randn(2, 5, 64, dtype=dtype))
    gm, example = graph
    report = fuse_moe(gm, example)
    assert [(b.fused, b.form) for b in report.blocks] == [(True, "dense_bmm")], str(report)
    assert counters["mok"]["fused_moe"] == 1 and counters["mok"]["rejected_moe"] == 0
    assert count_fused(gm) == 1
    b = report.blocks[0]
    assert (b.num_experts, b.top_k, b.hidden, b.intermediate) == (8, top_k, 64, 32)
    # The block returns its router logits: they stay in the graph and feed the op.
    assert b.routing == RoutingSpec(top_k=top_k, routing="topk_sigmoid", router_is_logits=True, softmax_fp32=True,
                                    weights_fp32=False, weight_on_input=True)
    assert b.experts == ExpertSpec(activation="silu", transposed=True)
    ops = ops_in(gm)
    assert not any(op in ("repeat", "scatter_") or "bmm" in op or "topk" in op for op in ops), gm.code
    assert "add_" in ops, gm.code  # shared expert output += routed sum (now the op's output)
    out = run(gm, example)
    torch.testing.assert_close(out[0], eager[0], **LLAMA4_TOL[dtype])
    assert torch.equal(out[1], eager[1])  # router logits


class _LinearThenBlock(torch.nn.Module):
    def __init__(self, impl):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(48, 64)
        self.block = make_block("mixtral", experts_implementation=impl)

    def forward(self, x):
        return self.block(self.lin(x))


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_block_input_produced_by_a_linear(impl):
    """The block's hidden states are whatever the router reads (here a Linear's output), not a graph input."""
    (graph,), eager = capture(_LinearThenBlock(impl).eval(), torch.randn(2, 5, 48))
    gm, example = graph
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True], str(report)
    op, = [n for n in gm.graph.nodes if n.target is torch.ops.mok.fused_moe.default]
    hidden = op.args[0]
    while hidden.op == "call_method" and hidden.target in ("view", "reshape"):
        hidden = hidden.args[0]
    assert "linear" in str(hidden.target), gm.code  # the front Linear stays and feeds the op
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder" and "lin" in n.name and n.users]
    torch.testing.assert_close(_output(run(gm, example)), _output(eager), **TOL[torch.float32])
