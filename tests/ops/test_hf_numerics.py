"""`mok::fused_moe` against the real Hugging Face MoE blocks (transformers' own modules).

Each HF block is rebuilt with its routed experts replaced by the op, the way the
compiler pass will do it: shared experts (Qwen2-MoE's gated one, DeepSeek-V3's
ungated one) stay HF modules added outside the op. Weights use std 0.2 (not HF's
0.02) so router gradients are real signal, not 1e-7 noise; GPT-OSS's and DeepSeek-V4's
gate_up use std 1 so both of their clamps are active. DeepSeek-V4 and LongCat-Flash (its
zero-computation experts: the op's identity experts; transformers >= 5.25) are checked where
transformers has them.

Tolerances (what each test asserts):
- fp32: output within 1e-5 relative (of the block's largest output), every gradient
  within 1e-5 relative Frobenius norm.
- bf16 output: no further from HF's default `grouped_mm` path than HF's own `eager`
  path is, with a floor of one bf16 rounding (2^-8) of the largest output.
- bf16 gradients: measured against fp64 truth (the HF block in fp64 on the same
  bf16 values, on tokens whose routing fp64 and bf16 agree on): the op's relative
  error is at most 1.5x HF's own bf16 autograd error, and below 1e-2.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from mok_compile import hf_blocks  # noqa: E402

FAMILIES = (hf_blocks.FAMILIES + hf_blocks.available(hf_blocks.NEWER_FAMILIES)
            + hf_blocks.available(hf_blocks.IDENTITY_FAMILIES) + hf_blocks.INFERENCE_FAMILIES)
H = hf_blocks.BlockSizes().hidden
T = 48


def _set_experts_impl(block, impl):
    block.experts.config._experts_implementation = impl
    return block


def _block(family, dtype=torch.float32, impl="grouped_mm"):
    """An HF block with large enough random weights, converted the way HF loads a bf16 model."""
    block = hf_blocks.make_block(family, experts_implementation=impl)
    hf_blocks.init_moe_weights_(block, std=0.2, seed=1)
    if family in ("gpt_oss", "deepseek_v4"):  # past their clamps' limits
        with torch.no_grad():
            block.experts.gate_up_proj.mul_(5.0)
    return hf_blocks.keep_fp32_parts_(family, block.to(dtype))


def _router(family, block):
    return block.router if family in ("gpt_oss", "granitemoe", "longcat_flash", "phimoe") else block.gate


def _routing(family, block, x2):
    """(logits, topk_weights, topk_ids) of the block's router, in whatever order it returns them (transformers
    5.17's Granite-MoE router returns ids, weights, logits)."""
    out = _router(family, block)(x2)
    ids = next(t for t in out if not t.is_floating_point())
    logits = next(t for t in out if t.is_floating_point() and t.shape[-1] != ids.shape[-1])  # [T, E] against [T, K]
    weights = next(t for t in out if t.is_floating_point() and t is not logits)
    return logits, weights, ids


def _hf(family, block, x):
    """The HF block's outputs that a model uses: hidden states, and GPT-OSS's router scores."""
    out = block(x)
    return tuple(out) if isinstance(out, tuple) else (out,)


def _op_call(family, block, x2, router_is_logits=False):
    """`mok::fused_moe` on the block's router and routed experts -> (out, topk_weights, topk_ids)."""
    tensors, kw = hf_blocks.op_arguments(family, block)
    if router_is_logits:  # logits computed outside (e.g. kept for the aux loss) and passed in
        logits = _routing(family, block, x2)[0]
        tensors = (logits, None) + tensors[2:]
        kw = {**kw, "router_is_logits": True}
    return torch.ops.mok.fused_moe(x2, *tensors, **kw)


