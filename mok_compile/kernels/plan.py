"""Launch plans: a GPU entry point's ops and kernel launches, recorded once per call signature and replayed.

At a few hundred tokens the op's host time exceeds its GPU time, and most of that host time is the Python that
works out sizes, configs, grids and argument lists around the launches (benchmarks/NOTES-gpu.md v21 (5): the
Qwen3 forward at T=256 takes 326 us of host time as is, 125 us for the same launches pre-bound). A `Plan`
records what the normal path does on one call: every aten op (through a TorchDispatchMode) and every direct
Triton launch (through `launch.Launcher`), with each tensor argument replaced by its slot, an input of the call
or an output of an earlier step. Replaying runs the same ops and the same compiled kernels with the same other
arguments on a later call's tensors, skipping the Python in between.

That is exact only where the call signature fixes everything the normal path reads besides tensor data and
addresses: each input's shape, strides, dtype, device, 16-byte alignment (what Triton specialises pointers
on; the allocator's blocks and the views into them keep theirs) and whether it is a view, the options, the
MOK_* switches, the TF32 setting, the current device and CUDA autocast (which changes the dtypes of the torch
ops inside) (`signature`). A path that reads anything else cannot be planned: a tensor the
recorder did not see made, an op returning a non-tensor, a launch through Triton's own path (launch hooks,
`launch.fast_launch` off). The recording then fails and the call goes on unrecorded (the recorder never
interrupts it: an entry point may write its inputs, so it could not run again). Side effects that are no aten
ops (freeing a tensor's storage) go through `effect`, which the recording sees.

A signature is recorded on its second call (a signature seen once costs nothing extra), and the cache keeps the
64 most recently used plans. A signature whose recording failed twice is not recorded again. MOK_LAUNCH_PLAN=0
at import (`plan.enabled = False` at run time) turns plans off. Once its extension is built, a plan replays in C++
(`plan_cpp.py`: the same steps, without the Python around each); `replay_in_python` is the replay here.
"""

from __future__ import annotations

import collections
import functools
import os
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from triton.tools.tensor_descriptor import TensorDescriptor

from . import launch

enabled = os.environ.get("MOK_LAUNCH_PLAN", "1") != "0"
# MOK_DIRECT_LAUNCH=0 (read at import) or `plan.direct_launch = False`: replays launch through `kernel.run`, not
# through Triton's C launch function directly (`_DirectLaunch`).
direct_launch = os.environ.get("MOK_DIRECT_LAUNCH", "1") != "0"
# MOK_DIRECT_LAUNCH_37=1 (read at import) or `plan.tuple_layout = True`: direct launches under Triton 3.7-3.9 too
# (`launch_layout` "tuple"). Off until a GPU run checks them: they were checked against those Tritons' own launchers
# on the CPU only (benchmarks/NOTES-gpu.md v82); without them such a Triton launches through `kernel.run`.
tuple_layout = os.environ.get("MOK_DIRECT_LAUNCH_37", "0") == "1"

# Environment switches the kernels' Python reads per call (configs.py, moe.py, router_gemm.py, library.py, __init__.py).
SWITCHES = ("MOK_TMA", "MOK_GROUP_M", "MOK_HALF_TAIL", "MOK_GEMM_ENGINE", "MOK_ROUTER_GEMM",
            "MOK_RECOMPUTE_GATE_UP", "MOK_FP32_DOT", "MOK_SPENT_WEIGHTS", "TRITON_INTERPRET")
_MAX_PLANS = 64
_MAX_FAILURES = 2  # failed recordings of a signature before it is left unplanned


class Unplannable(Exception):
    """The recorded path read something the signature does not fix."""


def _plannable(x) -> bool:
    """CUDA tensors only: elsewhere (the CPU interpreter) every launch takes Triton's own path."""
    return x.is_cuda


