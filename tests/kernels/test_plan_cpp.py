"""A launch plan's replay in C++ (`mok_compile.kernels.plan_cpp`, csrc/plan_replay.cpp).

On the CPU (the extension built here): composite ops and allocations replay natively and give the Python replay's
and the normal path's values; a stubbed forward and backward of the op, replayed in C++, launch what the normal path
launches with the same arguments; a direct launch gets the arguments the Python direct launch passes Triton's C
launch function (addresses as ints, the TMA maps kept by address in the same dict); a plan with no C++ form replays
in Python; the switch turns it off. On the GPU: real kernels, every step but the few ops as recorded native, and the
replays equal to the normal path bit for bit."""

import pytest
import torch

from mok_compile.kernels import moe, plan, plan_cpp
from tests.kernels.cases import VARIANTS as CASE_VARIANTS, make_case
from tests.kernels.test_direct_launch import _Kernel, _step, launcher, maps, split  # noqa: F401  (fixtures)
from tests.kernels.test_plan import (  # noqa: F401  (fresh_plans, stubbed: fixtures)
    _labels, assert_replay_equals_plans_off, fresh_plans, stubbed, training_step_case)


@pytest.fixture(scope="module")
def extension():
    mod = plan_cpp.module(block=True)
    assert mod is not None, f"the C++ replay could not be built: {plan_cpp._state.get('error')}"
    return mod


@pytest.fixture
def stream(monkeypatch):
    """The current stream, as the replays read it, on the CPU: 1234."""
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)


def _names(cpp_plan, extension):
    return [extension.OPS[i] for i in cpp_plan.ops]


def test_composite_ops_and_allocations_replay_natively(extension):
    x, w = torch.randn(4, 3, dtype=torch.bfloat16), torch.randn(5, 3, dtype=torch.bfloat16)

    def run():
        with torch._C._AutoDispatchBelowAutograd():
            a = x.to(torch.bfloat16).contiguous()  # both return x itself: not replayed
            c = a.to(torch.float32)
            c.add_(1.0)  # an op as recorded: a Python step
            buf = torch.empty((2, 3), dtype=torch.float32, device="cpu")
            buf.copy_(c[1:3])
            top, at = c.max(0)  # ops as recorded making new tensors (Python steps): one and two
            return (c.transpose(0, 1).reshape(-1), x.new_empty((0, 3)), torch.matmul(c, c.t()),
                    torch.nn.functional.linear(a, w), c.view(3, 4), torch.mm(c, c.t()), buf, c * 2, top, at, None)

    recorded, _ = plan.Plan.record(run, (x, w))
    cpp = plan_cpp.translate(recorded)
    assert cpp and _names(cpp, extension) == ["to_dtype", "python", "empty", "slice0", "python", "python",
                                             "transpose", "reshape", "new_empty", "t", "matmul", "linear", "view",
                                             "t", "mm", "python"]
    for x_new in (x, torch.randn_like(x)):
        x = x_new
        replayed, in_python, again = cpp.replay((x, w), 0), recorded.replay_in_python((x, w)), run()
        assert replayed[-1] is None
        for r, p, n in zip(replayed[:-1], in_python[:-1], again[:-1], strict=True):
            assert r.shape == n.shape and r.dtype == n.dtype and r.stride() == n.stride()
            assert torch.equal(r, n) and torch.equal(p, n)


def test_freeing_a_storage_replays_natively(extension):
    """The consuming backward's release of h (`plan.effect(moe._free_storage, h)`) is a native step: the C++ replay
    leaves h's storage empty, as the Python replay and the normal path do, after the steps that read it."""
    h = torch.randn(4, 3)

    def run(h):
        y = torch.mm(h, h.t())
        plan.effect(moe._free_storage, h)
        return (y,)

    recorded, _ = plan.Plan.record(lambda: run(h), (h,))
    cpp = plan_cpp.translate(recorded)
    assert cpp and _names(cpp, extension) == ["t", "mm", "free_storage"]
    fresh = [torch.randn(4, 3) for _ in range(3)]
    want = [f @ f.t() for f in fresh]
    (via_cpp,), (via_python,), (normal,) = cpp.replay((fresh[0],), 0), recorded.replay_in_python((fresh[1],)), run(
        fresh[2])
    for got, w, f in zip((via_cpp, via_python, normal), want, fresh):
        assert torch.equal(got, w) and f.untyped_storage().nbytes() == 0


def _replayed_and_normal(call, cache, fresh):
    """`call(input)` replayed in C++ (its signature seen once, recorded, translated on the first replay) and with
    plans off, on the same fresh input: ((outputs, launch log) replayed, the same normal, the C++ plan)."""
    for _ in range(3):
        call(fresh())
    (recorded,) = cache._plans.values()
    x = fresh()
    replayed = call(x)
    plan.enabled = False
    try:
        return replayed, call(x), recorded.cpp
    finally:
        plan.enabled = True


