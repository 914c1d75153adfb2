"""A launch plan's direct launches (`plan._DirectLaunch`) on the CPU: the C launch function of Triton's launcher gets
the arguments that `kernel.run` would give it, through Triton's own `CudaLauncher.__call__` and descriptor wrapper,
with a stand-in for the compiled C function and for the TMA map encoding (both need a GPU). The GPU tests replay
the real kernels this way (`test_plan.py`: bit for bit the normal path's outputs)."""

import functools

import pytest
import torch
from triton.backends.nvidia import driver
from triton.tools.tensor_descriptor import TensorDescriptor

from mok_compile.kernels import plan

SIGNATURE = {"a_ptr": "*bf16", "b_desc": "tensordesc<bf16[64, 32]>", "n": "i32", "BLOCK": "constexpr"}
META = [{"swizzle": 3, "elem_size": 2, "elem_type": "bf16", "block_size": [64, 32], "fp4_padded": False}]


def _c_launch(log, *args):  # stands in for the C function Triton compiles: no __code__, like it
    log.append(args)


class _Kernel:
    """A compiled kernel whose launcher is Triton's `CudaLauncher` over a stand-in C launch function."""

    function, packed_metadata, name = 77, (4, 1, 0), "k"

    def __init__(self, log, signature=SIGNATURE, meta=META, scratch=0):
        run = object.__new__(driver.CudaLauncher)
        c_launch = functools.partial(_c_launch, log)
        run.launch = driver.wrap_handle_tensordesc(c_launch, signature, meta) if meta is not None else c_launch
        run.num_ctas, run.launch_cooperative_grid, run.launch_pdl = 1, False, False
        run.global_scratch_size = run.profile_scratch_size = scratch
        run.global_scratch_align = run.profile_scratch_align = 1
        self.run = run


@pytest.fixture
def maps(monkeypatch):
    """TMA maps encoded (a stand-in for the driver call): each a tuple naming its address, logged."""
    encoded = []

    def make_tensordesc_arg(arg, meta):
        encoded.append(arg.base.data_ptr())
        return [("map", arg.base.data_ptr(), tuple(arg.block_shape), meta["swizzle"]), *arg.shape, *arg.strides]

    monkeypatch.setattr(driver, "make_tensordesc_arg", make_tensordesc_arg)
    return encoded


def _step(kernel, a, b):
    """A recorded launch of `kernel` over tensor a (slot 0) and a descriptor over b (slot 1)."""
    given = [a, TensorDescriptor(b, list(b.shape), list(b.stride()), [64, 32]), 5, 16]
    recorded = [plan._Slot(0), plan._Desc(1, given[1]), 5, 16]
    return plan._LaunchStep(kernel, (3, 2), recorded, given)


def test_a_direct_launch_passes_what_kernel_run_passes(maps, monkeypatch):
    log = []
    a, b = torch.randn(8), torch.randn(128, 32)
    step = _step(_Kernel(log), a, b)
    assert step.direct is not None
    for other_b in (b, torch.randn(128, 32)):  # the recorded tensor, then one at another address
        for direct in (True, False):
            monkeypatch.setattr(plan, "direct_launch", direct)
            plan._launch(step, [a, other_b], 1234)
        via_direct, via_run = log[-2:]
        assert len(via_direct) == len(via_run) and all(x is y or x == y for x, y in zip(via_direct, via_run))
        assert via_direct[:13] == (3, 2, 1, 1234, 77, False, False, None, None, (4, 1, 0), None, None, None)
        assert via_direct[13] is a and via_direct[14][1] == other_b.data_ptr()


def test_a_descriptor_map_is_encoded_once_per_address(maps, monkeypatch):
    log = []
    a, b, c = torch.randn(8), torch.randn(128, 32), torch.randn(128, 32)
    step = _step(_Kernel(log), a, b)
    assert maps == [b.data_ptr()]  # the recorded call's map, kept
    maps.clear()
    monkeypatch.setattr(plan, "direct_launch", True)
    for base in (b, c, b, c, c):
        plan._launch(step, [a, base], 1234)
    assert maps == [c.data_ptr()]
    assert [args[14][1] for args in log] == [b.data_ptr(), c.data_ptr(), b.data_ptr(), c.data_ptr(), c.data_ptr()]


def test_a_map_per_layer_is_kept_across_a_deep_model(maps, monkeypatch):
    """A plan serves every layer of its signature in turn, each with its own weight: a model deeper than the maps kept
    would encode a map on every launch. 94 weights (Qwen3-235B's layers), cycled three times: one encoding each."""
    log = []
    a = torch.randn(8)
    weights = [torch.randn(128, 32) for _ in range(94)]
    step = _step(_Kernel(log), a, weights[0])
    monkeypatch.setattr(plan, "direct_launch", True)
    for _ in range(3):
        for w in weights:
            plan._launch(step, [a, w], 1234)
    assert sorted(maps) == sorted(w.data_ptr() for w in weights)
    assert [args[14][1] for args in log] == [w.data_ptr() for w in weights] * 3


def test_a_kernel_without_descriptors_launches_directly(maps):
    log = []
    step = plan._LaunchStep(_Kernel(log, signature={"a_ptr": "*fp32", "n": "i32"}, meta=None), (4,),
                            [plan._Slot(0), 9], [torch.randn(4), 9])
    assert step.direct is not None
    a = torch.randn(4)
    plan._launch(step, [a], 99)
    assert log == [(4, 1, 1, 99, 77, False, False, None, None, (4, 1, 0), None, None, None, a, 9)]


@pytest.mark.parametrize("case", ["scratch", "descriptor without TMA", "unknown launcher", "no launcher",
                                  "another argument layout"])
def test_kernels_the_direct_path_cannot_launch_exactly_go_through_kernel_run(maps, monkeypatch, case):
    log = []
    a, b = torch.randn(8), torch.randn(128, 32)
    if case == "scratch":  # Triton allocates a scratch buffer per launch
        kernel = _Kernel(log, scratch=128)
    elif case == "descriptor without TMA":  # its descriptors passed as pointer, shape and strides
        kernel = _Kernel(log, meta=[None])
    elif case == "unknown launcher":  # a wrapper laid out otherwise than Triton 3.6's
        kernel = _Kernel(log)
        kernel.run.launch = lambda *args: log.append(args)
    elif case == "no launcher":
        kernel = _Kernel(log)
        kernel.run = lambda *args: log.append(args)
    else:  # a Triton whose C launch function takes other leading arguments
        kernel = _Kernel(log)
        monkeypatch.setattr(driver, "_BASE_ARGS_FORMAT", "iiiKKpppOOOOOO")
    assert _step(kernel, a, b).direct is None
