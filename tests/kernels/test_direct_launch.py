"""A launch plan's direct launches (`plan._DirectLaunch`) on the CPU: the C launch function of Triton's launcher gets
the arguments that `kernel.run` would give it, with a stand-in for the compiled C function and for the TMA map encoding
(both need a GPU). Two layouts of that function (`plan.launch_layout`): Triton 3.6's ("flat"), and 3.7's to 3.9's
("tuple": the kernel's arguments as one tuple after the argument annotations and signature). Each through Triton's own
`CudaLauncher.__call__` and descriptor wrapper where the installed Triton has that layout, and the tuple layout also
through `_Launcher37`, a model of its launcher, with models of 3.7's and 3.8's descriptor wrappers, on any Triton. The
GPU tests replay the real kernels this way (`test_plan.py`: bit for bit the normal path's outputs)."""

import functools

import pytest
import torch
from triton.backends.nvidia import driver
from triton.tools.tensor_descriptor import TensorDescriptor

from mok_compile.kernels import plan

SIGNATURE = {"a_ptr": "*bf16", "b_desc": "tensordesc<bf16[64, 32]>", "n": "i32", "BLOCK": "constexpr"}
META = [{"swizzle": 3, "elem_size": 2, "elem_type": "bf16", "block_size": [64, 32], "fp4_padded": False}]
# Triton's own launcher of the installed Triton (3.6's layout, or 3.7's to 3.9's), and models of 3.7's and 3.8's.
LAUNCHERS = ("triton-3.6", "triton-3.7+", "model-3.7", "model-3.8")
# What a layout's C function gets before the kernel's arguments (the stream at 3; 13: Triton 3.6's launch metadata and
# hooks, 15: 3.7's scratch buffers and its stand-in annotations and signature, then the arguments' tuple).
FLAT_LEAD = (3, 2, 1, 1234, 77, False, False, None, None, (4, 1, 0), None, None, None)
TUPLE_LEAD = (3, 2, 1, 1234, 77, False, False, (4, 1, 0), None, None, None, None, None, "annotations", b"sig")


def _c_launch(log, *args):  # stands in for the C function Triton compiles: no __code__, like it
    log.append(args)


def split(call, launcher):
    """(the leading arguments, the kernel's arguments) of a logged call of `launcher`'s C launch function."""
    return (call[:13], call[13:]) if launcher == "triton-3.6" else (call[:15], tuple(call[15]))


def _wrap_descriptors_37(launcher, signature, tensordesc_meta):
    """Triton 3.7's descriptor wrapper as it behaves: each descriptor among the kernel's arguments (the last
    argument) expanded in place into its TMA map, shape and strides (`make_tensordesc_arg`), the rest as given."""
    tensordesc_indices = {i for i, sig in enumerate(signature.values()) if str(sig).startswith("tensordesc")}

    def inner(*args):
        order = sorted(tensordesc_indices)
        expanded = []
        for i, arg in enumerate(args[-1]):
            if i in tensordesc_indices:
                expanded.extend(driver.make_tensordesc_arg(arg, tensordesc_meta[order.index(i)]))
            else:
                expanded.append(arg)
        return launcher(*args[:-1], expanded)

    return inner


def _wrap_descriptors_38(launcher, signature, tensordesc_meta, make_tensordesc_arg=None):
    """Triton 3.8's (and 3.9's) descriptor wrapper as it behaves: the same expansion, by the `make_tensordesc_arg` it
    was given, which also gets the launch's leading arguments; descriptors found by path (`relevant_paths`), also
    inside tuple arguments."""
    make_tensordesc_arg = make_tensordesc_arg or driver.make_tensordesc_arg
    signature = tuple(signature.values())
    relevant_paths = {i: {} for i, sig in enumerate(signature) if str(sig).startswith("tensordesc")}

    def inner(*args):
        assert len(args[-1]) == len(signature)
        metas = iter(tensordesc_meta)
        expanded = []
        for i, arg in enumerate(args[-1]):
            expanded.extend(make_tensordesc_arg(arg, next(metas), args[:-1]) if i in relevant_paths else [arg])
        return launcher(*args[:-1], expanded)

    return inner


class _Launcher37:
    """Triton 3.7's `CudaLauncher` as it calls its C function (read from its source; the same tests pass through the
    real one where Triton 3.7, 3.8 or 3.9 is installed, NOTES v82-v83):
    one function for every kernel, given the launch's metadata and hooks, two scratch buffers (none here), the
    argument annotations and signature, then the kernel's arguments as one sequence."""

    num_ctas, launch_cooperative_grid, launch_pdl = 1, False, False
    arg_annotations, kernel_signature = "annotations", b"sig"

    def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata, launch_enter_hook,
                 launch_exit_hook, *args):
        assert self.global_scratch_size == self.profile_scratch_size == 0
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    kernel_metadata, launch_metadata, launch_enter_hook, launch_exit_hook, None, None,
                    self.arg_annotations, self.kernel_signature, args)