def _with_op(family, block, x, router_is_logits=False):
    """The block's outputs with its router + routed experts replaced by the op; shared experts added outside."""
    x2 = x.reshape(-1, x.shape[-1])
    out, weights, _ = _op_call(family, block, x2, router_is_logits)
    if family == "qwen2_moe":
        out = out + F.sigmoid(block.shared_expert_gate(x2)) * block.shared_expert(x2)
    elif family in ("deepseek_v3", "ernie4_5_moe", "deepseek_v4"):
        out = out + block.shared_experts(x2)
    out = out.view(x.shape)
    return (out, weights) if family == "gpt_oss" else (out,)


def _check_routing(family, block, x, router_is_logits):
    """Same experts as the HF router, and the same weights in the same dtype (sorted by expert id).

    fp32 weights (Mixtral, DeepSeek-V3, fp32 models) agree to 1e-6; bf16 ones to one bf16 rounding.
    """
    with torch.no_grad():
        _, hf_w, hf_ids = _routing(family, block, x.view(-1, H))
        _, op_w, op_ids = _op_call(family, block, x.view(-1, H), router_is_logits)
    hf_w, hf_ids = _sorted_routing(hf_w, hf_ids)
    op_w, op_ids = _sorted_routing(op_w, op_ids)
    assert torch.equal(op_ids, hf_ids), "the op routes tokens to other experts than HF"
    assert op_w.dtype == hf_w.dtype
    atol = 1e-6 if op_w.dtype == torch.float32 else 2**-8 * max(1.0, hf_w.abs().max().item())
    torch.testing.assert_close(op_w, hf_w, rtol=0, atol=atol)


def _inputs(dtype, tokens=T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, tokens, H, generator=gen).to(dtype)
    probes = [torch.randn(1, tokens, H, generator=gen, dtype=torch.float64),
              torch.randn(tokens, hf_blocks.BlockSizes().top_k, generator=gen, dtype=torch.float64)]
    return x, probes


def _grads(outputs, probes, x, block):
    """Gradients of a fixed random linear loss on every output w.r.t. the input and ALL trained parameters (Ernie
    4.5's selection bias is a parameter without gradient)."""
    loss = sum((o.double() * p.view(o.shape)).sum() for o, p in zip(outputs, probes))
    params = [(n, p) for n, p in block.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [x] + [p for _, p in params])
    return dict(zip(["hidden_states"] + [n for n, _ in params], grads))


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _sorted_routing(weights, ids):
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


# ----------------------------------------------------------------------------- fp32


