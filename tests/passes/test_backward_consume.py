"""`passes.backward_consume`: the compiled backward's `fused_moe_backward` reading a saved h becomes
`fused_moe_backward_consume(..., if_graph_freed=True)`, on real aot_autograd backward graphs (no inductor)."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

from mok_compile.ops.library import _saves_gate_up
from mok_compile.passes.backward_consume import consume_saved_gate_up
from mok_compile.passes.post_grad import MokPostGradPass
from tests.ops.moe_cases import CASES_BY_NAME, make_args

BACKWARD = torch.ops.mok.fused_moe_backward.default
CONSUME = torch.ops.mok.fused_moe_backward_consume.default
fused_moe = torch.ops.mok.fused_moe.default


def _case():
    args, kw = make_args(CASES_BY_NAME["softmax_topk_router_fp32"], T=24, dtype=torch.float32, requires_grad=True)
    if not _saves_gate_up(args, kw):
        pytest.skip("the C++ kernel is not built: the CPU autograd saves no h")
    return args, kw


def _grads(args, kw, bw_pass=None):
    """Gradients of a loss through aot_autograd, with `bw_pass(graph)` applied to the backward graph."""
    from functorch.compile import aot_function, make_boxed_func

    leaves = [a.detach().requires_grad_(a.is_floating_point()) if a is not None else None for a in args]
    graphs = []

    def fw(gm, _inputs):
        return make_boxed_func(gm.forward)

    def bw(gm, _inputs):
        graphs.append(copy.deepcopy(gm.graph))
        if bw_pass is not None:
            bw_pass(gm.graph)
            gm.recompile()
        return make_boxed_func(gm.forward)

    def loss_fn(*ts):
        out, w, _ = fused_moe(*ts, **kw)
        return out.square().sum() + w.sum()

    aot_function(loss_fn, fw_compiler=fw, bw_compiler=bw)(*leaves).backward()
    return [t.grad for t in leaves if t is not None and t.grad is not None], graphs[0]


def test_saved_h_read_once_is_consumed():
    args, kw = _case()
    want, _ = _grads(args, kw)
    rewritten = []
    before = counters["mok"]["backward_consume"]
    got, _ = _grads(args, kw, lambda g: rewritten.append(consume_saved_gate_up(g)))
    assert rewritten == [1] and counters["mok"]["backward_consume"] == before + 1
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_rewritten_node_keeps_its_meta_and_inputs():
    args, kw = _case()
    _, graph = _grads(args, kw)
    (old,) = [n for n in graph.nodes if n.target is BACKWARD]
    h, args, val = old.kwargs["gate_up_out"], old.args, old.meta["val"]
    kw_old = {k: v for k, v in old.kwargs.items() if k != "gate_up_out"}
    assert consume_saved_gate_up(graph) == 1
    (new,) = [n for n in graph.nodes if n.target is CONSUME]
    assert new.args == (*args, h) and new.kwargs == {**kw_old, "if_graph_freed": True}
    assert new.meta["val"] is val
    assert not [n for n in graph.nodes if n.target is BACKWARD]


def test_near_miss_h_read_elsewhere_is_left_alone():
    """h with a second reader in the graph must survive the backward op: no rewrite."""
    args, kw = _case()
    _, graph = _grads(args, kw)
    (node,) = [n for n in graph.nodes if n.target is BACKWARD]
    with graph.inserting_after(node):
        graph.call_function(torch.ops.aten.sum.default, (node.kwargs["gate_up_out"],))
    assert consume_saved_gate_up(graph) == 0
    assert [n for n in graph.nodes if n.target is BACKWARD] == [node]


def test_near_miss_h_computed_in_the_graph_is_left_alone():
    """h made by a node of the backward graph (not a saved input): no rewrite."""
    args, kw = _case()
    _, graph = _grads(args, kw)
    (node,) = [n for n in graph.nodes if n.target is BACKWARD]
    h = node.kwargs["gate_up_out"]
    with graph.inserting_before(node):
        copy_of_h = graph.call_function(torch.ops.aten.clone.default, (h,))
    node.update_kwarg("gate_up_out", copy_of_h)
    assert consume_saved_gate_up(graph) == 0


def _with_saved_norm_input(graph, second_reader: bool):
    """The backward node given a post norm's saved input y as a new graph input (the CUDA training forward's output;
    the pass reads the graph only), with or without another node reading y."""
    (node,) = [n for n in graph.nodes if n.target is BACKWARD]
    last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last_input):
        y = graph.placeholder("post_norm_input")
    node.update_kwarg("post_norm_input", y)
    if second_reader:
        with graph.inserting_after(node):
            graph.call_function(torch.ops.aten.sum.default, (y,))
    return node, y


def test_saved_norm_input_read_once_is_consumed_with_h():
    args, kw = _case()
    _, graph = _grads(args, kw)
    _, y = _with_saved_norm_input(graph, second_reader=False)
    assert consume_saved_gate_up(graph) == 1
    (new,) = [n for n in graph.nodes if n.target is CONSUME]
    assert new.kwargs["post_norm_input"] is y
    mutated = [a.name for a in CONSUME._schema.arguments if a.alias_info and a.alias_info.is_write and a.kwarg_only]
    # the consuming op declares that it may write dy over y (and free the spent weights)
    assert mutated == ["post_norm_input", "spent_gate_up_proj", "spent_down_proj"]


def test_near_miss_norm_input_read_elsewhere_is_left_alone():
    """y with a second reader must survive the backward op: no rewrite (h too stays only read)."""
    args, kw = _case()
    _, graph = _grads(args, kw)
    node, _ = _with_saved_norm_input(graph, second_reader=True)
    assert consume_saved_gate_up(graph) == 0
    assert [n for n in graph.nodes if n.target is BACKWARD] == [node]


def test_pass_chains_the_users_pass_and_its_cache_key():
    seen = []

    class Theirs(CustomGraphPass):
        def __call__(self, graph):
            seen.append(graph)

        def uuid(self):
            return "theirs-v1"

    graph = torch.fx.Graph()
    ours = MokPostGradPass(then=Theirs())
    ours(graph)
    assert seen == [graph] and ours.uuid()[-1] == "theirs-v1"
    assert MokPostGradPass(then=lambda g: None).uuid() is None  # no key: inductor must not cache
    assert MokPostGradPass().uuid() != MokPostGradPass(consume=False).uuid()  # inductor caches each apart


def test_the_cache_key_follows_the_ops_schemas(monkeypatch):
    """Inductor's cached code spells out every argument of a mok op call from the op's schema: code cached under
    another schema must not be found (v74's demo ran code cached under an interim schema, whose `round_weights` was
    a dtype, against the bool, and failed)."""
    from mok_compile.ops import library

    before = MokPostGradPass().uuid()
    changed = (library.SCHEMAS[0].replace("bool round_weights=False", "ScalarType? round_weights=None"),
               *library.SCHEMAS[1:])
    assert changed != library.SCHEMAS
    monkeypatch.setattr(library, "SCHEMAS", changed)
    assert MokPostGradPass().uuid() != before


def test_installed_for_graphs_that_call_the_op_directly_or_through_the_rewrite():
    """The backend installs the pass where the Dynamo graph holds mok.fused_moe: a user's own call (Dynamo
    records the packet) as well as the rewrite's (the overload); not for graphs without it."""
    from mok_compile.backend import _has_fused_moe

    args, kw = _case()
    graphs = []

    def capture(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda *ts: torch.ops.mok.fused_moe(*ts, **kw)[0].sum(), backend=capture)(*args)
    torch.compile(lambda t: t.sin().sum(), backend=capture)(args[0])
    torch._dynamo.reset()
    assert [_has_fused_moe(gm) for gm in graphs] == [True, False]
    overload = torch.fx.symbolic_trace(lambda x: x)
    overload.graph.call_function(fused_moe, ())  # the rewrite's target
    assert _has_fused_moe(overload)


