"""The registered op `mok::fused_moe` (and its backward) through the dispatcher, for every variant.

Whatever CPU kernel is registered runs here (the reference today, C++ soon):
- `opcheck`: schema, autograd registration, fake kernel vs real kernel, AOT dispatch with dynamic shapes;
- the dense oracle (tests/ops/moe_cases.py) in fp64: outputs, routing and every gradient;
- `gradcheck` in fp64: the hand-written backward against finite differences
  (routing is locally constant: random inputs have no ties);
- fake kernel under `torch.compile(dynamic=True)`: one graph serves every T;
- determinism: two identical calls are bit-identical, forward and backward.
"""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from mok_compile.ops.spec import ExpertSpec, RoutingSpec, op_kwargs

from .moe_cases import (ARG_NAMES, CASES, CASES_BY_NAME, DIFFERENTIABLE, dense_oracle, make_args, routing_probe,
                        weights_by_expert)

fused_moe = torch.ops.mok.fused_moe.default
fused_moe_backward = torch.ops.mok.fused_moe_backward.default


def _loss(out, topk_weights, topk_ids, probe_out, probe_route):
    """A loss that reaches every output, including the routing weights (aux-loss style)."""
    route = (topk_weights.to(probe_route.dtype) * probe_route.gather(1, topk_ids)).sum()
    return (out.to(probe_out.dtype) * probe_out).sum() + route


def _grads(loss, args):
    tensors = [args[i] for i in DIFFERENTIABLE if args[i] is not None]
    grads = iter(torch.autograd.grad(loss, tensors))
    return {ARG_NAMES[i]: next(grads) for i in DIFFERENTIABLE if args[i] is not None}


# ----------------------------------------------------------------------------- opcheck


@pytest.mark.parametrize("case", CASES, ids=str)
def test_opcheck_forward(case):
    args, kw = make_args(case, requires_grad=True)
    torch.library.opcheck(fused_moe, args, kw)


def _opcheck_backward(case, with_grad_weights):
    args, kw = make_args(case)
    out, w, ids = fused_moe(*args, **kw)
    gen = torch.Generator().manual_seed(3)
    grad_out = torch.randn(out.shape, generator=gen).to(out.dtype)
    grad_w = torch.randn(w.shape, generator=gen).to(w.dtype) if with_grad_weights else None
    torch.library.opcheck(fused_moe_backward, (grad_out, grad_w, *args, w, ids), kw)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_opcheck_backward(case):
    _opcheck_backward(case, with_grad_weights=True)


@pytest.mark.parametrize("name", ["softmax_topk_logits", "topk_softmax_router_bias_bf16", "sigmoid_deepseek_v3"])
def test_opcheck_backward_without_routing_weight_grad(name):
    """grad_topk_weights is None when the graph does not use the routing weights."""
    _opcheck_backward(CASES_BY_NAME[name], with_grad_weights=False)