def _switch_reader():
    """A function returning the SWITCHES' values: from os.environ's own dict by pre-encoded keys where it has
    one (CPython's POSIX `os.environ`), ~10x faster than `os.environ.get`, which encodes each name per call."""
    data, encode = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if isinstance(data, dict) and encode is not None:
        get, keys = data.get, tuple(encode(name) for name in SWITCHES)
        return lambda: tuple([get(key) for key in keys])
    return lambda: tuple([os.environ.get(name) for name in SWITCHES])


_switches = _switch_reader()


def signature(tensors, options) -> tuple:
    """What a plan's replay must have in common with its recording (see the module docstring)."""
    return (tuple([None if t is None else (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() % 16 == 0,
                                           t._is_view())
                   for t in tensors]),
            options, _switches(), torch._C._get_cublas_allow_tf32(), torch._C._cuda_getDevice(),
            torch._C._is_any_autocast_enabled() and (torch.is_autocast_enabled("cuda"),
                                                     torch.get_autocast_dtype("cuda")))


class PlanCache:
    """Plans of one entry point, by signature."""

    def __init__(self, max_plans: int = _MAX_PLANS):
        self._plans = collections.OrderedDict()
        self._seen = collections.OrderedDict()
        self._max = max_plans

    def call(self, run, tensors, options):
        """`run()`, the normal path over `tensors` (the call's tensor arguments, None for absent ones) with
        `options` (hashable: everything else it takes), or its plan's replay."""
        if not (enabled and launch.fast_launch and _plannable(tensors[0])) or launch._hooks_set():
            return run()
        try:
            sig = signature(tensors, options)
            plan = self._plans.get(sig)  # hashes sig (a tuple: not cached, so once here rather than twice)
        except TypeError:  # an unhashable option: no plan
            return run()
        if plan is not None:
            try:
                self._plans.move_to_end(sig)
            except KeyError:  # dropped by another thread since: it still replays here
                pass
            return plan.replay(tensors)
        failures = self._seen.get(sig)
        if failures is None:
            _remember(self._seen, sig, 0, self._max)
            return run()
        if failures >= _MAX_FAILURES:  # recording costs a Python dispatch per op: stop trying
            return run()
        plan, result = Plan.record(run, tensors)
        if plan is not None:
            _remember(self._plans, sig, plan, self._max)
        else:
            self._seen[sig] = failures + 1
        return result

    def clear(self):
        self._plans.clear()
        self._seen.clear()


def _remember(cache, key, value, limit):
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > limit:
        cache.popitem(last=False)


class _Slot:
    """A tensor argument: the slot-th tensor of the replay (inputs first, then step outputs in order)."""

    __slots__ = ("index",)

    def __init__(self, index):
        self.index = index


class _Desc:
    """A TensorDescriptor argument over the tensor in `slot`."""

    __slots__ = ("slot", "shape", "strides", "block_shape", "padding")

    def __init__(self, slot, desc):
        self.slot = slot
        self.shape, self.strides = list(desc.shape), list(desc.strides)
        self.block_shape, self.padding = list(desc.block_shape), desc.padding