def _spent_in_compiled_backward(module, x):
    """One training step of `module` through the MoE pass and aot_autograd (no inductor), its backward graph rewritten
    by `consume_saved_gate_up`: ([the spent weights of each consuming node, as {keyword: the weight's position}],
    the gradients of the parameters, eager's)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    from mok_compile.ops.library import SPENT_KWARGS
    from mok_compile.passes import fuse_moe

    from mok_compile.passes.backward_consume import _SPENT_POSITIONS

    spent = []

    def bw(gm, _inputs):
        consume_saved_gate_up(gm.graph)
        gm.recompile()
        for n in gm.graph.nodes:
            if n.target is CONSUME:  # each spent weight is the very node the op reads as that weight
                assert all(n.kwargs.get(k) in (None, n.args[_SPENT_POSITIONS[k]]) for k in SPENT_KWARGS)
                spent.append({k for k in SPENT_KWARGS if n.kwargs.get(k) is not None})
        return make_boxed_func(gm.forward)

    def backend(gm, inputs):
        assert len(fuse_moe(gm, inputs).fused) == 1
        return aot_module_simplified(gm, inputs, fw_compiler=lambda g, _: make_boxed_func(g.forward), bw_compiler=bw)

    def step(fn):
        module.zero_grad(set_to_none=True)
        out = fn(x)
        loss = sum(o.square().sum() for o in (out if isinstance(out, tuple) else (out,)))
        loss.backward()
        return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}

    want = step(module)
    torch._dynamo.reset()
    got = step(torch.compile(module, backend=backend))
    torch._dynamo.reset()
    return spent, got, want


def _spent_module(name):
    from tests.passes import models

    from mok_compile import hf_blocks

    torch.manual_seed(0)
    if name == "lora_qwen3":  # a LoRA parametrization on both expert weights of transformers' block
        block = hf_blocks.make_block("qwen3_moe", hf_blocks.BlockSizes(hidden=32, intermediate=16, experts=8, top_k=2))
        hf_blocks.add_expert_lora_(block, rank=2)
        return block.train(), torch.randn(1, 12, 32)
    if name == "peft_qwen3":  # PEFT's LoRA on both expert weights, traced with the router (`peft_experts`)
        peft = pytest.importorskip("peft")
        from mok_compile import peft_experts

        block = hf_blocks.make_block("qwen3_moe", hf_blocks.BlockSizes(hidden=32, intermediate=16, experts=8, top_k=2))
        config = peft.LoraConfig(r=2, target_modules=[], init_lora_weights=False,
                                 target_parameters=["experts.gate_up_proj", "experts.down_proj"])
        assert peft_experts.install()
        return peft.inject_adapter_in_model(config, block).train(), torch.randn(1, 12, 32)
    module = {"computed": models.ComputedWeightsMoE, "module_list": models.DenseMaskMoE,
              "parameters": models.StackedGatherMoE}[name]()
    return module.train(), torch.randn(12, 32)


@pytest.mark.parametrize("name, want", [
    ("lora_qwen3", {"spent_gate_up_proj", "spent_down_proj"}),  # W + B @ A on both
    ("peft_qwen3", {"spent_gate_up_proj", "spent_down_proj"}),  # PEFT's baddbmm(W, lhs, rhs) on both
    ("computed", {"spent_gate_up_proj", "spent_down_proj"}),  # g * v, and W + B @ A
    ("module_list", {"spent_gate_up_proj", "spent_down_proj"}),  # the experts' weights stacked for the op
    ("parameters", set()),  # near miss: the weights are the model's own
])
def test_weights_computed_for_the_op_alone_are_spent(name, want):
    """A weight the graph computes for the op alone and saves for its backward only is passed again as spent (the
    CUDA kernels free it once read); a parameter is not. Gradients as eager's (the CPU kernel reads spent weights
    and leaves them)."""
    _case()  # skips where the C++ kernel is not built: the CPU autograd then saves no h
    module, x = _spent_module(name)
    before = counters["mok"]["spent_weights"]
    spent, got, want_grads = _spent_in_compiled_backward(module, x)
    assert spent == [want]
    assert counters["mok"]["spent_weights"] == before + len(want)
    assert got.keys() == want_grads.keys()
    for n in want_grads:
        torch.testing.assert_close(got[n], want_grads[n], rtol=1e-4, atol=1e-5, msg=n)


def test_only_a_computed_weight_the_op_alone_reads_is_marked_spent():
    """`mark_spent_weights` on the op's weights: a computing node read by the op alone is marked; a graph input, a
    view or cast (which may alias a parameter), or a computed weight with a second reader (a penalty on it) is not."""
    from mok_compile.passes.backward_consume import SPENT_MARK, mark_spent_weights

    def marked(gate_up, down, second_reader=None):
        graph = torch.fx.Graph()
        x, router, w1, w2, scale = (graph.placeholder(n) for n in ("x", "router", "w1", "w2", "scale"))
        make = {"input": lambda w: w, "computed": lambda w: graph.call_function(torch.mul, (w, scale)),
                "view": lambda w: graph.call_method("transpose", (w, 1, 2)),
                "cast": lambda w: graph.call_method("to", (w, torch.float32))}
        weights = (make[gate_up](w1), make[down](w2))
        op = graph.call_function(fused_moe, (x, router, None, None, weights[0], None, weights[1], None), {"top_k": 2})
        if second_reader is not None:
            graph.call_function(torch.sum, (weights[second_reader],))
        mark_spent_weights(op)
        return [bool((w.meta.get("custom") or {}).get(SPENT_MARK)) for w in weights]

    assert marked("computed", "computed") == [True, True]
    assert marked("input", "computed") == [False, True]
    assert marked("view", "cast") == [False, False]
    assert marked("computed", "computed", second_reader=1) == [True, False]


def test_the_kernels_free_a_spent_weight_only_where_it_holds_its_memory_alone(monkeypatch):
    """The CUDA entry's run-time checks (`kernels.sole_owner`, `kernels.frees_spent_weights`), on CPU tensors: a tensor
    alone on its storage may be freed; one with a view of it alive, a view, or one sharing a parameter's storage may
    not; and nothing is freed with MOK_SPENT_WEIGHTS=0 (on by default)."""
    from mok_compile.kernels import frees_spent_weights, sole_owner

    weight = torch.randn(4, 6, 8)
    assert sole_owner(weight)
    view = weight.view(-1)
    assert not sole_owner(weight) and not sole_owner(view)
    del view
    assert sole_owner(weight) and not sole_owner(weight[1:])
    parameter = torch.nn.Parameter(torch.randn(4, 6, 8))
    assert not sole_owner(parameter.detach())
    monkeypatch.delenv("MOK_SPENT_WEIGHTS", raising=False)
    assert frees_spent_weights()
    monkeypatch.setenv("MOK_SPENT_WEIGHTS", "0")
    assert not frees_spent_weights()
