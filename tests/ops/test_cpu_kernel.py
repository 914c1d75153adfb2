"""The C++ CPU kernel of `mok::fused_moe` (csrc/fused_moe_cpu.cpp) against the reference.

Every routing family x activation x weight layout x bias combination, forward and
backward, at odd small sizes; then dtypes, determinism, proof that the C++ kernel
is what ran, and the fallback to the reference when the build is impossible.
The op-level tests (opcheck, HF modules, gradcheck) live in other files.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mok_compile.ops import cpu, reference
from mok_compile.ops.spec import with_defaults

H, I, E = 24, 10, 8
TOKENS = (0, 1, 7, 33)

ROUTINGS = {
    "softmax_topk_mixtral": dict(top_k=2, renormalize=True),
    "softmax_topk_scaled_wdtype": dict(top_k=3, routed_scale=1.5, weights_fp32=False),
    "softmax_topk_logits": dict(top_k=2, router_is_logits=True, softmax_fp32=False),
    "topk_softmax_gpt_oss": dict(top_k=2, routing="topk_softmax", softmax_fp32=False, weights_fp32=False),
    "topk_softmax_logits": dict(top_k=3, routing="topk_softmax", router_is_logits=True),
    "sigmoid_deepseek_v3": dict(top_k=3, routing="sigmoid_grouped_topk", router_fp32=True, renormalize=True,
                                renorm_eps=1e-20, routed_scale=2.5, n_group=2, topk_group=1),
    "sigmoid_ungrouped_wdtype": dict(top_k=2, routing="sigmoid_grouped_topk", weights_fp32=False),
    "topk_sigmoid_renorm": dict(top_k=2, routing="topk_sigmoid", renormalize=True, routed_scale=1.5),
    # weight_on_input: rows scaled by their routing weight before the first GEMM, unweighted combine.
    "topk_sigmoid_llama4": dict(top_k=1, routing="topk_sigmoid", weights_fp32=False, weight_on_input=True),
    "topk_sigmoid_weight_on_input_k3_renorm": dict(top_k=3, routing="topk_sigmoid", renormalize=True,
                                                   weight_on_input=True),
    "topk_sigmoid_weight_on_input_logits_bf16_sigmoid": dict(top_k=2, routing="topk_sigmoid", router_is_logits=True,
                                                             softmax_fp32=False, weights_fp32=False,
                                                             weight_on_input=True),
    "softmax_topk_weight_on_input_wdtype": dict(top_k=2, routed_scale=2.0, weights_fp32=False, weight_on_input=True),
    "sqrtsoftplus_deepseek_v4": dict(top_k=2, routing="sqrtsoftplus_topk", softmax_fp32=False, renormalize=True,
                                     renorm_eps=1e-20, routed_scale=1.5, weights_fp32=False),
    "sqrtsoftplus_groups": dict(top_k=3, routing="sqrtsoftplus_topk", n_group=4, topk_group=2, routed_scale=2.5),
    # PhiMoE's (each op in the logits' dtype), with a threshold that both keeps and drops other experts.
    "sparsemixer_phimoe": dict(top_k=2, routing="sparsemixer", softmax_fp32=False, weights_fp32=False,
                               jitter_eps=0.2),
}
# Which routings get a router bias / selection bias (as in GPT-OSS / DeepSeek-V3).
ROUTER_BIAS = {"topk_softmax_gpt_oss", "sigmoid_ungrouped_wdtype"}
SELECTION_BIAS = {"sigmoid_deepseek_v3", "sigmoid_ungrouped_wdtype", "sqrtsoftplus_deepseek_v4", "sqrtsoftplus_groups"}

# A small clamp limit so that unit-scale activations hit both sides of GPT-OSS's and DeepSeek-V4's clamps.
EXPERTS = {
    **{f"{act}_{'interleaved' if inter else 'concat'}": dict(activation=act, gated=True, interleaved=inter,
                                                            limit=0.75)
       for act in ("silu", "silu_fp32", "gelu_tanh", "clamped_silu", "clamped_swiglu", "softcapped_swiglu")
       for inter in (False, True)},
    **{f"{act}_ungated": dict(activation=act, gated=False) for act in ("relu2", "relu", "silu", "gelu", "gelu_tanh")},
}

HAS_COMPILER = cpu.missing_build_tool() is None
# Without a compiler the CPU key runs the reference itself: comparing it with itself proves nothing.
requires_cpp = pytest.mark.skipif(not HAS_COMPILER, reason=f"C++ kernel not buildable: {cpu.missing_build_tool()}")


def make_inputs(routing: str, experts: str, T: int, dtype=torch.float32, transposed=False, expert_bias=False,
                seed=0, H=H, I=I, E=E):
    """Positional tensors and full keyword arguments of the op for one combination."""
    kw = with_defaults({**ROUTINGS[routing], **EXPERTS[experts], "transposed": transposed})
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * std).to(dt)

    up = 2 * I if kw["gated"] else I
    router_dtype = reference._acc_dtype(dtype) if kw["router_fp32"] else dtype
    x = randn(T, H)
    router = randn(T, E) if kw["router_is_logits"] else randn(E, H, std=0.5, dt=router_dtype)
    router_bias = randn(E, std=0.5, dt=router_dtype) if routing in ROUTER_BIAS else None
    selection_bias = randn(E, std=0.1, dt=reference._acc_dtype(dtype)) if routing in SELECTION_BIAS else None
    gate_up = randn(E, H, up, std=H ** -0.5) if transposed else randn(E, up, H, std=H ** -0.5)
    down = randn(E, I, H, std=I ** -0.5) if transposed else randn(E, H, I, std=I ** -0.5)
    gate_up_bias = randn(E, up, std=0.1) if expert_bias else None
    down_bias = randn(E, H, std=0.1) if expert_bias else None
    return (x, router, router_bias, selection_bias, gate_up, gate_up_bias, down, down_bias), kw


def rel_error(actual, expected) -> float:
    """max |actual - expected| / max |expected|: errors measured against the tensor's scale."""
    if expected.numel() == 0:
        return 0.0
    a, e = actual.double(), expected.double()
    return (a - e).abs().max().item() / max(e.abs().max().item(), 1e-30)