class _Kernel:
    """A compiled kernel whose launcher is Triton's own (3.6's, or 3.7's to 3.9's) or `_Launcher37` over a stand-in C
    launch function."""

    function, packed_metadata, name = 77, (4, 1, 0), "k"

    def __init__(self, log, signature=SIGNATURE, meta=META, scratch=0, launcher="triton-3.6"):
        c_launch = functools.partial(_c_launch, log)
        if launcher.startswith("model"):
            run = _Launcher37()
            wrap = _wrap_descriptors_37 if launcher == "model-3.7" else _wrap_descriptors_38
        else:
            run = object.__new__(driver.CudaLauncher)
            run.num_ctas, run.launch_cooperative_grid, run.launch_pdl = 1, False, False
            run.arg_annotations, run.kernel_signature = _Launcher37.arg_annotations, _Launcher37.kernel_signature
            run.gsan_enabled = False  # (3.8 and later: the global sanitizer, off)
            wrap = driver.wrap_handle_tensordesc
        run.launch = wrap(c_launch, signature, meta) if meta is not None else c_launch
        run.global_scratch_size = run.profile_scratch_size = scratch
        run.global_scratch_align = run.profile_scratch_align = 1
        self.run = run


@pytest.fixture(params=LAUNCHERS)
def launcher(request, monkeypatch):
    """The launcher under test: Triton's own needs a Triton of that layout installed; the models run on any, with
    `plan.launch_layout` saying "tuple"."""
    if request.param != "triton-3.6":
        monkeypatch.setattr(plan, "tuple_layout", True)  # (opt-in until a GPU run checks it)
    if request.param.startswith("model"):
        monkeypatch.setattr(plan, "launch_layout", lambda: "tuple")
    elif plan.launch_layout() != ("flat" if request.param == "triton-3.6" else "tuple"):
        pytest.skip(f"the installed Triton's launcher is not laid out as {request.param}'s")
    elif request.param == "triton-3.7+":  # 3.8's launcher reads the active driver first (none without a GPU)
        import triton.runtime

        monkeypatch.setattr(triton.runtime.driver, "_active", object())
    return request.param


@pytest.fixture
def maps(monkeypatch):
    """TMA maps encoded (a stand-in for the driver call): each a tuple naming its address, logged."""
    encoded = []

    def make_tensordesc_arg(arg, meta, _leading_args=None):  # (3.8 and later pass the launch's leading arguments)
        encoded.append(arg.base.data_ptr())
        return [("map", arg.base.data_ptr(), tuple(arg.block_shape), meta["swizzle"]), *arg.shape, *arg.strides]

    monkeypatch.setattr(driver, "make_tensordesc_arg", make_tensordesc_arg)
    return encoded


def _step(kernel, a, b):
    """A recorded launch of `kernel` over tensor a (slot 0) and a descriptor over b (slot 1)."""
    given = [a, TensorDescriptor(b, list(b.shape), list(b.stride()), [64, 32]), 5, 16]
    recorded = [plan._Slot(0), plan._Desc(1, given[1]), 5, 16]
    return plan._LaunchStep(kernel, (3, 2), recorded, given)


def test_a_direct_launch_passes_what_kernel_run_passes(maps, monkeypatch, launcher):
    log = []
    a, b = torch.randn(8), torch.randn(128, 32)
    step = _step(_Kernel(log, launcher=launcher), a, b)
    assert step.direct is not None
    for other_b in (b, torch.randn(128, 32)):  # the recorded tensor, then one at another address
        for direct in (True, False):
            monkeypatch.setattr(plan, "direct_launch", direct)
            plan._launch(step, [a, other_b], 1234)
        (lead, args), (run_lead, run_args) = (split(call, launcher) for call in log[-2:])
        assert lead == run_lead == (FLAT_LEAD if launcher == "triton-3.6" else TUPLE_LEAD)
        assert len(args) == len(run_args) and all(x is y or x == y for x, y in zip(args, run_args))
        assert args[0] is a and args[1][1] == other_b.data_ptr()


def test_a_descriptor_map_is_encoded_once_per_address(maps, monkeypatch, launcher):
    log = []
    a, b, c = torch.randn(8), torch.randn(128, 32), torch.randn(128, 32)
    step = _step(_Kernel(log, launcher=launcher), a, b)
    assert maps == [b.data_ptr()]  # the recorded call's map, kept
    maps.clear()
    monkeypatch.setattr(plan, "direct_launch", True)
    for base in (b, c, b, c, c):
        plan._launch(step, [a, base], 1234)
    assert maps == [c.data_ptr()]
    assert [split(call, launcher)[1][1][1] for call in log] == [b.data_ptr(), c.data_ptr(), b.data_ptr(),
                                                              c.data_ptr(), c.data_ptr()]


