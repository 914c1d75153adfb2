"""Programmatic dependent launch (`kernels/pdl.py`): which launches get it, the rule that keeps it exact (every
kernel that takes part waits for the kernel before it before touching memory), and on the GPU that the op's
outputs and gradients are bit for bit those of plain stream order, eagerly and replayed from a CUDA graph."""

import ast
import inspect
import textwrap

import pytest
import torch

from mok_compile.kernels import activation_pass, cutlass_gemm, dispatch, launch, moe, pdl, router_gemm, routing
from mok_compile.kernels.launch import Launcher
from tests.kernels.cases import make_case
from tests.kernels.test_launch import _JitStandIn, _kernel

_KERNEL_MODULES = (activation_pass, cutlass_gemm, dispatch, moe, router_gemm, routing)


def _launched_kernels():
    """Every Triton kernel the op's modules launch through `launcher(...)`, found in their source."""
    found = {}
    for module in _KERNEL_MODULES:
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "launcher":
                name = node.args[0].id
                found[name] = getattr(module, name)
    return found


def _body(kernel):
    """The kernel's statements after its docstring."""
    fn = getattr(kernel, "fn", kernel)  # a JITFunction, or the plain function under the interpreter
    (tree,) = ast.parse(textwrap.dedent(inspect.getsource(fn))).body
    body = tree.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return tree, body


def test_every_launched_kernel_waits_for_the_kernel_before_it_first():
    """The rule of pdl.py: a kernel launched with PDL may start before the previous kernel has completed, so its
    first statement must be `wait_prior(PDL)`; and every kernel of the op takes part, so no link of the chain
    falls back to a full drain."""
    kernels = _launched_kernels()
    assert len(kernels) >= 14, sorted(kernels)
    for name, kernel in kernels.items():
        tree, body = _body(kernel)
        params = [a.arg for a in tree.args.args]
        assert "PDL" in params, name
        first = body[0]
        assert (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)
                and first.value.func.id == "wait_prior" and first.value.args[0].id == "PDL"), name


def _pdl_kernel(a_ptr, n, BLOCK=16, PDL=False):
    pass


@pytest.fixture
def cuda_stand_ins(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    monkeypatch.setattr(launch, "fast_launch", True)


@pytest.mark.parametrize("enabled,device_has_it", [(True, True), (False, True), (True, False)])
def test_pdl_is_passed_where_it_is_on_and_the_device_has_it(cuda_stand_ins, monkeypatch, enabled, device_has_it):
    monkeypatch.setattr(pdl, "enabled", enabled)
    monkeypatch.setattr(pdl, "_device_has_pdl", lambda device: device_has_it)
    on = enabled and device_has_it
    fn = _JitStandIn(_pdl_kernel)
    launcher = Launcher(fn)
    a = torch.zeros(32)
    for _ in range(2):
        launcher[(2,)](a, 7, BLOCK=32)
    (first, _, _, kwargs), direct = fn.log
    assert first == "triton"
    assert (kwargs.get("PDL"), kwargs.get("launch_pdl")) == ((True, True) if on else (None, None))
    assert direct == ("direct", (2, 1, 1), 1234, (a, 7, 32, on))


def test_a_kernel_without_the_parameter_is_launched_as_before(cuda_stand_ins, monkeypatch):
    monkeypatch.setattr(pdl, "_device_has_pdl", lambda device: True)
    fn = _JitStandIn(_kernel)
    a = torch.zeros(32)
    Launcher(fn)[(1,)](a, a, 7, 0.5)
    assert fn.log[0][3] == {}


def test_the_environment_switches_it_off_at_import():
    import os
    import subprocess
    import sys

    code = "from mok_compile.kernels import pdl; print(pdl.enabled)"
    for env_value, printed in (("0", "False"), ("1", "True")):
        env = {**os.environ, "MOK_PDL": env_value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == printed


def _step(tensors, kw, go):
    """Forward (inference and training), backward: everything the op's launches write."""
    out, w, ids = torch.ops.mok.fused_moe(*tensors, **kw)
    grads = torch.ops.mok.fused_moe_backward(go, None, *tensors, w, ids, **kw)
    train = saved = ()
    if not kw.get("weight_on_input"):  # the training forward's saved h, logits and layout, and the backward on them
        train = torch.ops.mok.fused_moe_train(*tensors, **kw)
        saved = torch.ops.mok.fused_moe_backward(go, None, *tensors, train[1], train[2], **kw, gate_up_out=train[3],
                                                 router_logits=train[4], routing_layout=train[5])
    return [t for t in (out, w, ids, *train, *grads, *saved) if t is not None]


def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["triton", "cutlass"])
@pytest.mark.parametrize("variant,T,K", [("qwen3", 1, 8), ("qwen3", 300, 8), ("qwen3", 3000, 8), ("gpt_oss", 700, 4),
                                         ("deepseek_v3", 500, 8), ("llama4", 300, 1)])
def test_pdl_launches_give_the_bits_of_stream_order(variant, T, K, engine, monkeypatch):
    """Several calls in a row on fresh inputs, PDL on against off: equal bits. Every kernel launched ran both ways
    (its compiled kernels' metadata says so)."""
    _hopper()
    if engine == "cutlass" and variant == "llama4":
        pytest.skip("weight on input runs on Triton only")
    monkeypatch.setenv("MOK_GEMM_ENGINE", engine)
    monkeypatch.setattr(launch, "_LAUNCHERS", {})  # fresh launchers: the kernels this test launches, below
    cases = [make_case(variant, T=T, H=256, I=128, E=32, K=K, dtype=torch.bfloat16, device="cuda", seed=s)
             for s in range(3)]
    gos = [torch.randn_like(t[0]) for t, _ in cases]
    results = {}
    for on in (False, True, False, True):
        monkeypatch.setattr(pdl, "enabled", on)
        results.setdefault(on, []).append([_step(t, kw, go) for (t, kw), go in zip(cases, gos)])
    for run in results[False] + results[True][1:]:
        for want, got in zip(results[True][0], run, strict=True):
            for a, b in zip(want, got, strict=True):
                assert torch.equal(a, b)
    for fn, launcher in launch._LAUNCHERS.items():  # each kernel compiled once with PDL and once without
        assert {k.metadata.launch_pdl for k in launcher._kernels.values()} == {False, True}, launcher.fn


@pytest.mark.gpu
def test_a_cuda_graph_of_pdl_launches_replays_the_eager_bits(monkeypatch):
    from tests.kernels.test_triton_gpu import _captured

    _hopper()
    monkeypatch.setattr(pdl, "enabled", True)
    tensors, kw = make_case("qwen3", T=1024, H=256, I=128, E=32, K=8, dtype=torch.bfloat16, device="cuda")
    static = [t.clone() if t is not None else None for t in tensors]
    go = torch.randn_like(static[0])
    graph, outputs = _captured(lambda: _step(static, kw, go))
    for seed in (7, 8):
        fresh, _ = make_case("qwen3", T=1024, H=256, I=128, E=32, K=8, dtype=torch.bfloat16, device="cuda", seed=seed)
        static[0].copy_(fresh[0])
        graph.replay()
        monkeypatch.setattr(pdl, "enabled", False)
        eager = _step(static, kw, go)
        monkeypatch.setattr(pdl, "enabled", True)
        for a, b in zip(outputs, eager, strict=True):
            assert torch.equal(a, b)