# ----------------------------------------------------------------------------- semantics (fp64 oracle)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_dense_oracle_fp64(case):
    """Routing (ids, weights), output and all gradients equal the token-by-token definition."""
    args, kw = make_args(case, dtype=torch.float64, requires_grad=True)
    T, H = args[0].shape
    E = case.num_experts
    probe_out = torch.randn(T, H, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    probe_route = routing_probe(T, E)

    out, w, ids = fused_moe(*args, **kw)
    assert out.dtype == torch.float64 and w.dtype == torch.float64 and ids.dtype == torch.int64
    got_grads = _grads(_loss(out, w, ids, probe_out, probe_route), args)

    ref_out, ref_w = dense_oracle(args, kw)
    assert set(weights_by_expert(w, ids)) == set(ref_w), "chosen experts differ from the oracle"
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    got_w = weights_by_expert(w, ids)
    for key, val in ref_w.items():
        torch.testing.assert_close(got_w[key], val, rtol=1e-10, atol=1e-12, msg=f"weight of (token, expert) {key}")
    ref_loss = (ref_out * probe_out).sum() + sum(val * probe_route[t, e] for (t, e), val in ref_w.items())
    ref_grads = _grads(ref_loss, args)
    for name, g in ref_grads.items():
        assert g.abs().max() > 0, f"oracle gradient of {name} is zero: the comparison would be vacuous"
        torch.testing.assert_close(got_grads[name], g, rtol=1e-9, atol=1e-11, msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("case", CASES, ids=str)
def test_gradcheck_fp64(case):
    args, kw = make_args(case, T=4, H=6, I=3, dtype=torch.float64, requires_grad=True)
    if args[3] is not None:  # selection bias only chooses: its numerical gradient must be zero too
        args[3].requires_grad_()

    def op(*tensors):
        out, w, _ = fused_moe(*tensors, **kw)
        return out, w

    assert torch.autograd.gradcheck(op, args, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


@pytest.mark.parametrize("weights_fp32", [True, False], ids=["w_fp32", "w_bf16"])
@pytest.mark.parametrize("softmax_fp32", [True, False], ids=["softmax_fp32", "softmax_bf16"])
@pytest.mark.parametrize("routing", ["softmax_topk", "topk_softmax"])
def test_routing_precision_flags_bf16(routing, softmax_fp32, weights_fp32):
    """From given bf16 logits, topk_weights are exactly HF's, each step in the precision its flag names.

    Bitwise, because these flags change results by one bf16 rounding; the logits are an input, so no
    matmul (whose summation order a kernel may choose) is involved.
    """
    case = CASES_BY_NAME["softmax_topk_logits"]
    args, _ = make_args(case, T=64, dtype=torch.bfloat16)
    kw = op_kwargs(RoutingSpec(top_k=2, routing=routing, router_is_logits=True, renormalize=routing == "softmax_topk",
                               softmax_fp32=softmax_fp32, weights_fp32=weights_fp32), ExpertSpec())
    logits = args[1]

    def expected(softmax_fp32):
        if routing == "softmax_topk":
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32 if softmax_fp32 else torch.bfloat16)
            w, ids = torch.topk(probs, 2, dim=-1)
            w = w / w.sum(dim=-1, keepdim=True)
        else:
            top, ids = torch.topk(logits.float() if softmax_fp32 else logits, 2, dim=-1)
            w = torch.softmax(top, dim=-1)
        return w.to(torch.float32 if weights_fp32 else torch.bfloat16), ids

    _, w, ids = fused_moe(*args, **kw)
    want_w, want_ids = expected(softmax_fp32)
    assert torch.equal(ids, want_ids)
    assert w.dtype == want_w.dtype and torch.equal(w, want_w)
    if routing == "softmax_topk":  # the flag is observable here: the renormalisation rounds differently
        assert not torch.equal(expected(not softmax_fp32)[0], want_w)


# ----------------------------------------------------------------------------- fake kernel, dynamic T


def test_fake_kernel_symbolic_tokens_no_recompile():
    """One graph with a symbolic T serves every token count, forward and backward."""
    case = CASES_BY_NAME["sigmoid_deepseek_v3"]
    kw = make_args(case)[1]

    def block(x, router, selection_bias, gate_up, down):
        out, w, ids = torch.ops.mok.fused_moe(x, router, None, selection_bias, gate_up, None, down, None, **kw)
        return out * 2, w, ids

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, backend=counter, dynamic=True, fullgraph=True)
    first_compiles = None
    for T in (5, 7, 13):
        args, _ = make_args(case, T=T, requires_grad=True)
        x, router, _, sel, gate_up, _, down, _ = args
        got = compiled(x, router, sel, gate_up, down)
        want = block(x, router, sel, gate_up, down)
        for g, r in zip(got, want):
            assert g.shape == r.shape and g.dtype == r.dtype
            assert torch.equal(g, r)
        g_got = torch.autograd.grad(got[0].float().sum() + got[1].sum(), (x, router, gate_up, down))
        g_want = torch.autograd.grad(want[0].float().sum() + want[1].sum(), (x, router, gate_up, down))
        for a, b in zip(g_got, g_want):
            assert torch.equal(a, b)
        # Dynamo may restart its first analysis (it specialises the float keywords), so count from there.
        first_compiles = first_compiles or counter.frame_count
        assert counter.frame_count == first_compiles, f"recompiled for T={T}"
    nodes = [n for n in counter.graphs[-1].graph.nodes if n.target in (fused_moe, torch.ops.mok.fused_moe)]
    assert len(nodes) == 1
    out_val = nodes[0].meta["example_value"][0]
    assert isinstance(out_val.shape[0], torch.SymInt), f"T was specialised: {out_val.shape}"


def test_meta_tensors_give_shapes_and_dtypes():
    args, kw = make_args(CASES_BY_NAME["softmax_topk"], T=9, dtype=torch.bfloat16)
    meta = [None if a is None else a.to("meta") for a in args]
    for weights_fp32, w_dtype in ((True, torch.float32), (False, torch.bfloat16)):
        out, w, ids = fused_moe(*meta, **{**kw, "weights_fp32": weights_fp32, "top_k": 3})
        assert (out.shape, out.dtype) == ((9, 12), torch.bfloat16)
        assert (w.shape, w.dtype) == ((9, 3), w_dtype)
        assert (ids.shape, ids.dtype) == ((9, 3), torch.int64)


# ----------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("case", [CASES_BY_NAME[n] for n in (
    "softmax_topk_router_fp32", "topk_softmax_router_bias_bf16", "sigmoid_deepseek_v3", "clamped_silu_gpt_oss",
    "relu2_transposed_bias", "gelu_tanh")], ids=str)
