"""`mok::fused_moe` with a post-expert norm (`post_norm`: Ergo's per-expert RMSNorm, Muse Spark's input-scaled one)
on the CPU kernels.

Each pair's expert output is normalised before its routing weight; the norm's weight gets a gradient. Checked in
fp64 against the dense oracle of moe_cases.py (output, routing weights, every gradient, the norm weight's included),
with gradcheck, the reference's hand-written backward against autograd through its forward, the C++ kernel against
the reference in bf16 and fp32, the reference's norm against HF's own norm modules bit for bit, through
torch.compile with dynamic tokens, at zero tokens and in the export decomposition; bad input fails with an error
that names it.
"""

import dataclasses

import pytest
import torch

from mok_compile.export.decompose import EXPERTS_FORMS, fused_moe_decomposed
from mok_compile.ops import reference

from .moe_cases import (CASES_BY_NAME, DIFFERENTIABLE, check_learned_against_the_dense_oracle,
                         check_learned_compiles_with_dynamic_tokens, check_learned_reference_backward,
                         gradcheck_learned, make_args)

fused_moe = torch.ops.mok.fused_moe.default


@dataclasses.dataclass(frozen=True)
class Norm:
    kind: str
    per_expert: bool
    offset: float = 0.0
    eps: float = 1e-6

    def __str__(self):
        return f"{self.kind}_{'per_expert' if self.per_expert else 'shared'}_{self.offset:g}"


NORMS = [Norm("rms", per_expert=True), Norm("scaled_rms", per_expert=False, offset=1.0, eps=1e-5),
         Norm("rms", per_expert=False, offset=0.5), Norm("scaled_rms", per_expert=True)]
NORM_CASES = [CASES_BY_NAME[n] for n in ("silu_transposed", "relu2", "sigmoid_deepseek_v3", "topk_softmax_logits")]


def _normed(case, norm, T=6, dtype=torch.float64, seed=0, requires_grad=False, weight_dtype=None):
    """The case's arguments and keywords with `norm`, its weight around 0 (offset 1) or around 1 (offset 0)."""
    args, kw = make_args(case, T=T, dtype=dtype, seed=seed, requires_grad=requires_grad)
    H = args[0].shape[1]
    gen = torch.Generator().manual_seed(seed + 11)
    shape = (case.num_experts, H) if norm.per_expert else (H,)
    weight = torch.rand(shape, generator=gen, dtype=torch.float64) * 0.8 - 0.4 + (1.0 - norm.offset)
    weight = weight.to(weight_dtype or dtype or case.dtype).requires_grad_(requires_grad)
    return args, {**kw, "post_norm": norm.kind, "post_norm_eps": norm.eps, "post_norm_offset": norm.offset,
                  "post_norm_weight": weight}


def _differentiable(args, kw):
    return [args[i] for i in DIFFERENTIABLE if args[i] is not None] + [kw["post_norm_weight"]]


@pytest.mark.parametrize("norm", NORMS, ids=str)
@pytest.mark.parametrize("case", NORM_CASES, ids=str)
def test_post_norm_matches_the_dense_oracle(case, norm):
    """fp64: the output, the weights (by expert) and every gradient, the norm weight's included, equal the
    oracle's."""
    args, kw = _normed(case, norm, requires_grad=True)
    check_learned_against_the_dense_oracle(args, kw, "post_norm_weight")


@pytest.mark.parametrize("norm", NORMS[:2], ids=str)
def test_post_norm_gradcheck(norm):
    args, kw = _normed(NORM_CASES[0], norm, T=4, requires_grad=True)
    assert gradcheck_learned(args, kw, "post_norm_weight")


