"""`mok_compile.kernels.launch.Launcher` on the CPU: argument binding as Triton binds, the key, when a
launch takes the direct path and when it goes through Triton. A stand-in for the JIT function records
what each launch did; the GPU tests (test_triton_gpu.py) compare the real launches with Triton's."""

import inspect
import os

import pytest
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from mok_compile.kernels import launch
from mok_compile.kernels.launch import Launcher, _arg_key


class _Param:
    def __init__(self, p: inspect.Parameter):
        self.name, self.default, self.has_default = p.name, p.default, p.default is not inspect.Parameter.empty


class _CompiledStandIn:
    function, packed_metadata = "function", "metadata"

    def __init__(self, log):
        self.log = log

    def run(self, g0, g1, g2, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *values):
        self.log.append(("direct", (g0, g1, g2), stream, values))


class _JitStandIn:
    """Parameters from a Python signature; `fn[grid](...)` logs a Triton launch and returns a compiled kernel."""

    pre_run_hooks = ()
    __name__ = "kernel"

    def __init__(self, signature_of):
        self.params = [_Param(p) for p in inspect.signature(signature_of).parameters.values()]
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return _CompiledStandIn(self.log)

        return launch


def _kernel(a_ptr, b_ptr, n, alpha, FLAG=False, BLOCK=16, opt_ptr=None):
    pass


@pytest.fixture
def cuda_stand_ins(monkeypatch):
    """The two torch.cuda calls of the direct path, on a machine that may have no CUDA build."""
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    monkeypatch.setattr(launch, "fast_launch", True)


def test_values_are_ordered_as_the_signature_with_defaults():
    from mok_compile.kernels.grouped_gemm import _grouped_gemm_kernel

    if not hasattr(_grouped_gemm_kernel, "params"):
        pytest.skip("under the interpreter the kernel is not a JITFunction")
    sig = inspect.signature(_grouped_gemm_kernel.fn)
    required = [n for n, p in sig.parameters.items() if p.default is inspect.Parameter.empty]
    args = tuple(range(len(required) - 2))  # the last two required ones by keyword
    kwargs = {required[-1]: "x", required[-2]: "y", "HALF_TAIL": True, "num_warps": 8, "num_stages": 3}
    values = Launcher(_grouped_gemm_kernel)._values(args, tuple(kwargs), kwargs)
    expected = sig.bind(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
    expected.apply_defaults()
    assert values == list(expected.arguments.values())  # num_warps, num_stages: options, not among the values


def test_arg_key_tells_apart_what_triton_specialises_on():
    buf = torch.zeros(64, dtype=torch.bfloat16)
    assert _arg_key(buf[8:]) == _arg_key(buf)  # 16 bytes on: the same alignment
    assert _arg_key(buf[1:]) != _arg_key(buf)  # 2 bytes on
    assert _arg_key(buf.float()) != _arg_key(buf)
    assert _arg_key(True) != _arg_key(1) and _arg_key(1) != _arg_key(1.0)
    assert _arg_key(16) != _arg_key(32)
    w = torch.zeros(4, 32, 64, dtype=torch.bfloat16)
    desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [1, 16, 64])
    assert _arg_key(desc) == _arg_key(TensorDescriptor(w.clone(), list(w.shape), list(w.stride()), [1, 16, 64]))
    assert _arg_key(desc) != _arg_key(TensorDescriptor(w, list(w.shape), list(w.stride()), [1, 32, 64]))


def test_second_launch_with_the_same_key_is_direct(cuda_stand_ins):
    fn = _JitStandIn(_kernel)
    launcher = Launcher(fn)
    a, b = torch.zeros(32), torch.zeros(32)
    launcher[(3,)](a, b, 7, 0.5, BLOCK=32, num_warps=4)
    launcher[(5, 2)](b, a, 7, 0.5, BLOCK=32, num_warps=4)  # other tensors, same dtypes and alignment
    assert [entry[0] for entry in fn.log] == ["triton", "direct"]
    assert fn.log[1] == ("direct", (5, 2, 1), 1234, (b, a, 7, 0.5, False, 32, None))


@pytest.mark.parametrize("change", [
    dict(n=8), dict(alpha=1), dict(FLAG=True), dict(BLOCK=64), dict(num_warps=8), dict(b_ptr="misaligned"),
    dict(a_ptr="fp16"), dict(opt_ptr="tensor"),
])
def test_a_new_key_goes_through_triton(change, cuda_stand_ins):
    fn = _JitStandIn(_kernel)
    launcher = Launcher(fn)
    buf = torch.zeros(64)
    base = dict(a_ptr=buf[:32], b_ptr=buf[32:], n=7, alpha=0.5, BLOCK=32, num_warps=4)
    launcher[(1,)](**base)
    tensors = {"misaligned": buf[33:], "fp16": buf[:32].half(), "tensor": buf}
    launcher[(1,)](**{**base, **{k: tensors.get(v, v) if isinstance(v, str) else v for k, v in change.items()}})
    launcher[(1,)](**base)
    assert [entry[0] for entry in fn.log] == ["triton", "triton", "direct"]