@pytest.mark.parametrize("save", [False, True])
def test_a_forward_and_backward_replayed_in_cpp_launch_what_the_normal_path_does(extension, stubbed, save):
    tensors, kw = make_case("qwen3", T=70, H=64, I=32, E=8, K=2, dtype=torch.float16)
    log = stubbed

    def forward(x):
        log.clear()
        out = moe.fused_moe_forward(x, *tensors[1:], save_gate_up=save, **kw)
        return out, _labels(log, (x, *tensors[1:]))

    (replayed, replayed_log), (normal, normal_log), cpp = _replayed_and_normal(
        forward, moe._FORWARD_PLANS, lambda: torch.randn_like(tensors[0]))
    assert cpp and "empty" in _names(cpp, extension)
    assert replayed_log == normal_log and len(normal_log) >= 6
    for r, n in zip(replayed, normal, strict=True):
        assert r.shape == n.shape and r.dtype == n.dtype and r.stride() == n.stride()
    if not save:
        return
    _, w, ids, h, logits, layout, _ = normal

    def backward(go):
        log.clear()
        grads = moe.fused_moe_backward(go, None, *tensors, w, ids, gate_up_out=h, router_logits=logits,
                                       routing_layout=layout, **kw)
        return grads, _labels(log, (go, None, *tensors, w, ids, h, logits, layout))

    (replayed, replayed_log), (normal, normal_log), cpp = _replayed_and_normal(
        backward, moe._BACKWARD_PLANS, lambda: torch.randn_like(tensors[0]))
    assert cpp and replayed_log == normal_log and len(normal_log) >= 5
    for r, n in zip(replayed, normal, strict=True):
        assert (r is None) == (n is None) and (r is None or (r.shape, r.dtype) == (n.shape, n.dtype))


def test_a_direct_launch_in_cpp_passes_what_the_python_replay_passes(extension, maps, stream, monkeypatch, launcher):
    """Triton's own launcher (3.6) or a model of 3.7's over a stand-in C function: the same arguments as the Python
    direct launch, but each tensor as its address (what Triton's launcher reads of it); one TMA map per address, in
    the step's dict; for 3.7, the kernel's arguments as one tuple at the end."""
    log = []
    a, b, c = torch.randn(8), torch.randn(128, 32), torch.randn(128, 32)
    recorded = plan.Plan([_step(_Kernel(log, launcher=launcher), a, b)], (), 2)
    cpp = plan_cpp.translate(recorded)
    assert cpp and _names(cpp, extension) == ["launch"]
    maps.clear()
    monkeypatch.setattr(plan, "direct_launch", True)
    for base in (b, c, b, c):
        cpp.replay((a, base), 1234)
        via_cpp = log[-1]
        recorded.replay_in_python((a, base))
        via_python = log[-1]
        assert len(via_cpp) == len(via_python) == (21 if launcher == "triton-3.6" else 16)
        (lead, args), (py_lead, py_args) = split(via_cpp, launcher), split(via_python, launcher)
        assert lead == py_lead and len(args) == len(py_args) == 8  # a, the map, shape and strides, 5, 16
        assert args[0] == a.data_ptr() and py_args[0] is a
        assert args[1] is py_args[1] and args[1][1] == base.data_ptr()  # the same kept map
        assert args[2:] == py_args[2:]
    assert maps == [c.data_ptr()]  # (b's map: encoded when the launch was recorded)


def test_a_plan_replays_in_cpp_only_with_direct_launches_and_the_switch_on(extension, maps, stream, monkeypatch,
                                                                          launcher):
    log = []
    a, b = torch.randn(8), torch.randn(128, 32)
    recorded = plan.Plan([_step(_Kernel(log, launcher=launcher), a, b)], (), 2)
    for direct, on, via_cpp in ((True, True, True), (False, True, False), (True, False, False)):
        monkeypatch.setattr(plan, "direct_launch", direct)
        monkeypatch.setattr(plan_cpp, "enabled", on)
        recorded.replay((a, b))
        first = split(log[-1], launcher)[1][0]
        assert (first == a.data_ptr() if via_cpp else first is a), (direct, on)
    assert recorded.cpp


def test_a_plan_with_no_cpp_form_replays_in_python(extension):
    x = torch.randn(4, 3)
    recorded, _ = plan.Plan.record(lambda: {"y": x * 2}, (x,))  # a result that is no flat tuple
    assert plan_cpp.translate(recorded) is False
    assert torch.equal(recorded.replay((x,))["y"], x * 2) and recorded.cpp is False


def test_a_cpp_form_the_extension_refuses_leaves_the_plan_in_python(extension, monkeypatch, caplog):
    x = torch.randn(4, 3)
    recorded, _ = plan.Plan.record(lambda: (x * 2,), (x,))

    def refuse(*args):
        raise RuntimeError("mok plan replay: a step reads slot 9")

    monkeypatch.setattr(extension, "Plan", refuse)
    with caplog.at_level("WARNING", logger="mok_compile.plan"):
        assert torch.equal(recorded.replay((x,))[0], x * 2)
    assert recorded.cpp is False and "reads slot 9" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", sorted(CASE_VARIANTS))
def test_a_training_step_replayed_in_cpp_equals_the_normal_path_bit_for_bit(extension, fresh_plans, variant):
    """Real kernels: the forward (inference and training) and the backward (recomputing, reading the saved tensors,
    consuming h) replayed in C++ give what plans off give on the same fresh inputs; every launch native."""
    inputs, step = training_step_case(variant)
    for seed in (1, 2, 3):  # seen once, recorded, translated on the first replay
        step(inputs(seed))
    plans = [p for c in (moe._FORWARD_PLANS, moe._BACKWARD_PLANS) for p in c._plans.values()]
    assert len(plans) == 5 and all(p.cpp for p in plans)
    names = [n for p in plans for n in _names(p.cpp, extension)]
    launches = sum(s[0] is plan._LAUNCH for p in plans for s in p.steps)
    assert names.count("launch") == launches >= 20, names  # every launch native; ops as recorded call back
    assert names.count("free_storage") == 1, names  # the consuming backward's release of h
    assert_replay_equals_plans_off(step, inputs(4))
