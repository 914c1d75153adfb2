"""`moe_layer.with_op_graphs`, the op-graphs A/B of `few_tokens` and `e2e_qwen3 --decode`, on the CPU."""

import torch

from benchmarks.moe_layer import with_op_graphs
from mok_compile.kernels import graphs


def test_each_call_runs_with_the_graphs_set_and_restores_the_setting(monkeypatch):
    seen = []

    def fn():
        seen.append((graphs.max_tokens, torch.is_grad_enabled()))
        return "out"

    for start in (300, 0):  # MOK_GRAPH_TOKENS=300, and graphs turned off at start-up
        monkeypatch.setattr(graphs, "max_tokens", start)
        seen.clear()
        assert with_op_graphs(fn, True)() == "out" and with_op_graphs(fn, False)() == "out"
        assert seen == [(start or graphs.DEFAULT_TOKENS, False), (0, False)]
        assert graphs.max_tokens == start
        seen.clear()
        assert with_op_graphs(fn, True, grad=True)() == "out"
        assert seen == [(start or graphs.DEFAULT_TOKENS, True)]