def assert_close_rel(actual, expected, rel, what):
    if expected is None:
        assert actual is None, f"{what}: expected None"
        return
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
        f"{what}: {actual.dtype}{tuple(actual.shape)} vs {expected.dtype}{tuple(expected.shape)}")
    err = rel_error(actual, expected)
    assert err <= rel, f"{what}: relative error {err:.3g} > {rel:g}"


# Allowed fp32 error (relative to the gradient's scale) beyond twice the reference's own, against fp64.
FP32_CANCELLATION_NOISE = 2e-5

GRAD_NAMES = ("hidden_states", "router", "router_bias", "gate_up_proj", "gate_up_bias", "down_proj", "down_bias",
              "expert_scale", "post_norm_weight")


def check_against_reference(tensors, kw, fwd_rel, bwd_rel, seed=1):
    """Forward and backward of the op (CPU key: the C++ kernel) against reference.py on the same inputs."""
    out, w, ids = torch.ops.mok.fused_moe(*tensors, **kw)
    ref_out, ref_w, ref_ids = reference.fused_moe_reference(*tensors, **kw)
    # Routing runs the reference's ATen ops on the same inputs: identical bits.
    assert torch.equal(ids, ref_ids)
    assert w.dtype == ref_w.dtype and torch.equal(w, ref_w)
    assert_close_rel(out, ref_out, fwd_rel, "out")

    gen = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(out.shape, generator=gen).to(out.dtype)
    grad_w = torch.randn(w.shape, generator=gen).to(w.dtype)
    for grad_topk_weights in (grad_w, None):
        args = (grad_out, grad_topk_weights, *tensors, w, ids)
        grads = torch.ops.mok.fused_moe_backward(*args, **kw)
        assert_grads_close(grads, args, kw, bwd_rel)
    if cpu.saves_gate_up(tensors[0], kw):  # the training path: h saved by the forward, read by the backward
        t_out, t_w, t_ids, h, logits, layout, norm_input = torch.ops.mok.fused_moe_train(*tensors, **kw)
        assert torch.equal(t_out, out) and torch.equal(t_w, w) and torch.equal(t_ids, ids)
        # The C++ backward recomputes the routing and any post norm's input.
        assert logits.numel() == 0 and layout.numel() == 0 and norm_input.numel() == 0
        args = (grad_out, grad_w, *tensors, w, ids)
        saved_h = h.clone()
        grads = torch.ops.mok.fused_moe_backward(*args, **kw, gate_up_out=h)
        assert torch.equal(h, saved_h)  # read, never written
        assert_grads_close(grads, args, kw, bwd_rel)