def test_a_map_per_layer_is_kept_across_a_deep_model(maps, monkeypatch, launcher):
    """A plan serves every layer of its signature in turn, each with its own weight: a model deeper than the maps kept
    would encode a map on every launch. 94 weights (Qwen3-235B's layers), cycled three times: one encoding each."""
    log = []
    a = torch.randn(8)
    weights = [torch.randn(128, 32) for _ in range(94)]
    step = _step(_Kernel(log, launcher=launcher), a, weights[0])
    monkeypatch.setattr(plan, "direct_launch", True)
    for _ in range(3):
        for w in weights:
            plan._launch(step, [a, w], 1234)
    assert sorted(maps) == sorted(w.data_ptr() for w in weights)
    assert [split(call, launcher)[1][1][1] for call in log] == [w.data_ptr() for w in weights] * 3


def test_a_kernel_without_descriptors_launches_directly(maps, monkeypatch, launcher):
    log = []
    step = plan._LaunchStep(_Kernel(log, signature={"a_ptr": "*fp32", "n": "i32"}, meta=None, launcher=launcher), (4,),
                            [plan._Slot(0), 9], [torch.randn(4), 9])
    assert step.direct is not None
    a = torch.randn(4)
    for direct in (True, False):
        monkeypatch.setattr(plan, "direct_launch", direct)
        plan._launch(step, [a], 99)
    lead = (4, 1, 1, 99, *(FLAT_LEAD if launcher == "triton-3.6" else TUPLE_LEAD)[4:])
    assert [split(call, launcher) for call in log] == [(lead, (a, 9))] * 2


@pytest.mark.parametrize("case", ["scratch", "descriptor without TMA", "unknown launcher", "no launcher",
                                  "another argument layout", "sanitizer", "descriptor in a tuple"])
def test_kernels_the_direct_path_cannot_launch_exactly_go_through_kernel_run(maps, monkeypatch, launcher, case):
    log = []
    a, b = torch.randn(8), torch.randn(128, 32)
    kernel = _Kernel(log, launcher=launcher)
    if case == "scratch":  # Triton allocates a scratch buffer per launch
        kernel = _Kernel(log, scratch=128, launcher=launcher)
    elif case == "descriptor without TMA":  # its descriptors passed as pointer, shape and strides
        kernel = _Kernel(log, meta=[None], launcher=launcher)
    elif case == "unknown launcher":  # a wrapper laid out otherwise than Triton 3.6's to 3.9's
        kernel.run.launch = lambda *args: log.append(args)
    elif case == "no launcher":
        kernel.run = lambda *args: log.append(args)
    elif case == "another argument layout":  # a Triton whose C launch function takes other arguments
        monkeypatch.setattr(plan, "launch_layout", lambda: None)
    elif case == "sanitizer" and launcher != "triton-3.6":  # Triton 3.8's global sanitizer adds arguments
        kernel.run.gsan_enabled = True
    elif case == "descriptor in a tuple" and launcher == "model-3.8":  # 3.8's wrapper finds those by path
        wrapper = kernel.run.launch
        cells = dict(zip(wrapper.__code__.co_freevars, (c.cell_contents for c in wrapper.__closure__)))
        cells["relevant_paths"][1] = {0: {}}
    else:
        pytest.skip(f"{launcher} has no such case")
    assert _step(kernel, a, b).direct is None


@pytest.mark.parametrize("source,expected", [
    ('  if (!PyArg_ParseTuple(args, "iiiKKpp(iii)OOOOOOy*O", &gridX,', "tuple"),
    ('  if (!PyArg_ParseTuple(args, "iiiKKpp(iii)OOOOOy*O", &gridX,', None),  # one scratch buffer fewer
])
def test_the_launch_layout_is_read_from_the_driver(tmp_path, monkeypatch, source, expected):
    """Triton 3.7 and later declare no argument format in Python: the layout is read from the C source their
    launcher compiles (driver.c beside driver.py); one it does not know gives no direct launches."""
    (tmp_path / "driver.c").write_text("static PyObject *launchKernel(PyObject *self, PyObject *args) {\n" + source)

    class Driver:
        __file__ = str(tmp_path / "driver.py")

    monkeypatch.setattr(plan, "driver_module", lambda: Driver)
    plan.launch_layout.cache_clear()
    try:
        assert plan.launch_layout() == expected
        (tmp_path / "driver.c").unlink()
        plan.launch_layout.cache_clear()
        assert plan.launch_layout() is None
    finally:
        plan.launch_layout.cache_clear()


def test_the_tuple_layout_launches_directly_only_when_asked(maps, monkeypatch):
    """Until a GPU run checks them, Triton 3.7-3.9's direct launches are opt-in (MOK_DIRECT_LAUNCH_37=1)."""
    monkeypatch.setattr(plan, "launch_layout", lambda: "tuple")
    a, b = torch.randn(8), torch.randn(128, 32)
    for asked in (False, True):
        monkeypatch.setattr(plan, "tuple_layout", asked)
        assert (_step(_Kernel([], launcher="model-3.7"), a, b).direct is not None) == asked