class _Recorder(TorchDispatchMode):
    """Sees every aten op and (through `launch.recording`) every Triton launch of the recorded call."""

    def __init__(self, tensors):
        super().__init__()
        self.slots = {}  # id(tensor) -> slot, for the tensors alive (an id freed is forgotten before its reuse)
        self.steps = []
        self.finalizers = []
        self.failed = None  # why the recording cannot make a plan, once it cannot
        for i, t in enumerate(tensors):
            if t is not None:
                if id(t) in self.slots:  # one tensor as two arguments: a later call need not repeat that
                    self.failed = "an input given twice"
                self.slots[id(t)] = i
        self.n_slots = len(tensors)

    def _track(self, t):
        """Give `t` the next slot; forget it when it is freed (the normal path frees intermediates early: keeping
        them alive would raise the recorded call's peak memory)."""
        key = id(t)
        self.slots[key] = self.n_slots
        self.n_slots += 1
        self.finalizers.append(weakref.finalize(t, self.slots.pop, key, None))

    def close(self):
        for f in self.finalizers:  # the recorded tensors outlive the recording: do not keep it alive with them
            f.detach()

    def slot_of(self, value):
        if isinstance(value, torch.Tensor):
            index = self.slots.get(id(value))
            if index is None:
                raise Unplannable("a tensor the recording did not see made")
            return _Slot(index)
        if isinstance(value, TensorDescriptor):
            return _Desc(self.slot_of(value.base).index, value)
        return value

    # The recorder never interrupts the call it watches (an entry point may write its inputs, so it could not
    # be run again): what it cannot record marks the recording failed, and the call goes on unrecorded.

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.failed:
            return func(*args, **kwargs)
        try:
            step = _OpStep(func, tree_map(self.slot_of, args), tree_map(self.slot_of, kwargs))
        except Unplannable as err:
            self.failed = str(err)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        flat = [] if out is None else tree_flatten(out)[0]  # None: an op that only writes its arguments
        if any(not isinstance(v, torch.Tensor) for v in flat):
            self.failed = f"{func} returned a non-tensor"
            return out
        for v in flat:  # an in-place op's output is its input: the same slot
            if id(v) not in self.slots:
                self._track(v)
        step.out_slots = [self.slots[id(v)] for v in flat]
        self.steps.append(step)
        return out

    def on_launch(self, kernel, grid, values):
        self._append(lambda: _LaunchStep(kernel, grid, [self.slot_of(v) for v in values], values))

    def on_effect(self, effect, tensor):
        self._append(lambda: _EffectStep(effect, self.slot_of(tensor).index))

    def on_triton_path(self):
        self.failed = "a launch through Triton's own path (launch hooks, or the fast path off)"

    def _append(self, make_step):
        if not self.failed:
            try:
                self.steps.append(make_step())
            except Unplannable as err:
                self.failed = str(err)


class _OpStep:
    __slots__ = ("func", "args", "kwargs", "out_slots", "flat", "mutable")

    def __init__(self, func, args, kwargs):
        schema = getattr(func, "_schema", None)
        self.mutable = schema is None or schema.is_mutable
        # An aten overload called from Python costs ~3x its public function (13 against 5 us for an empty on
        # the CPU): the ops the kernels' Python makes replay through the latter (`_FAST`), the rest as recorded.
        fast = _FAST.get(func)
        self.func = fast(args, kwargs) if fast is not None else None
        if self.func is None:
            self.func = func
        else:
            args, kwargs = [v for v in args if type(v) is _Slot], {}
        self.args, self.kwargs = args, kwargs
        # Tensors only at the top level (the usual case): filled by a comprehension instead of tree_map.
        self.flat = not any(isinstance(v, (list, tuple, dict)) and any(isinstance(x, _Slot) for x in tree_flatten(v)[0])
                            for v in (*args, *kwargs.values()))

    def fill(self, slots):
        if self.flat:
            return ([slots[v.index] if type(v) is _Slot else v for v in self.args],
                    {k: slots[v.index] if type(v) is _Slot else v for k, v in self.kwargs.items()})
        return _fill(self.args, slots), _fill(self.kwargs, slots)


class _EffectStep:
    """A side effect on a tensor that is no aten op (`effect(t)`), such as freeing its storage."""

    __slots__ = ("effect", "slot")

    def __init__(self, effect, slot):
        self.effect, self.slot = effect, slot


def effect(fn, tensor):
    """`fn(tensor)`, also when a plan replays this call: for side effects the recorder cannot see (storage
    operations, which are no aten ops)."""
    recorder = getattr(launch.local, "recording", None)
    if recorder is not None:
        recorder.on_effect(fn, tensor)
    fn(tensor)