def test_deterministic(case):
    """Same inputs, same bits: forward outputs and every gradient (fixed summation order)."""
    args, kw = make_args(case, T=32, requires_grad=True)
    gen = torch.Generator().manual_seed(5)
    probe_out = torch.randn(32, 12, generator=gen)
    probe_route = torch.randn(32, case.num_experts, generator=gen)

    def run():
        out, w, ids = fused_moe(*args, **kw)
        return (out, w, ids), _grads(_loss(out, w, ids, probe_out, probe_route), args)

    (outs1, grads1), (outs2, grads2) = run(), run()
    for a, b in zip(outs1, outs2):
        assert torch.equal(a, b)
    for name in grads1:
        assert torch.equal(grads1[name], grads2[name]), f"grad {name} differs between two identical calls"


def test_python_wrapper_matches_op():
    """`mok_compile.fused_moe` (specs instead of keywords) calls the same op with the same arguments."""
    from mok_compile import fused_moe as wrapper

    routing = RoutingSpec(top_k=2, routing="topk_softmax", weights_fp32=False)
    experts = ExpertSpec(activation="clamped_silu", interleaved=True, transposed=True)
    case = CASES_BY_NAME["clamped_silu_gpt_oss"]
    (x, router, rb, _, gu, gub, down, db), _ = make_args(case)
    got = wrapper(x, router, gu, down, routing, experts, router_bias=rb, gate_up_bias=gub, down_bias=db)
    want = fused_moe(x, router, rb, None, gu, gub, down, db, **op_kwargs(routing, experts))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- which backward autograd runs


class _MokOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the mok ops dispatched below autograd."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "mok":
            self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _train_case():
    """fp32 on the CPU: the C++ kernel's autograd saves h (`mok::fused_moe_train`)."""
    case = CASES_BY_NAME["softmax_topk_router_fp32"]
    args, kw = make_args(case, T=24, dtype=torch.float32, requires_grad=True)
    from mok_compile.ops.library import _saves_gate_up

    assert _saves_gate_up(args, kw)
    return args, kw


def test_backward_may_overwrite_saved_h_only_when_the_graph_is_freed():
    """A retained graph's backward must leave the saved h intact (`fused_moe_backward`); the last one may
    overwrite it with dh (`fused_moe_backward_consume`). Same gradients either way."""
    args, kw = _train_case()
    out, w, _ = fused_moe(*args, **kw)
    loss = out.square().sum() + w.sum()
    wrt = [t for t in args if t is not None and t.requires_grad]
    with _MokOps() as first_log:
        first = torch.autograd.grad(loss, wrt, retain_graph=True)
    with _MokOps() as last_log:
        last = torch.autograd.grad(loss, wrt)
    assert first_log.names == ["fused_moe_backward.default"]
    assert last_log.names == ["fused_moe_backward_consume.default"]
    for a, b in zip(first, last):
        assert torch.equal(a, b)


