"""Capture Dynamo graphs for the pass tests and run them with concrete inputs."""

from __future__ import annotations

import torch

from mok_compile.passes.validate import concrete


def capture(fn, *args, dynamic=False, fullgraph=True, **kwargs):
    """(graphs, eager result): every FX graph Dynamo hands to the backend while running fn(*args, **kwargs)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        eager = fn(*args, **kwargs)
        torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=fullgraph)(*args, **kwargs)
    return graphs, eager


def run(gm, example_inputs):
    """Run a captured graph on its example inputs (symbolic sizes replaced by the sizes they were traced with)."""
    with torch.no_grad():
        return gm(*[e if isinstance(e, torch.Tensor) else concrete(e) for e in example_inputs])


def ops_in(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def count_fused(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is torch.ops.mok.fused_moe.default)