class _LaunchStep:
    __slots__ = ("kernel", "grid", "values", "tensor_at", "desc_at", "direct")

    def __init__(self, kernel, grid, values, given):
        n = len(grid)
        self.kernel = kernel
        self.grid = (grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1)
        self.tensor_at = [(i, v.index) for i, v in enumerate(values) if isinstance(v, _Slot)]
        self.desc_at = [(i, v) for i, v in enumerate(values) if isinstance(v, _Desc)]
        self.values = [None if isinstance(v, (_Slot, _Desc)) else v for v in values]
        self.direct = _DirectLaunch.of(kernel, self.grid, values, given)


class _DirectLaunch:
    """A recorded launch through the C function of Triton's launcher, skipping its Python wrappers.

    `kernel.run(grid, stream, ...)` goes through Triton's `CudaLauncher.__call__` (scratch buffers) and, for a kernel
    with host-side tensor descriptors, a wrapper that encodes each descriptor's TMA map (a driver call) on every
    launch: about 3 us a launch, and 10 more per descriptor (benchmarks/NOTES-gpu.md v68). A descriptor's map is a
    function of its tensor's address and of what the signature fixes (shape, strides, box, dtype), so the replay keeps
    the expanded arguments of each descriptor by address and calls the C function with what the wrappers would pass
    it. Only where that is exactly what they do: no scratch buffers, descriptors lowered to TMA maps (Triton's
    `tensordesc_meta`), and a launcher laid out as Triton 3.6's or 3.7-3.9's (`launch_layout`, `_c_launch`); any other
    kernel launches through `kernel.run`."""

    __slots__ = ("fn", "args", "tensor_at", "desc_at", "kernel_args_at")

    @classmethod
    def of(cls, kernel, grid, values, given):
        """`values`: the launch's arguments as recorded (slots), `given`: as the call gave them."""
        try:
            return cls(kernel, grid, values, given)
        except _NotDirect:
            return None

    def __init__(self, kernel, grid, values, given):
        run = getattr(kernel, "run", None)
        layout = launch_layout()
        if (layout is None or getattr(run, "global_scratch_size", 1) != 0
                or getattr(run, "profile_scratch_size", 1) != 0
                or not hasattr(run, "launch_cooperative_grid") or not hasattr(run, "launch_pdl")
                or layout == "tuple" and (not tuple_layout or getattr(run, "gsan_enabled", False)
                                          or not hasattr(run, "arg_annotations")
                                          or not hasattr(run, "kernel_signature"))):
            raise _NotDirect
        fn, desc_meta, encode = _c_launch(run.launch)
        if sorted(desc_meta) != [i for i, v in enumerate(values) if isinstance(v, _Desc)] or any(
                meta is None for meta in desc_meta.values()):
            raise _NotDirect
        self.fn = fn
        # The C function's arguments: the grid, the stream (per call), the kernel and its launch options, then the
        # values with each descriptor expanded in place: its TMA map (per call), then its shape and strides, as
        # Triton's `make_tensordesc_arg` returns them. Triton 3.7 and later take the values as one tuple, after the
        # launcher's argument annotations and signature (`kernel_args_at`: where they start in `args`).
        if layout == "flat":
            self.args = [*grid, None, kernel.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                         kernel.packed_metadata, None, None, None]
            self.kernel_args_at = None
        else:
            self.args = [*grid, None, kernel.function, run.launch_cooperative_grid, run.launch_pdl,
                         kernel.packed_metadata, None, None, None, None, None, run.arg_annotations,
                         run.kernel_signature]
            self.kernel_args_at = len(self.args)
        self.tensor_at, self.desc_at = [], []
        for i, v in enumerate(values):
            if isinstance(v, _Desc):
                encoder = functools.partial(encode, meta=desc_meta[i])
                tma, *geometry = encoder(given[i])
                self.desc_at.append((len(self.args), v, encoder, {given[i].base.data_ptr(): tma}))
                self.args.extend([None, *geometry])
            elif isinstance(v, _Slot):
                self.tensor_at.append((len(self.args), v.index))
                self.args.append(None)
            else:
                self.args.append(v)

    def launch(self, slots, stream):
        args = self.args.copy()
        args[3] = stream
        for i, index in self.tensor_at:
            args[i] = slots[index]
        for i, d, encoder, maps in self.desc_at:
            base = slots[d.slot]
            tma = maps.get(base.data_ptr())
            args[i] = tma if tma is not None else tma_map(maps, d, encoder, base)
        k = self.kernel_args_at
        if k is None:
            self.fn(*args)
        else:
            self.fn(*args[:k], tuple(args[k:]))