@pytest.mark.parametrize("router_form", ["weight", "logits"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_outputs_routing_and_grads(family, router_form):
    block = _block(family)
    x, probes = _inputs(torch.float32)
    x.requires_grad_()
    want = _hf(family, block, x)
    got = _with_op(family, block, x, router_is_logits=router_form == "logits")
    _check_routing(family, block, x, router_form == "logits")

    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * w.abs().max().item())

    grads_op, grads_hf = _grads(got, probes, x, block), _grads(want, probes, x, block)
    for name, g_hf in grads_hf.items():
        assert g_hf.norm() > 1e-3 * grads_hf["hidden_states"].norm(), f"grad {name} is negligible: test is vacuous"
        assert _rel(grads_op[name], g_hf) <= 1e-5, f"grad {name}: rel err {_rel(grads_op[name], g_hf):.2e}"


def test_families_are_available_from_the_version_that_has_their_form(monkeypatch):
    """LongCat-Flash counts as available from transformers 5.25 on (5.17's loops over its experts with `.item()`);
    a family of the oldest supported version does at any."""
    import transformers

    for version, want in (("5.17.0", ()), ("5.25.0", ("longcat_flash",)), ("6.0.0.dev0", ("longcat_flash",))):
        monkeypatch.setattr(transformers, "__version__", version)
        assert hf_blocks.available(["longcat_flash"]) == want
        assert hf_blocks.available(["mixtral"]) == ("mixtral",)


def test_deepseek_v4_clamps_are_active():
    """Guards the clamp-gradient coverage above for DeepSeek-V4: routed pre-activations cross both limits."""
    if "deepseek_v4" not in FAMILIES:
        pytest.skip("DeepSeek-V4 needs transformers >= 5.25")
    block = _block("deepseek_v4")
    x, _ = _inputs(torch.float32)
    x2 = x.view(-1, H)
    _, _, ids = block.gate(x2)
    e = block.experts
    gate, up = torch.einsum("th,tkfh->tkf", x2, e.gate_up_proj[ids]).chunk(2, dim=-1)
    assert (gate > e.limit).any() and (up > e.limit).any() and (up < -e.limit).any()
    assert (gate < e.limit).float().mean() > 0.5


def test_gpt_oss_clamps_are_active():
    """Guards the clamp-gradient coverage above: routed GPT-OSS pre-activations cross both limits."""
    block = _block("gpt_oss")
    x, _ = _inputs(torch.float32)
    x2 = x.view(-1, H)
    _, _, ids = block.router(x2)
    e = block.experts
    h = torch.einsum("th,tkhf->tkf", x2, e.gate_up_proj[ids]) + e.gate_up_proj_bias[ids]
    gate, up = h[..., ::2], h[..., 1::2]
    assert (gate > e.limit).any() and (up > e.limit).any() and (up < -e.limit).any()
    assert (gate < e.limit).float().mean() > 0.5


# ----------------------------------------------------------------------------- bf16


@pytest.mark.parametrize("router_form", ["weight", "logits"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_outputs_within_hf_spread(family, router_form):
    grouped = _block(family, torch.bfloat16, "grouped_mm")
    eager = _set_experts_impl(copy.deepcopy(grouped), "eager")
    x, _ = _inputs(torch.bfloat16)
    with torch.no_grad():
        want = _hf(family, grouped, x)
        other = _hf(family, eager, x)
        got = _with_op(family, grouped, x, router_is_logits=router_form == "logits")
    _check_routing(family, grouped, x, router_form == "logits")

    for g, w, o in zip(got, want, other):
        assert g.dtype == w.dtype == torch.bfloat16
        spread = (o.float() - w.float()).abs().max().item()
        floor = 2**-8 * w.float().abs().max().item()
        err = (g.float() - w.float()).abs().max().item()
        assert err <= max(spread, floor), f"|op - HF grouped_mm| = {err} > HF eager spread {spread} / floor {floor}"


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_grads_as_accurate_as_hf(family):
    """In bf16 the op's gradients are no worse than HF's own bf16 autograd, judged against fp64."""
    if family == "inkling2":
        pytest.skip("Inkling2's router casts its input to fp32 and not its weight: its block has no fp64 run")
    grouped = _block(family, torch.bfloat16, "grouped_mm")
    truth_block = _set_experts_impl(copy.deepcopy(grouped).double(), "eager")  # grouped_mm has no fp64
    x, _ = _inputs(torch.bfloat16, tokens=64)
    with torch.no_grad():  # keep tokens whose routing does not flip between bf16 and fp64 rounding
        ids16 = _routing(family, grouped, x[0])[2].sort(-1)[0]
        ids64 = _routing(family, truth_block, x[0].double())[2].sort(-1)[0]
    keep = (ids16 == ids64).all(-1)
    assert keep.sum() >= 48, f"only {keep.sum()} tokens route the same in bf16 and fp64"
    x = x[:, keep].contiguous()
    _, probes = _inputs(torch.bfloat16, tokens=x.shape[1], seed=1)

    x16, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    truth = _grads(_hf(family, truth_block, x64), probes, x64, truth_block)
    hf = _grads(_hf(family, grouped, x16), probes, x16, grouped)
    op = _grads(_with_op(family, grouped, x16), probes, x16, grouped)
    for name, g in truth.items():
        err_hf, err_op = _rel(hf[name], g), _rel(op[name], g)
        assert err_op <= 1.5 * err_hf, f"grad {name}: op error {err_op:.2e} vs HF bf16 error {err_hf:.2e}"
        assert err_op <= 1e-2, f"grad {name}: op error {err_op:.2e}"


def _gate_ids(block, x):
    """The top-k ids the block's router (`block.gate`) chose on x, from one eager forward."""
    seen = []
    handle = block.gate.register_forward_hook(
        lambda _module, _args, out: seen.append(next(t for t in out if not t.is_floating_point())))
    try:
        with torch.no_grad():
            block(x)
    finally:
        handle.remove()
    return seen[0].sort(-1)[0]


@pytest.mark.parametrize("family", hf_blocks.available(hf_blocks.POST_NORM_FAMILIES))
def test_post_norm_bf16_grads_as_accurate_as_hf(family):
    """The post-norm blocks (Muse Spark's router reads another tensor than its experts, which `op_arguments` has no
    form for) fused through backend="mok" over aot_eager: in bf16 the op's gradients are no worse than HF's own bf16
    autograd, judged against fp64, on the tokens that the two dtypes route alike."""
    from torch._dynamo.utils import counters

    block16 = _block(family, torch.bfloat16)
    truth_block = _set_experts_impl(copy.deepcopy(block16).double(), "eager")  # grouped_mm has no fp64
    x = torch.randn(1, 64, H, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    keep = (_gate_ids(block16, x) == _gate_ids(truth_block, x.double())).all(-1)
    assert keep.sum() >= 48, f"only {keep.sum()} tokens route the same in bf16 and fp64"
    x = x[:, keep].contiguous()
    probes = [torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)]

    torch._dynamo.reset()
    before = counters["mok"]["fused_moe"]
    compiled = torch.compile(block16, backend="mok", options={"compiler": "aot_eager"})
    x16, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    truth = _grads(_hf(family, truth_block, x64), probes, x64, truth_block)
    hf = _grads(_hf(family, block16, x16), probes, x16, block16)
    x16 = x.clone().requires_grad_()
    op = _grads(_hf(family, compiled, x16), probes, x16, block16)
    assert counters["mok"]["fused_moe"] == before + 1, dict(counters["mok"])
    for name, g in truth.items():
        err_hf, err_op = _rel(hf[name], g), _rel(op[name], g)
        assert err_op <= 1.5 * err_hf, f"grad {name}: op error {err_op:.2e} vs HF bf16 error {err_hf:.2e}"
        assert err_op <= 1e-2, f"grad {name}: op error {err_op:.2e}"


# ----------------------------------------------------------------------------- Llama4 (weight on input)
#
# Llama4TextMoe runs every expert on every token, on the input times the router's sigmoid score (0 for experts
# outside the top-k, whose output is then exactly 0), and sums over experts. The op computes the same with
# routing="topk_sigmoid", weight_on_input=True on the routed pairs only; the shared expert stays outside.


def _llama4_block(dtype=torch.float32, top_k=1):
    block = hf_blocks.make_block("llama4", hf_blocks.BlockSizes(top_k=top_k))
    hf_blocks.init_moe_weights_(block, std=0.2, seed=1)
    return block.to(dtype)


def _llama4_hf(block, x):
    """Llama4TextMoe's hidden-state output ([T, H], flattened by HF) in x's shape."""
    return (block(x)[0].view(x.shape),)


def _llama4_op_call(block, x2, router_is_logits=False):
    tensors, kw = hf_blocks.op_arguments("llama4", block)
    if router_is_logits:
        tensors = (block.router(x2)[1], None) + tensors[2:]
        kw = {**kw, "router_is_logits": True}
    return torch.ops.mok.fused_moe(x2, *tensors, **kw)


def _llama4_with_op(block, x, router_is_logits=False):
    """Llama4TextMoe's hidden-state output with router + routed experts replaced by the op."""
    x2 = x.reshape(-1, x.shape[-1])
    routed, _, _ = _llama4_op_call(block, x2, router_is_logits)
    out = block.shared_expert(x2) + routed  # HF: shared_expert(x).add_(routed)
    return (out.view(x.shape),)


def _check_llama4_routing(block, x, router_is_logits):
    """The op picks HF's experts with HF's scores (the chosen entries of Llama4Router's scores), bit for bit."""
    x2 = x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        scores, logits = block.router(x2)
        _, op_w, op_ids = _llama4_op_call(block, x2, router_is_logits)
    hf_ids = torch.topk(logits, block.top_k, dim=-1)[1]
    assert torch.equal(op_ids, hf_ids), "the op routes tokens to other experts than HF"
    hf_w = scores.gather(1, hf_ids)
    assert op_w.dtype == hf_w.dtype == x.dtype
    assert torch.equal(op_w, hf_w)
    # Every other expert gets score 0 in HF (sigmoid(-inf)): they contribute nothing there.
    assert scores.sum(-1).sub(hf_w.sum(-1)).abs().max() == 0


@pytest.mark.parametrize("router_form", ["weight", "logits"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_llama4_fp32_outputs_routing_and_grads(top_k, router_form):
    block = _llama4_block(top_k=top_k)
    x, probes = _inputs(torch.float32)
    x.requires_grad_()
    want = _llama4_hf(block, x)
    got = _llama4_with_op(block, x, router_is_logits=router_form == "logits")
    _check_llama4_routing(block, x, router_form == "logits")
    assert got[0].dtype == want[0].dtype and got[0].shape == want[0].shape
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5 * want[0].abs().max().item())

    grads_op, grads_hf = _grads(got, probes, x, block), _grads(want, probes, x, block)
    assert {"router.weight", "experts.gate_up_proj", "experts.down_proj"} <= set(grads_hf)
    for name, g_hf in grads_hf.items():
        assert g_hf.norm() > 1e-3 * grads_hf["hidden_states"].norm(), f"grad {name} is negligible: test is vacuous"
        assert _rel(grads_op[name], g_hf) <= 1e-5, f"grad {name}: rel err {_rel(grads_op[name], g_hf):.2e}"


@pytest.mark.parametrize("router_form", ["weight", "logits"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_llama4_bf16_outputs_bitwise(top_k, router_form):
    """In bf16 the op reproduces Llama4TextMoe bit for bit: same routing ops, the same rounding of x * score,
    and a sum over at most two nonzero expert outputs (HF's other terms are exact zeros)."""
    block = _llama4_block(torch.bfloat16, top_k=top_k)
    x, _ = _inputs(torch.bfloat16)
    with torch.no_grad():
        want = _llama4_hf(block, x)[0]
        got = _llama4_with_op(block, x, router_is_logits=router_form == "logits")[0]
    _check_llama4_routing(block, x, router_form == "logits")
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want), f"max |op - HF| = {(got.float() - want.float()).abs().max().item()}"


@pytest.mark.parametrize("top_k", [1, 2])
def test_llama4_bf16_grads_as_accurate_as_hf(top_k):
    """bf16 gradients no worse than HF's own bf16 autograd, judged against the HF block in fp64."""
    block = _llama4_block(torch.bfloat16, top_k=top_k)
    truth_block = copy.deepcopy(block).double()
    x, _ = _inputs(torch.bfloat16, tokens=64)
    with torch.no_grad():  # keep tokens whose routing does not flip between bf16 and fp64 rounding
        ids16 = torch.topk(block.router(x[0])[1], top_k, dim=-1)[1].sort(-1)[0]
        ids64 = torch.topk(truth_block.router(x[0].double())[1], top_k, dim=-1)[1].sort(-1)[0]
    keep = (ids16 == ids64).all(-1)
    assert keep.sum() >= 48, f"only {keep.sum()} tokens route the same in bf16 and fp64"
    x = x[:, keep].contiguous()
    _, probes = _inputs(torch.bfloat16, tokens=x.shape[1], seed=1)

    x16, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    truth = _grads(_llama4_hf(truth_block, x64), probes, x64, truth_block)
    hf = _grads(_llama4_hf(block, x16), probes, x16, block)
    op = _grads(_llama4_with_op(block, x16), probes, x16, block)
    for name, g in truth.items():
        err_hf, err_op = _rel(hf[name], g), _rel(op[name], g)
        assert err_op <= 1.5 * err_hf, f"grad {name}: op error {err_op:.2e} vs HF bf16 error {err_hf:.2e}"
        assert err_op <= 1e-2, f"grad {name}: op error {err_op:.2e}"


# ----------------------------------------------------------------------------- DeepSeek-V4's hash routing
#
# DeepseekV4HashRouter looks each token's experts up by its id (`tid2eid[input_ids]`) and weights them by the
# sqrt-softplus scores gathered there; the op takes those ids as `expert_ids`. The table names one expert twice for
# some tokens (HF then runs that expert twice).


def _hash_block(dtype=torch.float32, impl="grouped_mm"):
    modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    cfg = hf_blocks.make_config("deepseek_v4", num_layers=2, mlp_layer_types=["hash_moe", "moe"])
    cfg._experts_implementation = impl
    block = hf_blocks.init_moe_weights_(modeling.DeepseekV4SparseMoeBlock(cfg, layer_idx=0), std=0.2, seed=1)
    E, K = hf_blocks.BlockSizes().experts, hf_blocks.BlockSizes().top_k
    with torch.no_grad():
        block.experts.gate_up_proj.mul_(5.0)
        table = torch.randint(0, E, (cfg.vocab_size, K), generator=torch.Generator().manual_seed(2))
        table[::3, 1] = table[::3, 0]
        block.gate.tid2eid.copy_(table)
    return block.to(dtype).eval()


def _hash_inputs(tokens=T):
    ids = torch.randint(0, 128, (1, tokens), generator=torch.Generator().manual_seed(3))
    return ids


def _hash_with_op(block, x, input_ids):
    x2 = x.reshape(-1, x.shape[-1])
    tensors, kw = hf_blocks.op_arguments("deepseek_v4", block)
    expert_ids = block.gate.tid2eid[input_ids.reshape(-1)]
    out, _, _ = torch.ops.mok.fused_moe(x2, *tensors, **kw, expert_ids=expert_ids)
    return ((out + block.shared_experts(x2)).view(x.shape),)


def test_deepseek_v4_hash_block_fp32_outputs_and_grads():
    block = _hash_block()
    x, probes = _inputs(torch.float32)
    input_ids = _hash_inputs()
    table = block.gate.tid2eid[input_ids.reshape(-1)]
    assert (table[:, 0] == table[:, 1]).any()  # some token runs one expert twice
    x.requires_grad_()
    want, got = (block(x, input_ids),), _hash_with_op(block, x, input_ids)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5 * want[0].abs().max().item())
    grads_op, grads_hf = _grads(got, probes, x, block), _grads(want, probes, x, block)
    for name, g_hf in grads_hf.items():
        assert g_hf.norm() > 1e-3 * grads_hf["hidden_states"].norm(), f"grad {name} is negligible: test is vacuous"
        assert _rel(grads_op[name], g_hf) <= 1e-5, f"grad {name}: rel err {_rel(grads_op[name], g_hf):.2e}"


def test_deepseek_v4_hash_block_bf16_within_hf_spread():
    grouped = _hash_block(torch.bfloat16)
    eager = _set_experts_impl(copy.deepcopy(grouped), "eager")
    x, _ = _inputs(torch.bfloat16)
    input_ids = _hash_inputs()
    with torch.no_grad():
        want, other, got = grouped(x, input_ids), eager(x, input_ids), _hash_with_op(grouped, x, input_ids)[0]
    spread = (other.float() - want.float()).abs().max().item()
    floor = 2**-8 * want.float().abs().max().item()
    err = (got.float() - want.float()).abs().max().item()
    assert got.dtype == torch.bfloat16 and err <= max(spread, floor), (err, spread, floor)