def test_traced_backward_keeps_the_functional_op():
    """aot_autograd's backward graph holds the functional `fused_moe_backward` (graphs stay functional,
    and a compiled graph may be run with retain_graph)."""
    from functorch.compile import aot_function, make_boxed_func

    args, kw = _train_case()
    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def loss_fn(*ts):
        out, w, _ = fused_moe(*ts, **kw)
        return out.square().sum() + w.sum()

    aot_function(loss_fn, fw_compiler=keep, bw_compiler=keep)(*args).backward()
    targets = [[str(n.target) for n in g.graph.nodes if "mok" in str(n.target)] for g in graphs]
    assert targets == [["mok.fused_moe_train.default"], ["mok.fused_moe_backward.default"]]


def test_opcheck_backward_consume():
    """Schema (the declared mutation of gate_up_out), fake kernel and autograd registration. Not the aot
    dispatch test: only eager autograd calls this op, and auto-functionalization does not take its
    optional (bias gradient) returns."""
    args, kw = _train_case()
    with torch.no_grad():
        out, w, ids, h, *_ = torch.ops.mok.fused_moe_train(*args, **kw)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    torch.library.opcheck(torch.ops.mok.fused_moe_backward_consume.default,
                          (grad_out, torch.ones_like(w), *[a.detach() if a is not None else None for a in args],
                           w, ids, h), kw, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


# ----------------------------------------------------------------------------- redispatch below autograd


def _spies(monkeypatch, calls):
    """Each mok op's CPU kernel registered as its backend kernel (`library.register_backend_kernel`) behind a
    spy that logs the op's name: what the CUDA kernels get on a GPU, exercised here on the CPU."""
    from mok_compile.ops import library

    monkeypatch.setattr(library, "_BACKEND_KERNELS", {})
    cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    for name in ("fused_moe", "fused_moe_train", "fused_moe_backward", "fused_moe_backward_consume"):
        op = getattr(torch.ops.mok, name).default

        def spy(*a, _op=op, _name=name, **k):
            calls.append(_name)
            return _op.redispatch(cpu, *a, **k)

        library.register_backend_kernel(op, "CPU", spy)


def test_every_op_has_a_direct_cpu_kernel():
    """Each mok op that `_FusedMoeFunction` calls has a CPU backend kernel, so CPU autograd never goes back
    through the dispatcher (as the CUDA kernels do on a GPU)."""
    from mok_compile.ops import library

    cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    for name in ("fused_moe", "fused_moe_train", "fused_moe_backward", "fused_moe_backward_consume"):
        assert library._backend_kernel(getattr(torch.ops.mok, name).default, cpu) is not None, name


def _forward_backward(args, kw):
    leaves = [a.detach().requires_grad_(a.is_floating_point()) if a is not None else None for a in args]
    out, w, _ = fused_moe(*leaves, **kw)
    (out.square().sum() + w.sum()).backward()
    return out, w, *[t.grad for t in leaves if t is not None and t.grad is not None]


def test_backend_kernels_are_called_directly_only_for_plain_tensors(monkeypatch):
    """With nothing but the backend key left below autograd, the autograd kernel and `_FusedMoeFunction`
    call the registered backend kernels themselves (forward, training forward, backward); the results are
    the dispatcher's. Under a dispatch mode (FakeTensorMode) or a torch function mode the dispatcher runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode

    args, kw = make_args(CASES[0], T=5, dtype=torch.float32)
    dispatched = (fused_moe(*args, **kw), _forward_backward(args, kw))
    calls = []
    _spies(monkeypatch, calls)
    direct = (fused_moe(*args, **kw), _forward_backward(args, kw))
    assert calls[0] == "fused_moe" and calls[1] == "fused_moe_train"
    assert calls[2] in ("fused_moe_backward", "fused_moe_backward_consume") and len(calls) == 3
    for a, b in zip((*dispatched[0], *dispatched[1]), (*direct[0], *direct[1]), strict=True):
        assert torch.equal(a, b)
    calls.clear()
    with FakeTensorMode() as mode:
        fake = fused_moe(*[mode.from_tensor(a) if a is not None else None for a in args], **kw)
    assert calls == [] and fake[0].shape == direct[0][0].shape

    # A torch function mode or a tensor subclass could act before the dispatcher: no direct call then.
    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Sub(torch.Tensor):
        pass

    from mok_compile.ops.library import _keyset_of

    assert _keyset_of(args).has(torch._C.DispatchKey.CPU)
    with Passing():
        assert _keyset_of(args) is None
    assert _keyset_of((*args, args[0].as_subclass(Sub))) is None
