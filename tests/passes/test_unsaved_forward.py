"""`passes.unsaved_forward`: a forward graph's `fused_moe_train` of which only out, topk_weights and topk_ids are read
becomes `fused_moe` (what a checkpointed region's forward needs), with the same bits; one whose saved tensors are
read stays."""

import operator

import pytest
import torch
import torch.fx as fx
from torch._dynamo.utils import counters

from mok_compile.ops.library import _saves_gate_up
from mok_compile.passes.unsaved_forward import inference_where_unsaved
from tests.ops.moe_cases import CASES_BY_NAME, make_args

TRAIN = torch.ops.mok.fused_moe_train.default
INFERENCE = torch.ops.mok.fused_moe.default


def _graph(read):
    """A graph calling `fused_moe_train` on the case's tensors and returning its outputs at positions `read`."""
    args, kw = make_args(CASES_BY_NAME["softmax_topk_router_fp32"], T=24, dtype=torch.float32)
    if not _saves_gate_up(args, kw):
        pytest.skip("the C++ kernel is not built: the CPU autograd runs no training forward")
    graph = fx.Graph()
    inputs = [graph.placeholder(f"t{i}") for i in range(len(args))]
    node = graph.call_function(TRAIN, tuple(inputs), kw)
    node.meta["val"] = TRAIN(*args, **kw)
    graph.output(tuple(graph.call_function(operator.getitem, (node, i)) for i in read))
    return graph, args


@pytest.mark.parametrize("read", [(0,), (0, 1, 2)])
def test_a_training_forward_whose_saved_tensors_are_unread_runs_as_the_inference_op(read):
    graph, args = _graph(read)
    want = fx.GraphModule(torch.nn.Module(), graph)(*args)
    val = [n for n in graph.nodes if n.target is TRAIN][0].meta["val"]
    before = counters["mok"]["unsaved_forward"]
    assert inference_where_unsaved(graph) == 1 and counters["mok"]["unsaved_forward"] == before + 1
    (new,) = [n for n in graph.nodes if n.target is INFERENCE]
    assert not [n for n in graph.nodes if n.target is TRAIN]
    assert len(new.meta["val"]) == 3 and all(a is b for a, b in zip(new.meta["val"], val))
    got = fx.GraphModule(torch.nn.Module(), graph)(*args)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("read", [(0, 3), (0, 4), (5,)], ids=["h", "logits", "layout"])
def test_near_miss_a_training_forward_whose_saved_tensors_are_read_stays(read):
    graph, _ = _graph(read)
    assert inference_where_unsaved(graph) == 0
    assert [n.target for n in graph.nodes if n.op == "call_function"][0] is TRAIN
