"""A launch plan's replay in C++ (csrc/plan_replay.cpp): the same steps as `Plan.replay`, without its Python.

Where a step waits on the host (small experts in inductor's default mode), most of a plan's replay is the Python
around each step: 3-8 us an allocation or slice, 5 us or more a launch before the driver's call (NOTES-gpu.md v68
(5)). The C++ replay runs each ATen step through the same ATen function the Python replay reaches, each Triton
launch through the C launch function `_DirectLaunch` calls, with the arguments it would build (addresses as ints,
TMA maps kept by address in the same dicts), and calls back into Python for any other step, in the same order,
dropping each slot after its last reader. So its outputs are the Python replay's bits, on the same kernels.

The extension builds on the first plan's replay, in a background thread (a C++ compile: tens of seconds, cached
under `$MOK_BUILD_DIR` or torch's extension directory), and plans replay in Python until it is loaded; without a
compiler they stay in Python (one warning). Used with direct launches only (`plan.direct_launch`).
MOK_CPP_REPLAY=0 at import, or `plan_cpp.enabled = False` at run time, turns it off.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
import threading

import torch

from . import plan

log = logging.getLogger("mok_compile.plan")

enabled = os.environ.get("MOK_CPP_REPLAY", "1") != "0"
EXTENSION_NAME = "mok_plan_replay"
_SOURCE_NAME = "plan_replay.cpp"

_lock = threading.Lock()
_state: dict = {}  # "module": the loaded extension, or "error": why it is not; "thread": the build


def _load():
    """Build (or find built) and import the extension."""
    from ..ops import cpu

    return cpu.load_extension(EXTENSION_NAME, sources=[str(cpu.source_path(_SOURCE_NAME))], extra_cflags=["-O2"],
                              verbose=False)


def _build():
    """The background build: compiled by a process of its own (`python -m mok_compile.kernels.plan_cpp`), which
    finishes the build and releases the build directory's lock even if this process exits first, then imported
    here (nothing left to compile)."""
    from ..ops import cpu

    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # this process's imports
        done = subprocess.run([sys.executable, "-m", __name__], capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise RuntimeError((done.stderr or done.stdout).strip()[-2000:])
        _state["module"] = _load()
    except Exception as err:  # noqa: BLE001 - any build failure means: replay in Python
        _state["error"] = cpu._short_cause(err)
        log.warning("mok_compile: launch plans replay in Python: the C++ replay could not be built (%s)",
                    _state["error"])


def module(block: bool = False):
    """The loaded extension; None while it builds (started by the first call, in a background thread; `block`:
    wait for it) or where it cannot be built. Without a GPU only `block` builds it (plans replay on CUDA only; the
    CPU tests build it where they test it)."""
    mod = _state.get("module")
    if mod is not None or "error" in _state:
        return mod
    if "thread" not in _state:
        if not (block or torch.cuda.is_available()):
            return None
        with _lock:
            if "thread" not in _state:
                _state["thread"] = threading.Thread(target=_build, name="mok-plan-replay-build", daemon=True)
                _state["thread"].start()
    if block:
        _state["thread"].join()
    return _state.get("module")


class _Untranslatable(Exception):
    """A step the C++ replay does not take (the plan replays in Python)."""


# The public functions the fast ops replay through (plan._FAST), by the name of their C++ step.
_BUILTINS = {torch.empty_like: "empty_like", torch.Tensor.detach: "detach", torch.Tensor.t: "t", torch.mm: "mm",
             torch.addmm: "addmm", torch.nn.functional.linear: "linear", torch.matmul: "matmul",
             torch.Tensor.contiguous: "contiguous"}
if hasattr(torch, "_grouped_mm"):
    _BUILTINS[torch._grouped_mm] = "grouped_mm"
_N_READS = {"empty": (0,), "empty_like": (1,), "slice0": (1,), "detach": (1,), "t": (1,), "view": (1,),
            "reshape": (1,), "transpose": (1,), "contiguous": (1,), "to_dtype": (1,), "new_empty": (1,), "mm": (2,),
            "addmm": (3,), "linear": (2, 3), "matmul": (2,), "grouped_mm": (2, 3, 4)}


def translate(p):
    """`p` (a `plan.Plan`) as a C++ plan; None while the extension is not loaded (or the C++ replay is off), False
    where a step or the result has no C++ form."""
    if not enabled:
        return None
    mod = module()
    if mod is None:
        return None
    if p.result_items is None:
        return False
    ops = {name: i for i, name in enumerate(mod.OPS)}
    steps, n = [], p.n_inputs
    for step, release in zip(p.steps, p.release):
        try:
            name, reads, ints, extra, new = _native(step)
        except _Untranslatable:
            name, reads, ints, extra, new = _in_python(step, n)
        steps.append((ops[name], reads, ints, extra, release))
        n += new
    result = [(v, None) if is_slot else (-1, v) for is_slot, v in p.result_items]
    try:
        return mod.Plan(steps, result, p.n_inputs)
    except Exception as err:  # noqa: BLE001 - never fails the call: the plan replays in Python
        log.warning("mok_compile: a launch plan replays in Python: its C++ form was refused (%s)", err)
        return False


def _native(step):
    """(C++ step name, slots read, ints, extra, new tensors) of a step the C++ replay runs itself."""
    kind = step[0]
    if kind is plan._ALIAS:
        return "alias", [step[1]], [], None, 1
    if kind is plan._EFFECT:
        if getattr(step[1], "cpp", None) != ("free_storage",):
            raise _Untranslatable
        return "free_storage", [step[2]], [], None, 0
    if kind is plan._LAUNCH:
        direct = step[1].direct
        if direct is None:
            raise _Untranslatable
        descs = [(i, d.slot, maps, functools.partial(plan.tma_map, maps, d, encoder)) for i, d, encoder, maps in
                 direct.desc_at]
        reads = [slot for _, slot in direct.tensor_at] + [d.slot for _, d, _, _ in direct.desc_at]
        kernel_args_at = -1 if direct.kernel_args_at is None else direct.kernel_args_at
        return "launch", reads, [], (direct.fn, tuple(direct.args), list(direct.tensor_at), descs, kernel_args_at), 0
    if kind is not plan._CALL:
        raise _Untranslatable
    fn, reads = step[1], list(step[2])
    name, ints, extra = _call_form(fn)
    if len(reads) not in _N_READS[name]:
        raise _Untranslatable
    return name, reads, ints, extra, 1


def _call_form(fn):
    """(name, ints, extra) of a fast op's C++ step."""
    name = _BUILTINS.get(fn)
    if name is not None:
        return name, [], None
    form = getattr(fn, "cpp", None)
    if not form:
        raise _Untranslatable
    name, *consts = form
    if name == "empty":
        size, dtype, device = consts
        if not isinstance(dtype, torch.dtype) or device is None:
            raise _Untranslatable
        return name, _ints(size), (dtype, torch.device(device))
    if name == "slice0":
        start, end = consts
        return name, [start is not None, _int(start or 0), end is not None, _int(end or 0)], None
    if name == "transpose":
        return name, _ints(consts), None
    if name in ("view", "reshape", "new_empty"):
        return name, _ints(consts[0]), None
    if name == "to" and isinstance(consts[0], torch.dtype):
        return "to_dtype", [], consts[0]
    raise _Untranslatable


