"""Expert GEMMs that reach the compiler without their router (a graph break between the two): reported, never fused."""

import torch
from torch._dynamo.utils import counters

from mok_compile.hf_blocks import make_block
from mok_compile.passes import fuse_moe, lone_experts

from .helpers import capture, count_fused, run


class RoutedElsewhere(torch.nn.Module):
    """An HF block with a graph break between its router and its experts, where transformers' all-to-all expert
    parallelism has its host read of the split sizes."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        _, weights, ids = self.block.gate(flat)
        torch._dynamo.graph_break()
        return self.block.experts(flat, ids, weights)


def test_experts_without_their_router_are_reported():
    model = RoutedElsewhere(make_block("qwen3_moe"))
    x = torch.randn(2, 5, 64)
    graphs, eager = capture(model, x, fullgraph=False)
    assert len(graphs) == 2
    reports = []
    for gm, example in graphs:
        before = gm.code
        reports += fuse_moe(gm, example).blocks
        assert gm.code == before  # nothing rewritten
    (report,) = reports  # the router's graph alone looks like top-k sampling: not reported
    assert report.form == lone_experts.FORM and not report.fused, report
    assert report.name == "block.experts" and "without a router in this graph" in report.reason, report
    assert counters["mok"]["rejected_moe"] == 1 and counters["mok"]["fused_moe"] == 0
    torch.testing.assert_close(run(*graphs[1])[0], eager.reshape(-1, 64))


def test_whole_block_is_fused_not_reported_alone():
    """Near miss: router and experts in one graph: fused, and no lone-experts report."""
    block = make_block("qwen3_moe")
    x = torch.randn(2, 5, 64)
    (graph,), eager = capture(block, x)
    gm, example = graph
    report = fuse_moe(gm, example)
    assert len(report.fused) == 1 and not report.rejected, str(report)
    assert count_fused(gm) == 1
    torch.testing.assert_close(run(gm, example)[0], eager[0] if isinstance(eager, tuple) else eager)