def test_each_tensor_alignment_and_each_value_type_is_its_own_key(cuda_stand_ins):
    """Which tensor is misaligned matters (not only whether one is), and True / 1 / 1.0 in the same slot are
    three specialisations (the key holds each plain value's type with it)."""
    fn = _JitStandIn(_kernel)
    launcher = Launcher(fn)
    buf = torch.zeros(64)
    aligned, misaligned = buf[:32], buf[33:]
    calls = [(aligned, misaligned, 7, 0.5), (misaligned, aligned, 7, 0.5), (aligned, aligned, True, 0.5),
             (aligned, aligned, 1, 0.5), (aligned, aligned, 1.0, 0.5)]
    for _ in range(2):
        for args in calls:
            launcher[(1,)](*args, BLOCK=32)
    assert [entry[0] for entry in fn.log] == ["triton"] * len(calls) + ["direct"] * len(calls)
    assert [entry[3][:4] for entry in fn.log[len(calls):]] == calls


def test_a_tensor_where_a_call_gave_none_goes_through_triton(cuda_stand_ins):
    fn = _JitStandIn(_kernel)
    launcher = Launcher(fn)
    a = torch.zeros(32)
    for opt in (None, a, None, a):
        launcher[(1,)](a, a, 7, 0.5, opt_ptr=opt)
    assert [entry[0] for entry in fn.log] == ["triton", "triton", "direct", "direct"]
    assert fn.log[3][3][-1] is a


def _noop(*args, **kwargs):
    pass


class _InterpretedStandIn(_JitStandIn):
    """What @triton.jit gives under TRITON_INTERPRET=1: a kernel without `params`."""

    def __init__(self, signature_of):
        super().__init__(signature_of)
        del self.params


@pytest.mark.parametrize("why", ["fast_launch off", "interpreter", "launch hook", "pre-run hook"])
def test_falls_back_to_tritons_launch(why, cuda_stand_ins, monkeypatch, request):
    fn = (_InterpretedStandIn if why == "interpreter" else _JitStandIn)(_kernel)
    if why == "launch hook":  # a profiler's (proton): Triton 3.6 keeps them in a HookChain
        hooks = launch.knobs.runtime.launch_enter_hook
        if hasattr(hooks, "add"):
            hooks.add(_noop)
            request.addfinalizer(lambda: hooks.remove(_noop))
        else:
            monkeypatch.setattr(launch.knobs.runtime, "launch_enter_hook", _noop)
    elif why == "pre-run hook":
        fn.pre_run_hooks = [lambda *a, **k: None]
    elif why == "fast_launch off":
        monkeypatch.setattr(launch, "fast_launch", False)
    launcher = Launcher(fn)
    for _ in range(3):
        launcher[(1,)](torch.zeros(4), torch.zeros(4), 1, 1.0)
    assert [entry[0] for entry in fn.log] == ["triton"] * 3


def test_the_environment_switches_the_fast_path_off_at_import():
    import subprocess
    import sys

    code = "from mok_compile.kernels import launch; print(launch.fast_launch)"
    for env_value, printed in (("0", "False"), ("1", "True")):
        env = {**os.environ, "MOK_FAST_LAUNCH": env_value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == printed


def test_launcher_is_one_per_kernel():
    fn, other = _JitStandIn(_kernel), _JitStandIn(_kernel)
    assert launch.launcher(fn) is launch.launcher(fn)
    assert launch.launcher(other) is not launch.launcher(fn)


def test_keyword_order_and_defaults_are_bound_like_triton(cuda_stand_ins):
    """The same arguments by keyword in another order launch the same values; a keyword left at its
    default and the same default given explicitly differ in the key only (both launch the same values)."""
    fn = _JitStandIn(_kernel)
    launcher = Launcher(fn)
    a, b = torch.zeros(32), torch.zeros(32)
    for _ in range(2):
        launcher[(1,)](a, b, n=7, alpha=0.5, BLOCK=32)
        launcher[(1,)](a, b, alpha=0.5, n=7, BLOCK=32)
        launcher[(1,)](a, b, 7, 0.5, FLAG=False, BLOCK=32)
    direct = [entry[3] for entry in fn.log if entry[0] == "direct"]
    assert [entry[0] for entry in fn.log] == ["triton"] * 3 + ["direct"] * 3
    assert direct == [(a, b, 7, 0.5, False, 32, None)] * 3


def test_errors_come_from_tritons_launch_and_are_not_recorded(cuda_stand_ins):
    class Failing(_JitStandIn):
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                self.log.append(("triton",))
                raise TypeError("missing a required argument: 'alpha'")

            return launch

    fn = Failing(_kernel)
    launcher = Launcher(fn)
    for _ in range(2):
        with pytest.raises(TypeError, match="alpha"):
            launcher[(1,)](torch.zeros(4), torch.zeros(4), 1)
    assert len(fn.log) == 2