@pytest.mark.parametrize("norm", NORMS, ids=str)
def test_reference_backward_is_autograd_through_the_reference_forward(norm):
    """The reference's hand-written backward (the oracle of the kernels) against autograd through its forward."""
    args, kw = _normed(NORM_CASES[2], norm, requires_grad=True)
    check_learned_reference_backward(args, kw, "post_norm_weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("norm", NORMS, ids=str)
@pytest.mark.parametrize("case", NORM_CASES[:2], ids=str)
def test_cpu_kernel_matches_the_reference(case, norm, dtype):
    """The C++ kernel's forward is the reference's bit for bit (the same ops per expert), its gradients within
    an fp32 rounding; the norm weight's gradient takes the weight's dtype (fp32 for Ergo's, bf16 for Muse's)."""
    weight_dtype = torch.float32 if norm.kind == "rms" else dtype
    args, kw = _normed(case, norm, T=23, dtype=dtype, seed=3, weight_dtype=weight_dtype)
    out, w, ids = fused_moe(*args, **kw)
    ref = reference.fused_moe_reference(*args, **kw)
    for a, b in zip((out, w, ids), ref):
        assert torch.equal(a, b)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    grads = torch.ops.mok.fused_moe_backward(go, None, *args, w, ids, **kw)
    ref_grads = reference.fused_moe_backward_reference(go, None, *args, w, ids, **kw)
    for g, r in zip(grads, ref_grads, strict=True):
        assert (g is None) == (r is None)
        if g is not None:
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    assert grads[8].dtype == weight_dtype and grads[8].abs().sum() > 0


def test_without_the_norm_nothing_changes():
    """post_norm='none' is the op without the feature, and its backward has no slot for a norm weight."""
    args, kw = make_args(NORM_CASES[0])
    plain = fused_moe(*args, **kw)
    normed = fused_moe(*args, **_normed(NORM_CASES[0], NORMS[0])[1])
    assert not torch.allclose(plain[0], normed[0])
    out, w, ids = plain
    grads = torch.ops.mok.fused_moe_backward(torch.ones_like(out), None, *args, w, ids, **kw)
    assert len(grads) == 9 and grads[8] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_norms_are_hf_norms(dtype):
    """`reference.apply_post_norm` is transformers' Ergo and Muse Spark norms bit for bit, on rows of the experts'
    dtype (the pass reads those modules' graphs as these kinds)."""
    ergo = pytest.importorskip("transformers.models.ergo.modeling_ergo")
    muse = pytest.importorskip("transformers.models.muse_spark.modeling_muse_spark")
    E, H = 4, 64
    gen = torch.Generator().manual_seed(0)
    y = (torch.randn(40, H, generator=gen) * 3).to(dtype)
    ids = torch.randint(0, E, (40,), generator=gen)
    cfg = type("Cfg", (), {"num_experts": E, "hidden_size": H, "rms_norm_eps": 1e-6})()
    ergo_norm = ergo.ErgoExpertNorm(cfg)
    muse_norm = muse.MuseSparkTextInputScaledRMSNorm(H, eps=1e-5).to(dtype)
    with torch.no_grad():
        ergo_norm.weight.copy_(torch.rand(E, H, generator=gen) + 0.5)
        muse_norm.weight.copy_(torch.rand(H, generator=gen) - 0.5)
        want = ergo_norm(y, ids)
        got = torch.stack([reference.apply_post_norm(y[i:i + 1], reference.expert_post_norm_scale(
            ergo_norm.weight, int(ids[i]), 0.0), kind="rms", eps=1e-6)[0] for i in range(len(ids))])
        assert torch.equal(got, want)
        g = reference.post_norm_scale(muse_norm.weight, 1.0)
        assert torch.equal(reference.apply_post_norm(y, g, kind="scaled_rms", eps=1e-5), muse_norm(y))


def test_post_norm_compiles_with_dynamic_tokens():
    """The fake kernels take the norm weight: compiled (aot_eager, dynamic token count), forward and backward as
    eager."""
    args, kw = _normed(NORM_CASES[0], NORMS[1], T=7, requires_grad=True)
    check_learned_compiles_with_dynamic_tokens(args, kw, "post_norm_weight")


def test_post_norm_at_zero_tokens():
    args, kw = _normed(NORM_CASES[0], NORMS[0], T=0, requires_grad=True)
    out, w, ids = fused_moe(*args, **kw)
    assert out.shape == (0, 12) and w.shape == ids.shape == (0, 2)
    grads = torch.autograd.grad(out.sum(), _differentiable(args, kw))
    assert all(not g.any() for g in grads) and grads[-1].shape == kw["post_norm_weight"].shape


@pytest.mark.parametrize("norm", NORMS[:2], ids=str)
@pytest.mark.parametrize("form", EXPERTS_FORMS)
def test_post_norm_in_the_export_decomposition(form, norm):
    args, kw = _normed(CASES_BY_NAME["sigmoid_deepseek_v3"], norm)
    out, w, ids = fused_moe(*args, **kw)
    d_out, d_w, d_ids = fused_moe_decomposed(*args, experts_form=form, **kw)
    assert torch.equal(d_ids, ids)
    torch.testing.assert_close(d_w, w, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(d_out, out, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("change, match", [
    ({"post_norm_weight": None}, r"post_norm='rms' with post_norm_weight=None"),
    ({"post_norm": "none"}, r"post_norm='none' with post_norm_weight=a tensor"),
    ({"post_norm": "layer"}, r"post_norm='layer' is not one of"),
    ({"post_norm_weight": torch.ones(5, 12, dtype=torch.float64)}, r"must be \[H=12\] or \[E=4, H=12\]"),
    ({"post_norm_weight": torch.ones(12, dtype=torch.int64)}, "post_norm_weight has unsupported dtype"),
    ({"post_norm_eps": -1.0}, "post_norm_eps must be a finite number >= 0"),
    ({"post_norm_offset": float("nan")}, "post_norm_offset must be finite"),
    ({"weight_on_input": True}, "post_norm is not supported with weight_on_input"),
])
def test_bad_post_norm_is_named(change, match):
    args, kw = _normed(NORM_CASES[0], NORMS[0])
    with pytest.raises(ValueError, match=match):
        fused_moe(*args, **{**kw, **change})


def test_post_norm_with_a_down_bias_is_refused():
    args, kw = _normed(CASES_BY_NAME["silu_bias"], NORMS[0])
    with pytest.raises(ValueError, match="post_norm is not supported with down_bias"):
        fused_moe(*args, **kw)