def assert_grads_close(grads, args, kw, bwd_rel):
    """The kernel's gradients against reference.fused_moe_backward_reference(*args)."""
    ref_grads = reference.fused_moe_backward_reference(*args, **kw)
    for i, (name, g, rg) in enumerate(zip(GRAD_NAMES, grads, ref_grads, strict=True)):
        if rg is None or g is None:
            assert g is None and rg is None, f"grad {name}: {g} vs {rg}"
            continue
        assert g.dtype == rg.dtype and g.shape == rg.shape, f"grad {name}: {g.dtype} vs {rg.dtype}"
        err = rel_error(g, rg)
        if err <= bwd_rel:
            continue
        # Gradients that come out of cancellation (the router's, through softmax or
        # renormalisation) carry fp32 noise far above bwd_rel of their own small scale: the
        # reference itself is up to 3.5e-5 off fp64 there (measured over this grid). Then the
        # kernel must be about as close to the fp64 truth as the reference is.
        assert args[2].dtype == torch.float32, f"grad {name}: relative error {err:.3g} > {bwd_rel:g}"
        truth = reference.fused_moe_backward_reference(
            *[a if a is None or j == 11 else a.double() for j, a in enumerate(args)], **kw)[i]
        err_kernel, err_ref = rel_error(g, truth), rel_error(rg, truth)
        assert err_kernel <= 2 * err_ref + FP32_CANCELLATION_NOISE, (
            f"grad {name}: relative error {err:.3g} against the reference; against fp64 the kernel is off by "
            f"{err_kernel:.3g}, the reference by {err_ref:.3g}")


@pytest.fixture(scope="module", autouse=True)
def _cpp_kernel():
    """Build once for the module; with a compiler the C++ kernel must be what these tests check."""
    if HAS_COMPILER:
        assert cpu.extension_loaded(), f"C++ kernel failed to build: {cpu._state.get('error')}"


