"""The region search on deep graphs. Its activation-clean set (`region._ActivationClean`: what depends on activations
only through a block's roots), decided node by node by walking back from each, is the set one scan of the whole graph
in order gives, whatever order it is asked in; the search for the first matmul the ids reach stops there; and a
12-layer model fuses every block, as eager computes it. Its computed weights (`region._ComputedWeights`) are decided
without recursion, past a chain longer than Python's recursion limit.

Before v62 each block scanned the whole graph (and asked every node's op again for its dataflow), so the pass's time
grew with the square of the depth: 0.09, 1.7 and 5.2 s for 8, 48 and 96 layers of a tiny Qwen3-MoE, since 0.06, 0.7
and 0.8 s (`python -m benchmarks.compile_overhead --families qwen3_moe --layers 96 --compiler aot_eager`)."""

import functools

import pytest
import torch
from torch._dynamo.utils import counters

from mok_compile.backend import mok_backend
from mok_compile.demo import make_causal_lm
from mok_compile.passes.dataflow import Dataflow
from mok_compile.passes.op_names import MATMUL_OPS, op_name
from mok_compile.passes.region import _ActivationClean, _ComputedWeights, _is_source, block_anchors, find_region

from .helpers import capture

LAYERS = 2  # GPT-OSS's tiny config lists the types of 2 layers


def _scanned_clean(gm, flow, roots):
    """The definition, by one scan of the graph in order: a source, a root, or a node after the first root whose
    inputs (its arguments and their earlier in-place writers) are all clean."""
    clean = set()
    start = min(flow.order[r] for r in roots)
    for n in gm.graph.nodes:
        if _is_source(n) or n in roots or flow.order[n] > start and all(i in clean for i in flow.inputs(n)):
            clean.add(n)
    return clean


def _token_ids(model, seq=8):
    return torch.randint(0, model.config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0))


# Qwen3: plain top-k; DeepSeek-V3: a shared expert beside the routed ones; GPT-OSS: biases, in-place clamps;
# Gemma 4: the router on its own normalisation (the logits outside the block).
SEARCHED = ["qwen3_moe", "deepseek_v3", "gpt_oss", "gemma4"]


@functools.lru_cache(maxsize=None)
def _graph(family):
    model = make_causal_lm(family, num_layers=LAYERS)
    (graph,), _ = capture(model, _token_ids(model))
    gm, _ = graph
    flow = Dataflow(gm.graph)
    anchors = block_anchors(gm, flow)
    assert len(anchors) == LAYERS
    return gm, flow, anchors


@pytest.mark.parametrize("family", SEARCHED)
def test_activation_clean_is_the_scan(family):
    gm, flow, anchors = _graph(family)
    nodes = list(gm.graph.nodes)
    for index, (anchor, ids) in enumerate(anchors):
        region = find_region(gm, flow, anchor, ids, anchors)
        # The block's roots: its activation input, and its logits where the router stays outside (Gemma 4).
        own = {region.root} | ({region.logits} if region.router_linear is None else set())
        for roots in ({region.root}, {region.root, region.logits}):
            want = _scanned_clean(gm, flow, roots)
            forward, backward = _ActivationClean(flow, roots), _ActivationClean(flow, roots)
            assert {n for n in nodes if n in forward} == want
            assert {n for n in reversed(nodes) if n in backward} == want
            # Not vacuous: the next block's router, past the residual stream, is not clean; with the block's own
            # roots, its output is.
            if index + 1 < LAYERS:
                assert anchors[index + 1][0] not in want
            assert (region.out in want) == (roots == own or region.router_linear is not None)


@pytest.mark.parametrize("family", SEARCHED)
def test_first_matmul_the_ids_reach(family):
    """`Dataflow.first_reached` (a search in graph order that stops at the first match) finds the first matmul of the ids'
    whole forward slice, and what it visited is that slice up to the matmul."""
    gm, flow, anchors = _graph(family)
    for _, ids in anchors:
        whole = flow.sorted(flow.forward_slice([ids]))
        want = next(n for n in whole if op_name(n) in MATMUL_OPS)
        got, reached = flow.first_reached(ids, lambda n: op_name(n) in MATMUL_OPS)
        assert got is want
        assert reached == {n for n in whole if flow.order[n] <= flow.order[want]}
        assert flow.first_reached(ids, lambda n: False) == (None, set(whole))  # no match: the whole slice


def test_dataflow_after_a_rewrite_is_built_anew():
    """A Dataflow built from the one before a rewrite (which only takes over whether each node writes in place) is
    the Dataflow built from scratch: the same order, and the same writers of each tensor."""
    model = make_causal_lm("gpt_oss", num_layers=2)
    (graph,), _ = capture(model, _token_ids(model))
    gm, _ = graph
    before = Dataflow(gm.graph)
    assert before.writers, "the test needs a graph with in-place writes"
    # A rewrite as the pass makes one: a node inserted and another's readers rewired to it.
    written = next(iter(before.writers))
    with gm.graph.inserting_after(written):
        copy = gm.graph.call_function(torch.clone, (written,))
    written.replace_all_uses_with(copy, delete_user_cb=lambda u: u is not copy)
    after, fresh = Dataflow(gm.graph, previous=before), Dataflow(gm.graph)
    assert after.order == fresh.order
    assert dict(after.writers) == dict(fresh.writers)
    assert copy in after.writers and written not in after.writers


def test_deep_model_fuses_every_block():
    torch._dynamo.reset()
    counters.clear()
    layers = 12
    model = make_causal_lm("qwen3_moe", num_layers=layers)
    ids = _token_ids(model, seq=16)
    with torch.no_grad():
        want = model(ids).logits
        got = torch.compile(model, backend=mok_backend, options={"compiler": "aot_eager"})(ids).logits
    assert counters["mok"]["fused_moe"] == layers, dict(counters["mok"])
    assert counters["mok"]["rejected_moe"] == 0, dict(counters["mok"])
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6 * want.abs().max().item())


class _LongChain(torch.nn.Module):
    """A weight computed from a parameter, and an activation chain of 3000 adds after the input."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        h = x
        for _ in range(3000):
            h = h + x
        return h @ (self.w * 2.0)


def test_computed_weights_past_a_chain_longer_than_the_recursion_limit():
    """A walk back along the 3000 adds (the module-loop MoE of 600 experts had a chain like it) decides their end is
    no computed weight, without a RecursionError; the parameter's product is one."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    gm = torch.fx.symbolic_trace(_LongChain())
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(torch.randn(2, 4))
    flow = Dataflow(gm.graph)
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    adds = [n for n in gm.graph.nodes if op_name(n) == "add"]
    scaled = next(n for n in gm.graph.nodes if op_name(n) == "mul")
    assert len(adds) == 3000
    computed = _ComputedWeights(flow, x, set())
    assert adds[-1] not in computed and scaled in computed
