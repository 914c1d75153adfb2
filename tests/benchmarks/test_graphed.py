"""`benchmarks.moe_layer.graphed`: a captured step stays valid after its caller drops what the step reads; a capture
out of memory names the allocator setting that lets it fit."""

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


@pytest.mark.parametrize("conf,hinted", [("", True), ("expandable_segments:True", False)],
                         ids=["default", "expandable"])
def test_a_capture_out_of_memory_names_expandable_segments(monkeypatch, capsys, conf, hinted):
    """A capture that runs out of memory (DeepSeek-V3's fwd+bwd at T=4096 on an 80 GB card, whose free memory sat in
    partly used segments) gives nan with the setting that let it capture, unless that setting is on already."""
    class OutOfMemoryStream:
        def __init__(self):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.00 GiB")

    monkeypatch.setattr(torch.cuda, "Stream", OutOfMemoryStream)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    assert graphed(lambda: None) is None
    printed = capsys.readouterr().out
    assert "CUDA graph capture failed: OutOfMemoryError" in printed
    assert ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in printed) is hinted