def tma_map(maps, d, encoder, base):
    """The TMA map of descriptor `d` (a `_Desc`) over `base`, encoded (`encoder(descriptor)`: Triton's expansion of
    it, its TMA map first) and kept in `maps` by address."""
    if len(maps) >= _MAX_MAPS:
        maps.clear()
    desc = TensorDescriptor(base, d.shape, d.strides, d.block_shape, d.padding)
    tma = maps[base.data_ptr()] = encoder(desc)[0]
    return tma


# The C launch function's leading arguments, as Triton 3.6 lays them out (grid, stream, function, cooperative, PDL,
# two scratch buffers, metadata, launch metadata, two hooks), the kernel's arguments after them.
_C_LAUNCH_LEAD = "iiiKKppOOOOOO"
# Triton 3.7's one launch function for every kernel, as its C source (driver.c, compiled on first use) parses its
# arguments: the grid, stream, function, cooperative, PDL, the kernel's packed metadata, launch metadata, two hooks,
# two scratch buffers, the argument annotations, the signature, then the kernel's arguments as one tuple (3.8 and
# 3.9 parse the same).
_C_LAUNCH_TUPLE = 'PyArg_ParseTuple(args, "iiiKKpp(iii)OOOOOOy*O"'
# TMA maps kept per descriptor argument of a step, by address: one per layer's weight (a plan serves every layer of
# its signature, in turn: fewer maps than layers would encode one on every launch; Qwen3-235B has 94 layers) and
# the reused buffers' few. 128 bytes each.
_MAX_MAPS = 256


class _NotDirect(Exception):
    """A kernel that `_DirectLaunch` cannot launch exactly as `kernel.run` does."""


def _c_launch(launch_fn):
    """(the C launch function, {argument position: its TMA metadata} of the host-side descriptors it is given, how a
    descriptor is expanded: `encode(descriptor, meta=...)`) of a Triton launcher's `launch`: itself where the kernel
    takes no descriptors, else the function that `wrap_handle_tensordesc` closes over, as Triton 3.6 and 3.7 lay it
    out (descriptors at `tensordesc_indices`, expanded by the driver's `make_tensordesc_arg`) or 3.8 and 3.9 (at the
    keys of `relevant_paths`, none inside a tuple argument, expanded by the `make_tensordesc_arg` it holds)."""
    code = getattr(launch_fn, "__code__", None)
    if code is None:  # the C function itself: no descriptor arguments
        return launch_fn, {}, None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in launch_fn.__closure__ or ())))
    if set(cells) == {"launcher", "tensordesc_indices", "tensordesc_meta"}:
        indices, encode = cells["tensordesc_indices"], _encode_by_driver
    elif set(cells) == {"launcher", "make_tensordesc_arg", "relevant_paths", "signature", "tensordesc_meta"}:
        if any(cells["relevant_paths"].values()):  # a descriptor inside a tuple argument
            raise _NotDirect
        indices, encode = cells["relevant_paths"].keys(), functools.partial(_encode_by, cells["make_tensordesc_arg"])
    else:
        raise _NotDirect
    fn, metas = cells["launcher"], cells["tensordesc_meta"]
    if getattr(fn, "__code__", None) is not None or len(metas) != len(indices):
        raise _NotDirect
    return fn, dict(zip(sorted(indices), metas)), encode


def _encode_by_driver(desc, meta):
    """Triton 3.6's and 3.7's expansion of a descriptor argument (TMA map, shape, strides), as their wrapper makes
    it."""
    return driver_module().make_tensordesc_arg(desc, meta)


