"""Programmatic dependent launch (PDL, Hopper and later) for the op's chain of Triton kernels.

Why: the op is a chain of dependent launches (router, route, scan, scatter, block table, gate_up, down,
combine; more in the backward). Between two of them the GPU normally drains the first kernel, completes it,
and only then launches the next one and places its programs on the SMs: about 1-2 us per boundary, which at a
few tokens is a sizeable share of the op (NOTES-gpu.md v25: 12.5 of 70 us at Qwen3 T=1). With PDL a kernel is
launched with CUDA's programmatic stream serialisation attribute, so its programs may be placed while the kernel
before it is still running, once every program of that kernel has signalled (`griddepcontrol.launch_dependents`);
they then wait (`griddepcontrol.wait`) until the earlier kernel has completed and its writes are visible.

The rule that keeps it exact: a kernel launched this way calls `wait_prior` before its first access to global
memory (load or store), so everything it does with memory still happens after the kernel before it has
completed, as without PDL; only the launch and the placing of its programs overlap. Outputs are therefore bit
for bit the same with and without it. The signal is given at the very start: a kernel's dependents can be placed
only once all of its programs have started, so they never take an SM from one of its own programs.

A kernel takes part by having a `PDL: tl.constexpr = False` parameter and calling `wait_prior(PDL)` first;
`launch.Launcher` then passes PDL=True and `launch_pdl=True` on devices that have it (compute capability 9.0 and
later) unless MOK_PDL=0 was set at import (`pdl.enabled = False` at run time). A CUDA graph captured with PDL
launches keeps the programmatic edges.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

enabled = os.environ.get("MOK_PDL", "1") != "0"


@functools.cache
def _device_has_pdl(device: int) -> bool:
    """An NVIDIA GPU of compute capability 9.0 or later (ROCm reports its own architecture numbers there)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


def use_pdl(device: int) -> bool:
    """Whether launches on CUDA device `device` (an index) use PDL now."""
    return enabled and _device_has_pdl(device)


@triton.jit
def wait_prior(PDL: tl.constexpr):
    """The first statement of a kernel that takes part: let the next kernel's programs be placed, then wait
    until the kernel before this one has completed and its writes are visible. A no-op with PDL off."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
