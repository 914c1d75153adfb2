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


def weights_out_of_memory(monkeypatch, min_numel=8 * 64 * 32):
    """The probe's draws of tensors of `min_numel` elements and more run out of memory (by default the tiny
    models' expert weights; hidden states and router are smaller), as a copy of a large layer's weights does on a
    GPU that holds the model."""
    from mok_compile.passes import validate

    real_random = validate._random

    def random_or_out_of_memory(meta, std, gen, subs=None):
        if meta.numel() >= min_numel:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 15.00 GiB.")
        return real_random(meta, std, gen, subs)

    monkeypatch.setattr(validate, "_random", random_or_out_of_memory)