def _encode_by(make_tensordesc_arg, desc, meta):
    """Triton 3.8's and 3.9's: their wrapper also passes the launch's leading arguments, which NVIDIA's ignores."""
    return make_tensordesc_arg(desc, meta, None)


@functools.cache
def launch_layout():
    """How the installed Triton's C launch function takes its arguments: "flat" (Triton 3.6: after the leading
    `_C_LAUNCH_LEAD`), "tuple" (3.7 and later: `_C_LAUNCH_TUPLE`), or None (another layout: no direct launches)."""
    driver = driver_module()
    if getattr(driver, "_BASE_ARGS_FORMAT", None) == _C_LAUNCH_LEAD:
        return "flat"
    try:
        with open(os.path.join(os.path.dirname(driver.__file__), "driver.c")) as f:
            return "tuple" if _C_LAUNCH_TUPLE in f.read() else None
    except OSError:
        return None


def driver_module():
    """Triton's NVIDIA driver module (its `make_tensordesc_arg` encodes a descriptor's TMA map)."""
    from triton.backends.nvidia import driver

    return driver


_ANY = object()


def _only(kwargs, **allowed) -> bool:
    """Whether `kwargs` hold only the `allowed` names, each at one of its listed values (`_ANY`: any value)."""
    return all(k in allowed and (allowed[k] is _ANY or any(v is a or v == a for a in allowed[k]))
               for k, v in kwargs.items())


def _with_cpp(fn, *form):
    """`fn`, with its form for the C++ replay (`plan_cpp.py`: the name of its step and that step's constants)."""
    fn.cpp = form
    return fn


def _fast_empty(args, kwargs):
    if len(args) == 1 and _only(kwargs, dtype=_ANY, device=_ANY, layout=(torch.strided, None),
                                pin_memory=(False, None), memory_format=(None, torch.contiguous_format)):
        size, dtype, device = args[0], kwargs.get("dtype"), kwargs.get("device")
        return _with_cpp(lambda: torch.empty(size, dtype=dtype, device=device), "empty", size, dtype, device)
    return None


def _fast_empty_like(args, kwargs):
    if len(args) == 1 and _only(kwargs, dtype=(None,), layout=(None,), device=(None,), pin_memory=(None, False),
                                memory_format=(None, torch.preserve_format)):
        return torch.empty_like
    return None


def _fast_slice(args, kwargs):
    _, dim, start, end, step = (*args, *(None, 0, None, None, 1)[len(args):])
    if kwargs or dim != 0 or step != 1:
        return None
    return _with_cpp(lambda t: t[start:end], "slice0", start, end)  # the same normalisation as aten.slice


def _no_kwargs(fast):
    return lambda args, kwargs: None if kwargs else fast


def _tensors_only(fast):
    """`fast` for a call whose arguments are all tensors (a None or a scalar among them is not dropped)."""
    return lambda args, kwargs: None if kwargs or not all(type(v) is _Slot for v in args) else fast


def _fast_method(method, n_args, **allowed):
    """`method(t, *the recorded arguments after t)` for an op called with `n_args` positional arguments, the first its
    only tensor, and keyword arguments only among `allowed` (name: the values it may have)."""
    def fast(args, kwargs):
        if len(args) != n_args or not _only(kwargs, **allowed):
            return None
        rest = args[1:]
        return _with_cpp(lambda t: method(t, *rest), method.__name__, *rest)

    return fast


