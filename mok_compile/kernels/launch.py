"""Launching a Triton kernel with less host time than `kernel[grid](...)`.

At a few hundred tokens an MoE layer's GPU work takes less time than the host needs to launch it
(benchmarks/NOTES-gpu.md, "Host cost"): Triton's launcher binds and specialises every argument of the
kernel on each call (~60 for the grouped GEMM, most of them constexpr flags left at their defaults),
hashes the result into its cache key and builds launch metadata, 20-75 us per launch before the
driver call. `Launcher` keeps, per kernel, the compiled kernels it has launched, under a key of what
Triton specialises on (each tensor's dtype and address modulo 16, every other argument's type and
value), and launches a known one straight through `CompiledKernel.run`. The first call with a new
key goes through Triton (which compiles or finds the kernel) and records it.

The key holds only the values a call gives (a parameter left at its default is the same every time)
with the call's argument names, plain values are keyed before tensors, and the launcher is found by the
kernel's identity: 6 us per grouped-GEMM launch on the CPU, against 11 before (NOTES-gpu.md v15).

Falls back to Triton's own launch wherever the fast path could differ from it: under the CPU
interpreter, with Triton's launch hooks or pre-run hooks set (profilers), or with MOK_FAST_LAUNCH=0 in
the environment at import (`launch.fast_launch = False` at run time).
"""

from __future__ import annotations

import os
import threading

import torch
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

_MAX_ENTRIES = 4096  # per kernel; a key holds sizes (T among them), so serving with many T grows it

# MOK_FAST_LAUNCH=0 (read at import) or `launch.fast_launch = False`: every launch through Triton's own path.
fast_launch = os.environ.get("MOK_FAST_LAUNCH", "1") != "0"

_LAUNCHERS: dict = {}

# local.recording: a launch plan's recorder (`plan.py`) while it records a call on this thread, told of every launch.
local = threading.local()
local.recording = None


def launcher(fn) -> "Launcher":
    """The one `Launcher` of the Triton kernel `fn`: `launcher(fn)[grid](...)` where `fn[grid](...)` was.
    (Looked up by identity: hashing a JITFunction computes its cache key, ~1 us per launch.)"""
    found = _LAUNCHERS.get(id(fn))
    if found is None:
        found = _LAUNCHERS[id(fn)] = Launcher(fn)  # holds fn: its id stays its own
    return found


class Launcher:
    """`Launcher(jit_fn)[grid](*args, **kwargs)` launches like `jit_fn[grid](*args, **kwargs)`."""

    def __init__(self, fn):
        self.fn = fn
        # Under the CPU interpreter (decided when the kernel was decorated) `fn` has no parameters and no
        # compiled kernel to launch: always Triton's own path.
        self._direct = hasattr(fn, "params")
        params = getattr(fn, "params", ())
        self._names = {p.name: i for i, p in enumerate(params)}
        self._defaults = [p.default if p.has_default else _MISSING for p in params]
        self._layouts = {}
        self._kernels = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def run(self, grid, args, kwargs):
        if not (fast_launch and self._direct) or self.fn.pre_run_hooks or _hooks_set():
            if getattr(local, "recording", None) is not None:
                local.recording.on_triton_path()
            return self.fn[grid](*args, **kwargs)
        # The key: the call's argument names and what Triton specialises on in each given value (the
        # defaults of the rest never change).
        names = tuple(kwargs)
        given = (*args, *kwargs.values())
        device = torch._C._cuda_getDevice()  # Triton launches on the current device too
        key = (device, len(args), names, *map(_arg_key, given))
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self.fn[grid](*args, **kwargs)
            if hasattr(kernel, "result"):  # compiled asynchronously
                kernel = kernel.result()
            if len(self._kernels) >= _MAX_ENTRIES:
                self._kernels.clear()
            self._kernels[key] = kernel
            if getattr(local, "recording", None) is not None:
                local.recording.on_launch(kernel, grid, self._values(args, names, kwargs))
            return kernel
        n = len(grid)
        stream = torch._C._cuda_getCurrentRawStream(device)
        values = self._values(args, names, kwargs)
        recorder = getattr(local, "recording", None)
        if recorder is not None:
            recorder.on_launch(kernel, grid, values)
        kernel.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, kernel.function,
                   kernel.packed_metadata, None, None, None, *values)
        return kernel

    def _values(self, args, names, kwargs) -> list:
        """Every parameter's value in the kernel's order, defaults filled in, as Triton binds them."""
        values = self._defaults.copy()
        values[: len(args)] = args
        slots = self._layouts.get(names)
        if slots is None:
            slots = self._layouts[names] = [self._names.get(name) for name in names]
        for i, value in zip(slots, kwargs.values()):
            if i is not None:  # None: a compile option (num_warps, ...), not a parameter
                values[i] = value
        return values


_MISSING = object()
_PLAIN = frozenset((int, float, bool, str, type(None)))


def _arg_key(value):
    """What Triton's specialisation of `value` depends on, or more: a tensor's dtype and its address
    modulo 16; a TensorDescriptor's base (the same) and its shape, strides and block shape; any other
    argument's type and value (type too, so that True and 1, equal in a dict, stay apart)."""
    cls = type(value)
    if cls in _PLAIN:  # most arguments: tested first, as a failed isinstance(value, Tensor) costs more
        return cls, value
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() & 15
    if isinstance(value, TensorDescriptor):
        base = value.base
        return (base.dtype, base.data_ptr() & 15, tuple(value.shape), tuple(value.strides),
                tuple(value.block_shape), value.padding)
    return cls, value


def cdiv(a: int, b: int) -> int:
    """Host-side grid arithmetic: `triton.cdiv` and `triton.next_power_of_2` are constexpr functions,
    about 1.4 us per call from Python against 0.05 for these (30-odd calls per forward + backward)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _hooks_set() -> bool:
    """Triton's launch hooks (profilers) are set: those need Triton's own launch, which calls them."""
    return _hook_set(knobs.runtime.launch_enter_hook) or _hook_set(knobs.runtime.launch_exit_hook)


def _hook_set(hook) -> bool:
    """A launch hook is set: a non-empty HookChain (Triton 3.6), or any hook where it is a plain callable."""
    return hook is not None and bool(getattr(hook, "calls", True))