def _int(v) -> int:
    if type(v) is not int or not -(1 << 63) <= v < 1 << 63:
        raise _Untranslatable
    return v


def _ints(values) -> list:
    if not isinstance(values, (list, tuple, torch.Size)):
        raise _Untranslatable
    return [_int(v) for v in values]


def _in_python(step, n):
    """(name, reads, ints, callback, new tensors) of a step the C++ replay calls back into Python for: the callback
    takes the tensors it reads (in `reads` order) and the stream, runs the step as `Plan.replay_in_python` does on
    slots holding them, and returns its new tensors."""
    reads = sorted(set(plan._reads(step)))
    kind = step[0]
    if kind is plan._CALL:
        new = 1
    elif kind is plan._EFFECT or kind is plan._LAUNCH:
        new = 0
    else:  # an op as recorded: its new outputs are the slots from n on
        new = sum(index >= n for index in step[1].out_slots)

    def run(ts, stream):
        slots = [None] * n
        for i, t in zip(reads, ts):
            slots[i] = t
        if kind is plan._CALL:
            slots.append(step[1](*[slots[i] for i in step[2]]))
        elif kind is plan._EFFECT:
            step[1](slots[step[2]])
        elif kind is plan._LAUNCH:
            plan._launch(step[1], slots, stream)
        else:
            plan._run_op(step[1], slots)
        return slots[n:]

    return "python", reads, [new], run, new


if __name__ == "__main__":  # the background build's process (`_build`)
    _load()