_FAST = {
    torch.ops.aten.empty.memory_format: _fast_empty,
    torch.ops.aten.empty_like.default: _fast_empty_like,
    torch.ops.aten.slice.Tensor: _fast_slice,
    torch.ops.aten.detach.default: _no_kwargs(torch.Tensor.detach),
    torch.ops.aten.t.default: _no_kwargs(torch.Tensor.t),
    torch.ops.aten.mm.default: _no_kwargs(torch.mm),
    torch.ops.aten.addmm.default: _no_kwargs(torch.addmm),
    torch.ops.aten.linear.default: _tensors_only(torch.nn.functional.linear),
    torch.ops.aten.matmul.default: _tensors_only(torch.matmul),
    torch.ops.aten.contiguous.default: _tensors_only(torch.Tensor.contiguous),
    torch.ops.aten.transpose.int: _fast_method(torch.Tensor.transpose, 3),
    torch.ops.aten.reshape.default: _fast_method(torch.Tensor.reshape, 2),
    torch.ops.aten.view.default: _fast_method(torch.Tensor.view, 2),  # (view(dtype) is another overload)
    torch.ops.aten.to.dtype: _fast_method(torch.Tensor.to, 2, non_blocking=(False,), copy=(False,),
                                          memory_format=(None,)),
    torch.ops.aten.new_empty.default: _fast_method(torch.Tensor.new_empty, 2, dtype=(None,), layout=(None,),
                                                   device=(None,), pin_memory=(None, False)),
}
if hasattr(torch, "_grouped_mm"):  # (torch >= 2.8)
    _FAST[torch.ops.aten._grouped_mm.default] = _tensors_only(torch._grouped_mm)


def _fill(template, slots):
    return tree_map(lambda v: slots[v.index] if isinstance(v, _Slot) else v, template)


class Plan:
    """The recorded steps of one call; `replay(tensors)` runs them on another call's tensors."""

    def __init__(self, steps, result, n_inputs):
        # Each step compiled to the cheapest form that replays it:
        #   (_ALIAS, src)        a detach: the same tensor serves (only its data and layout are read later)
        #   (_CALL, fn, slots)   fn(*tensors in slots), one new output: the fast ops with tensor arguments only
        #   (_OP, step)          an op as recorded, its arguments filled in (an in-place op's output keeps its slot)
        #   (_LAUNCH, step)      a Triton launch
        #   (_EFFECT, fn, slot)  a side effect the normal path made through `effect`
        self.steps = []
        self.n_inputs = n_slots = n_inputs
        flat = tree_flatten(result)[0]
        kept = {v.index for v in flat if type(v) is _Slot}
        for step in steps:
            if type(step) is _LaunchStep:
                self.steps.append((_LAUNCH, step))
                continue
            if type(step) is _EffectStep:
                self.steps.append((_EFFECT, step.effect, step.slot))
                continue
            one_new = step.out_slots == [n_slots]
            if (not step.mutable and step.out_slots and all(index < n_slots for index in step.out_slots)
                    and set(step.out_slots) <= set(_op_reads(step))):
                # An op that returned its own input (`to` a dtype it has, `contiguous` of a contiguous tensor): it
                # does so again on a call of the same signature, which fixes dtypes and strides. Nothing to replay.
                continue
            n_slots += sum(index >= n_slots for index in step.out_slots)
            if one_new and step.func is torch.Tensor.detach and step.flat and n_slots - 1 not in kept:
                # (a detach returned to the caller stays a detach: it must not carry the input's autograd state)
                self.steps.append((_ALIAS, step.args[0].index))
            elif one_new and step.flat and not step.kwargs and all(type(v) is _Slot for v in step.args):
                self.steps.append((_CALL, step.func, [v.index for v in step.args]))
            else:
                self.steps.append((_OP, step))
        # Each slot is dropped after the step that reads it last (the normal path frees some intermediates
        # before it returns; holding every slot to the end would raise the replay's peak memory).
        last = {}
        for k, step in enumerate(self.steps):
            for index in _reads(step):
                last[index] = k
        self.release = [[] for _ in self.steps]
        for index, k in last.items():
            if index >= n_inputs and index not in kept:
                self.release[k].append(index)
        # A flat tuple of tensors and constants (the entry points' results, Nones among them) is rebuilt by a
        # comprehension: tree_map costs ~20 us per call.
        self.result_items = None
        if type(result) is tuple and not any(isinstance(v, (list, tuple, dict)) for v in result):
            self.result_items = [(type(v) is _Slot, v.index if type(v) is _Slot else v) for v in result]
        self.result = result
        self.launches = any(step[0] is _LAUNCH for step in self.steps)  # (the stream is read where there are)
        self.cpp = None  # the C++ replay (plan_cpp.py): None until translated, False where it has no C++ form

    @classmethod
    def record(cls, run, tensors):
        """(plan or None, result of run()): run the normal path once, recording it."""
        recorder = _Recorder(tensors)
        launch.local.recording = recorder
        try:
            with recorder:
                result = run()
        finally:
            launch.local.recording = None
            recorder.close()
        try:
            template = tree_map(recorder.slot_of, result)
        except Unplannable as err:
            recorder.failed = recorder.failed or str(err)
        if recorder.failed:
            return None, result
        return cls(recorder.steps, template, len(tensors)), result

    def replay(self, tensors):
        cpp = self.cpp
        if cpp is None:  # translated once the extension is loaded (it builds in the background meanwhile)
            cpp = self.cpp = plan_cpp.translate(self)
        if cpp and direct_launch and plan_cpp.enabled:
            stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice()) if self.launches else 0
            return cpp.replay(tensors, stream)
        return self.replay_in_python(tensors)

    def replay_in_python(self, tensors):
        # The launches and ops run in functions of their own: a local of this loop holding a step's tensors
        # would keep one released below alive into the next steps (peak memory: one [T*K, H] buffer more at the
        # CUTLASS backward's dgrad, measured).
        slots = list(tensors)
        stream = None
        for step, release in zip(self.steps, self.release):
            kind = step[0]
            if kind is _CALL:
                slots.append(step[1](*[slots[i] for i in step[2]]))
            elif kind is _ALIAS:
                slots.append(slots[step[1]])
            elif kind is _EFFECT:
                step[1](slots[step[2]])
            elif kind is _LAUNCH:
                if stream is None:
                    stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
                _launch(step[1], slots, stream)
            else:
                _run_op(step[1], slots)
            for index in release:
                slots[index] = None
        if self.result_items is not None:
            return tuple([slots[v] if is_slot else v for is_slot, v in self.result_items])
        return _fill(self.result, slots)