@requires_cpp
@pytest.mark.parametrize("expert_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("transposed", [False, True], ids=["linear_layout", "transposed_layout"])
@pytest.mark.parametrize("experts", EXPERTS)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_matches_reference_fp32(routing, experts, transposed, expert_bias):
    for T in TOKENS:
        tensors, kw = make_inputs(routing, experts, T, transposed=transposed, expert_bias=expert_bias, seed=T)
        check_against_reference(tensors, kw, fwd_rel=1e-6, bwd_rel=1e-6)


# bf16/fp16 outputs may differ by one rounding of the dtype (ulp 2**-8 / 2**-11 relative).
DTYPE_TOLERANCES = {torch.float64: (1e-12, 1e-12), torch.bfloat16: (2 ** -7, 2 ** -7),
                    torch.float16: (2 ** -10, 2 ** -10)}


@requires_cpp
@pytest.mark.parametrize("dtype", DTYPE_TOLERANCES, ids=str)
@pytest.mark.parametrize("experts", EXPERTS)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_matches_reference_other_dtypes(routing, experts, dtype):
    fwd_rel, bwd_rel = DTYPE_TOLERANCES[dtype]
    # Alternate layout and biases over the grid (fp32 above covers every combination).
    layout_bias = (len(routing) + len(experts)) % 4
    for T in TOKENS:
        tensors, kw = make_inputs(routing, experts, T, dtype=dtype, transposed=bool(layout_bias & 1),
                                  expert_bias=bool(layout_bias & 2), seed=T)
        check_against_reference(tensors, kw, fwd_rel, bwd_rel)


# Large enough that experts run in parallel (csrc: kMinParallelMacs, two experts per thread or more).
PARALLEL_SIZES = dict(H=128, I=64, E=16)
PARALLEL_CASES = [
    ("softmax_topk_mixtral", "silu_concat", False, False, torch.float32),
    ("topk_softmax_gpt_oss", "clamped_silu_interleaved", True, True, torch.float32),
    ("sigmoid_deepseek_v3", "gelu_tanh_concat", False, True, torch.bfloat16),
    ("softmax_topk_scaled_wdtype", "relu2_ungated", True, False, torch.bfloat16),
    ("topk_sigmoid_weight_on_input_k3_renorm", "silu_concat", True, False, torch.float32),
    ("topk_sigmoid_weight_on_input_k3_renorm", "silu_concat", True, True, torch.bfloat16),
]


@requires_cpp
@pytest.mark.parametrize("routing, experts, transposed, expert_bias, dtype", PARALLEL_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[4]}" for c in PARALLEL_CASES])
def test_matches_reference_parallel_experts(routing, experts, transposed, expert_bias, dtype):
    tensors, kw = make_inputs(routing, experts, 301, dtype=dtype, transposed=transposed, expert_bias=expert_bias,
                              **PARALLEL_SIZES)
    rel = 1e-6 if dtype == torch.float32 else DTYPE_TOLERANCES[dtype][0]
    check_against_reference(tensors, kw, fwd_rel=rel, bwd_rel=rel)


@requires_cpp
def test_autograd_through_dispatcher_matches_reference():
    """Gradients through torch.ops.mok.fused_moe's autograd: inputs that require grad reach the C++ kernel,
    whose worker threads must not record autograd history."""
    tensors, kw = make_inputs("topk_softmax_gpt_oss", "clamped_silu_interleaved", 301, transposed=True,
                              expert_bias=True, **PARALLEL_SIZES)
    leaves = [t.clone().requires_grad_(True) if t is not None and i != 3 else t for i, t in enumerate(tensors)]
    out, w, ids = torch.ops.mok.fused_moe(*leaves, **kw)
    gen = torch.Generator().manual_seed(3)
    g_out, g_w = torch.randn(out.shape, generator=gen), torch.randn(w.shape, generator=gen)
    ((out * g_out).sum() + (w * g_w).sum()).backward()
    grads = [leaves[i].grad for i in (0, 1, 2, 4, 5, 6, 7)] + [None, None]
    assert_grads_close(grads, (g_out, g_w, *tensors, w.detach(), ids), kw, bwd_rel=1e-6)


@requires_cpp
def test_inference_mode():
    """Under torch.inference_mode the worker threads must see it too (in-place writes into
    inference tensors are refused outside it)."""
    tensors, kw = make_inputs("softmax_topk_mixtral", "silu_concat", 301, expert_bias=True, **PARALLEL_SIZES)
    out, w, ids = torch.ops.mok.fused_moe(*tensors, **kw)
    grads = torch.ops.mok.fused_moe_backward(torch.ones_like(out), None, *tensors, w, ids, **kw)
    with torch.inference_mode():
        inference_tensors = [None if t is None else t.clone() for t in tensors]
        out_i, w_i, ids_i = torch.ops.mok.fused_moe(*inference_tensors, **kw)
        grads_i = torch.ops.mok.fused_moe_backward(torch.ones_like(out_i), None, *inference_tensors, w_i, ids_i, **kw)
    for a, b in zip((out, w, ids, *grads), (out_i, w_i, ids_i, *grads_i), strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@requires_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_deterministic(dtype):
    """Two identical calls give identical bits, at a size where experts run in parallel."""
    tensors, kw = make_inputs("softmax_topk_mixtral", "silu_concat", 301, dtype=dtype, expert_bias=True,
                              **PARALLEL_SIZES)
    grad_out = torch.randn(301, PARALLEL_SIZES["H"], generator=torch.Generator().manual_seed(7)).to(dtype)
    runs = []
    for _ in range(2):
        out, w, ids = torch.ops.mok.fused_moe(*tensors, **kw)
        grads = torch.ops.mok.fused_moe_backward(grad_out, torch.ones_like(w), *tensors, w, ids, **kw)
        runs.append((out, w, ids, *grads))
    for a, b in zip(*runs, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@requires_cpp
def test_cpp_kernel_is_what_runs():
    """The dispatcher's CPU kernel calls the C++ ops (seen by the profiler), not the reference: the forward
    without gradients, and with them the training forward (which saves h) and the backward."""
    assert cpu.kernel_name() == "cpp"
    tensors, kw = make_inputs("softmax_topk_mixtral", "silu_concat", 9)
    x = tensors[0].clone().requires_grad_(True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.no_grad():
            torch.ops.mok.fused_moe(x, *tensors[1:], **kw)
        out, _, _ = torch.ops.mok.fused_moe(x, *tensors[1:], **kw)
        out.sum().backward()
    names = {event.name for event in prof.events()}
    expected = {"mok_cpu::fused_moe", "mok_cpu::fused_moe_train", "mok_cpu::fused_moe_backward"}
    assert expected <= names, sorted(n for n in names if "mok" in n)


@requires_cpp
def test_bad_topk_ids_are_rejected():
    tensors, kw = make_inputs("softmax_topk_mixtral", "silu_concat", 5)
    out, w, ids = torch.ops.mok.fused_moe(*tensors, **kw)
    bad = ids.clone()
    bad[2, 0] = E
    with pytest.raises(RuntimeError, match="topk_ids holds expert 8, outside"):
        torch.ops.mok.fused_moe_backward(torch.ones_like(out), None, *tensors, w, bad, **kw)


def test_fallback_to_reference_warns_once(monkeypatch):
    """Without a working build the CPU key runs the reference, after exactly one warning naming the cause."""
    def no_build():
        raise RuntimeError("no C++ compiler found (test)")

    monkeypatch.setattr(cpu, "_state", {})
    monkeypatch.setattr(cpu, "_build_and_load", no_build)
    tensors, kw = make_inputs("topk_softmax_gpt_oss", "clamped_silu_interleaved", 7, transposed=True,
                              expert_bias=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = torch.ops.mok.fused_moe(*tensors, **kw)
        second = torch.ops.mok.fused_moe(*tensors, **kw)
        grads = torch.ops.mok.fused_moe_backward(torch.ones_like(first[0]), None, *tensors, first[1], first[2],
                                                 **kw)
    messages = [str(warning.message) for warning in caught if issubclass(warning.category, RuntimeWarning)]
    assert len(messages) == 1 and "no C++ compiler found (test)" in messages[0], messages
    assert cpu.kernel_name() == "reference"
    expected = reference.fused_moe_reference(*tensors, **kw)
    for a, b, c in zip(first, second, expected, strict=True):
        assert torch.equal(a, c) and torch.equal(b, c)
    ref_grads = reference.fused_moe_backward_reference(torch.ones_like(first[0]), None, *tensors, first[1],
                                                       first[2], **kw)
    for g, rg in zip(grads, ref_grads, strict=True):
        assert (g is None and rg is None) or torch.equal(g, rg)


def test_build_failure_cause_is_short_and_names_the_error():
    log = "\n".join([f"c++ -c file.cpp -I/some/include/path/{i}" for i in range(50)]
                    + ["file.cpp:12:3: error: 'foo' was not declared in this scope", "ninja: build stopped"])
    cause = cpu._short_cause(RuntimeError(log))
    assert "error: 'foo' was not declared" in cause and len(cause) < 700
