"""`benchmarks.moe_layer.graphed`: a captured step stays valid after its caller drops what the step reads."""

import gc
import weakref

import pytest
import torch

from benchmarks.moe_layer import graphed


@pytest.mark.gpu
def test_a_graphed_step_keeps_the_inputs_only_it_holds():
    """configs_ab captured `fwd_bwd(op, x.clone().requires_grad_(), params)`: the clone was held by the step alone.
    With the bare `graph.replay` returned, the clone was freed at once, a tensor of its size got its memory, and
    replays read that tensor instead (fwd+bwd times of another problem)."""
    x = torch.randn(1 << 20, device="cuda")
    out = torch.empty_like(x)

    def step_over(src):
        def step():
            out.copy_(src * 2)

        return step

    src = x.clone()
    alive = weakref.ref(src)
    replay = graphed(step_over(src))
    del src
    gc.collect()
    assert alive() is not None
    reuse = torch.zeros_like(x)  # would take the clone's memory were it freed
    out.zero_()
    replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x * 2)
    assert torch.equal(reuse, torch.zeros_like(x))
