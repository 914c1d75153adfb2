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
    (mutated,) = [a.name for a in CONSUME._schema.arguments if a.alias_info and a.alias_info.is_write
                  and a.kwarg_only]
    assert mutated == "post_norm_input"  # the consuming op declares that it may write dy over it


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
