"""The `mok` torch.compile backend (placeholder until the detection pass lands)."""

from __future__ import annotations


def mok_backend(gm, example_inputs, **kwargs):
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, **kwargs)