def _launch(step, slots, stream):
    if step.direct is not None and direct_launch:
        step.direct.launch(slots, stream)
        return
    values = list(step.values)
    for i, index in step.tensor_at:
        values[i] = slots[index]
    for i, d in step.desc_at:
        values[i] = TensorDescriptor(slots[d.slot], d.shape, d.strides, d.block_shape, d.padding)
    kernel = step.kernel
    kernel.run(*step.grid, stream, kernel.function, kernel.packed_metadata, None, None, None, *values)


def _run_op(op, slots):
    args, kwargs = op.fill(slots)
    out = op.func(*args, **kwargs)
    flat = (out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]
    for index, v in zip(op.out_slots, flat):
        if index == len(slots):  # a new tensor (an in-place op's output already has its slot)
            slots.append(v)


_CALL, _ALIAS, _OP, _LAUNCH, _EFFECT = "call", "alias", "op", "launch", "effect"


def _reads(step) -> list:
    """The slots a compiled step reads."""
    kind = step[0]
    if kind is _CALL:
        return step[2]
    if kind is _ALIAS:
        return [step[1]]
    if kind is _EFFECT:
        return [step[2]]
    if kind is _LAUNCH:
        return [index for _, index in step[1].tensor_at] + [d.slot for _, d in step[1].desc_at]
    return _op_reads(step[1])


def _op_reads(op) -> list:
    """The slots an `_OpStep` reads."""
    return [v.index for v in tree_flatten((op.args, op.kwargs))[0] if type(v) is _Slot]


from . import plan_cpp  # noqa: E402  (it reads this module's step kinds)
