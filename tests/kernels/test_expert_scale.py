"""A per-expert weight scale (`mok::fused_moe`'s `expert_scale`, Gemma 4's `per_expert_scale`) in the Triton kernels:
the routing kernel multiplies each weight by its expert's value, and the routing backward writes each pair's part of
d(expert_scale) at its sorted position, summed per expert in sorted order. Forward, backward with and without the
training forward's saved layout, against the reference in fp32, for every routing family, at a token count one
routing program holds and at one it does not; the scale's gradient twice, for the same bits. Run under
TRITON_INTERPRET=1 in a subprocess, and on the GPU."""

import pytest
import torch

from tests.kernels.interpreted import background, compare_argv, run_compare

pytest.importorskip("triton")

_CASE = r"""
import torch
from mok_compile.kernels import moe
from mok_compile.ops import reference
from tests.kernels.cases import rel_err, small_layer

ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_grouped_topk", "topk_sigmoid", "sqrtsoftplus_topk")
NAMES = ("dx", "drouter", None, "dw1", None, "dw2", "db2", "dscale")

def compare(device, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    res = {}
    for T in (5, 70):  # 70: more tokens than one routing program holds at E = 8 (64), so scan and scatter run
        H, E, I, K = 32, 8, 16, 3
        tensors = small_layer(T, H, E, I, g, device, dtype)
        scale = (torch.rand(E, generator=g) + 0.5).to(device)
        go = torch.randn(T, H, generator=g).to(device, dtype)
        gw = torch.randn(T, K, generator=g).to(device, dtype)
        for routing in ROUTINGS if T < 64 else ROUTINGS[::4]:
            kw = dict(top_k=K, routing=routing, renormalize=routing != "topk_softmax", routed_scale=1.5,
                      renorm_eps=1e-20, expert_scale=scale)
            out, w, ids = moe.fused_moe_forward(*tensors, **kw)
            r_out, r_w, r_ids = reference.fused_moe_reference(*tensors, **kw)
            grads = moe.fused_moe_backward(go, gw, *tensors, w, ids, **kw)
            again = moe.fused_moe_backward(go, gw, *tensors, w, ids, **kw)
            r_grads = reference.fused_moe_backward_reference(go, gw, *tensors, w, ids, **kw)  # gw: in ids order
            *_, h, logits, layout, _ = moe.fused_moe_forward(*tensors, save_gate_up=True, **kw)
            saved = moe.fused_moe_backward(go, gw, *tensors, w, ids, gate_up_out=h, router_logits=logits,
                                           routing_layout=layout, **kw)
            # A bf16 parameter, as Gemma 4's: its gradient in bf16 (rounded from fp32 sums in different orders).
            low = dict(kw, expert_scale=scale.bfloat16())
            lo_w, lo_ids = moe.fused_moe_forward(*tensors, **low)[1:]
            lo_grad = moe.fused_moe_backward(go, gw, *tensors, lo_w, lo_ids, **low)[7]
            r_lo_grad = reference.fused_moe_backward_reference(go, gw, *tensors, lo_w, lo_ids, **low)[7]
            res[f"{T}/{routing}"] = dict(
                ids_equal=bool(torch.equal(ids.sort(-1).values, r_ids.sort(-1).values)),
                same_bits=bool(torch.equal(grads[7], again[7])), dscale_dtype=str(lo_grad.dtype),
                bf16_dscale=rel_err(lo_grad, r_lo_grad),
                out=rel_err(out, r_out), w=rel_err(w.sort(-1).values, r_w.sort(-1).values),
                **{n: rel_err(a, b) for n, a, b in zip(NAMES, grads, r_grads) if n},
                **{"saved_" + n: rel_err(a, b) for n, a, b in zip(NAMES, saved, r_grads) if n})
    return res
"""


def _check(results, tol=2e-5):
    assert len(results) == 7
    for name, r in results.items():
        assert r.pop("ids_equal") and r.pop("same_bits"), name
        assert r.pop("dscale_dtype") == "torch.bfloat16", name
        assert r.pop("bf16_dscale") < 1e-2, (name, r)  # a bf16 rounding (2^-8) apart at most
        assert max(r.values()) < tol, (name, r)


@background(compare_argv(_CASE))
def test_expert_scale_interpreted():
    _check(run_compare(_CASE, "cpu"))


@pytest.mark.gpu
def test_expert_scale_gpu():
    _check(run_compare(_CASE, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 3, 300])
def test_expert_scale_through_autograd_on_cuda(T, monkeypatch):
    """bf16 at Gemma 4's expert count (128, top-8), through the op's autograd: the first call runs the launches, the
    second captures CUDA graphs at few tokens (forward and backward), the third replays them, a fourth runs with the
    graphs off. Every call gives the same bits, within bf16 rounding of the reference, and the scale's gradient in
    its own dtype."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from mok_compile.ops import reference
    from tests.kernels.cases import learned_tensor_autograd, rel_err

    H, I, E, K = 256, 128, 128, 8
    kw = dict(top_k=K, renormalize=True, activation="gelu_tanh")
    (x, router, w1, w2, scale, go), (out, w, ids, *grads) = learned_tensor_autograd(
        T, H, I, E, kw, "expert_scale", lambda rnd, g: (torch.rand(E, generator=g) + 0.5).to("cuda", torch.bfloat16),
        monkeypatch)
    r_out, r_w, r_ids = reference.fused_moe_reference(x, router, None, None, w1, None, w2, None, **kw,
                                                      expert_scale=scale)
    assert torch.equal(ids.sort(-1).values, r_ids.sort(-1).values)
    assert rel_err(out, r_out) < 2e-2
    r_grads = reference.fused_moe_backward_reference(go, None, x, router, None, None, w1, None, w2, None, w, ids,
                                                     **kw, expert_scale=scale)
    for got, want in zip(grads, [r_grads[i] for i in (0, 1, 3, 5, 7)]):
        assert got.dtype == want.dtype and rel_err(got, want) < 3e-2, rel_err(got, want)
