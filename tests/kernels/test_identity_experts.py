"""Identity experts (`mok::fused_moe`'s `identity_experts`, LongCat-Flash's zero-computation experts) and zero experts
(`zero_experts`, Zaya's skip expert) in the Triton kernels: the router ranks E + Z choices, the sort gives the pairs
past the experts the last sorted positions, which no GEMM runs, and the combine adds each token's identity weight
times x (forward) or times grad_out (backward); an identity pair's d(weight) is <grad_out, x>. A zero pair adds
nothing and its d(weight) is 0. Forward, backward with and without the training forward's saved layout, against
the reference in fp32, for every routing family, at a token count one routing program holds and at one it does
not, with expert biases on both projections, and given ids naming identity experts; the gradients twice, for the
same bits. Run under TRITON_INTERPRET=1 in a subprocess (the Triton engine, and the CUTLASS engine's glue), and on
the GPU."""

import pytest
import torch

from tests.kernels.interpreted import background, compare_argv, run_compare

pytest.importorskip("triton")

_CASE = r"""
import os
import torch
from mok_compile.kernels import cutlass_gemm, moe
from mok_compile.ops import reference
from tests.kernels.cases import rel_err, small_layer

ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_grouped_topk", "topk_sigmoid", "sqrtsoftplus_topk")
NAMES = ("dx", "drouter", None, "dw1", "db1", "dw2", "db2")
KIND = "identity"  # or "zero" (the zero experts' tests replace this line)

def compare(device, seed, dtype=torch.float32):
    res = one_engine(device, seed, dtype)
    if device == "cpu":  # the CUTLASS engine's glue, PyTorch's CPU grouped_mm standing in (as interpret_runner does)
        cutlass_gemm.eligible = lambda x, w1, w2, I, **_: x.shape[1] % 8 == 0 and I % 8 == 0
        os.environ["MOK_GEMM_ENGINE"] = "cutlass"
        res.update({"cutlass/" + k: v for k, v in one_engine(device, seed, dtype, routings=ROUTINGS[:1]).items()})
    return res

def one_engine(device, seed, dtype, routings=ROUTINGS + ("given",)):
    g = torch.Generator().manual_seed(seed)
    res = {}
    for T in (5, 70):  # 70: more tokens than one routing program holds at 12 choices (64), so scan and scatter run
        H, E, Z, I, K = 32, 8, 4, 16, 3
        x, router, _, _, w1, _, w2, b2 = small_layer(T, H, E, I, g, device, dtype, choices=E + Z)
        b1 = (torch.randn(E, 2 * I, generator=g) * 0.1).to(device, dtype)
        tensors = (x, router, None, None, w1, b1, w2, b2)
        go = torch.randn(T, H, generator=g).to(device, dtype)
        gw = torch.randn(T, K, generator=g).to(device, dtype)
        for routing in routings if T < 64 else routings[:1]:
            kw = dict(top_k=K, routing=routing, renormalize=routing not in ("topk_softmax", "softmax_topk"),
                      routed_scale=1.5, **{KIND + "_experts": Z})
            if routing == "given":  # given ids (hash routing) naming identity experts too, one row an expert twice
                given = torch.randint(0, E + Z, (T, K), generator=g)
                given[0] = torch.tensor([E, E, 1])
                kw.update(routing="softmax_topk", expert_ids=given.to(device))
            out, w, ids = moe.fused_moe_forward(*tensors, **kw)
            r_out, r_w, r_ids = reference.fused_moe_reference(*tensors, **kw)
            *_, h, logits, layout, _ = moe.fused_moe_forward(*tensors, save_gate_up=True, **kw)
            kw.pop("expert_ids", None)  # the backward reads the forward's ids
            grads = moe.fused_moe_backward(go, gw, *tensors, w, ids, **kw)
            again = moe.fused_moe_backward(go, gw, *tensors, w, ids, **kw)
            r_grads = reference.fused_moe_backward_reference(go, gw, *tensors, w, ids, **kw)  # gw: in ids order
            saved = moe.fused_moe_backward(go, gw, *tensors, w, ids, gate_up_out=h, router_logits=logits,
                                           routing_layout=layout, **kw)
            res[f"{T}/{routing}"] = dict(
                ids_equal=bool(torch.equal(ids.sort(-1).values, r_ids.sort(-1).values)),
                both_kinds=bool((ids >= E).any() and (ids < E).any()),
                same_bits=all(torch.equal(a, b) for a, b in zip(grads, again) if a is not None),
                out=rel_err(out, r_out), w=rel_err(w.sort(-1).values, r_w.sort(-1).values),
                **{n: rel_err(a, b) for n, a, b in zip(NAMES, grads, r_grads) if n},
                **{"saved_" + n: rel_err(a, b) for n, a, b in zip(NAMES, saved, r_grads) if n})
    return res
"""


def _check(results, tol=2e-5, cases=7):
    assert len(results) == cases
    for name, r in results.items():
        assert r.pop("ids_equal") and r.pop("both_kinds") and r.pop("same_bits"), name
        assert max(r.values()) < tol, (name, r)


def _case(kind):
    return _CASE.replace('KIND = "identity"', f'KIND = "{kind}"')


@pytest.mark.parametrize("kind", [pytest.param(kind, marks=background(compare_argv(_case(kind))))
                                  for kind in ("identity", "zero")])
def test_identity_experts_interpreted(kind):
    """Also through the CUTLASS engine's glue (gathers, activation passes over every sorted row, the bias sums), with
    PyTorch's CPU grouped_mm standing in for CUTLASS."""
    _check(run_compare(_case(kind), "cpu"), cases=9)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["identity", "zero"])
def test_identity_experts_gpu(kind):
    _check(run_compare(_case(kind), "cuda"))


_COMBINE_CASE = r"""
import torch
from mok_compile.kernels.dispatch import combine

def compare(device, seed):
    g = torch.Generator().manual_seed(seed)
    res = {}
    for dtype, w_dtype in ((torch.float16, torch.float32), (torch.float16, torch.float16),
                           (torch.float32, torch.float32)):
        T, K, H, E, Z = 9, 3, 40, 4, 2
        y = torch.randn(T * K, H, generator=g).to(device, dtype)
        x = torch.randn(T, H, generator=g).to(device, dtype)
        w = torch.rand(T, K, generator=g).to(device, w_dtype)
        ids = torch.randint(0, E + Z, (T, K), generator=g).to(device)
        ids[0] = E  # a token all of whose pairs are identity pairs
        ids[1] = torch.arange(K) % E  # one with none
        y[torch.arange(T * K, device=device).view(T, K)[ids >= E]] = float("nan")  # identity rows: never read
        pos = torch.arange(T * K, device=device).view(T, K)
        out = combine(y, pos, w, None, T, K, dtype, topk_ids=ids, identity=(x, w, E, True)).cpu()
        # LongCat's rounding: the experts' weighted sum (in slot order, as the combine sums) rounded, the identity
        # term rounded, then added and rounded; on the CPU, whose ops are each rounded (a GPU's may fuse a * b + c)
        y, x, w, ids = y.cpu(), x.cpu(), w.cpu(), ids.cpu()
        product = y.view(T, K, H).float() * w.float().unsqueeze(-1)
        if w_dtype == dtype:  # weights in the input dtype: each product rounded (as HF multiplies in that dtype)
            product = product.to(dtype).float()
        product = torch.where((ids < E).unsqueeze(-1), product, 0.0)
        experts = product[:, 0]
        for k in range(1, K):
            experts = experts + product[:, k]
        s = w.masked_fill(ids < E, 0.0).sum(dim=-1, keepdim=True)
        want = experts.to(dtype) + (x * s).to(dtype)
        res[f"{dtype}/{w_dtype}"] = bool(torch.equal(out, want))
        # zero experts: their pairs' rows (NaN) are skipped, nothing else is added
        zero = combine(y.to(device), pos, w.to(device), None, T, K, dtype, topk_ids=ids.to(device),
                       identity=(None, None, E, False)).cpu()
        res[f"zero/{dtype}/{w_dtype}"] = bool(torch.equal(zero, experts.to(dtype)))
    return res
"""


@background(compare_argv(_COMBINE_CASE))
def test_identity_combine_rounds_as_longcat_interpreted():
    """The forward combine with identity pairs, bit for bit LongCat-Flash's rounding: the experts' weighted sum
    rounded to the output dtype, the identity term x * (identity weights' sum) rounded, then added; identity pairs'
    rows (NaN here) never read; in fp16 with fp32 and fp16 weights, and fp32. The same pairs as zero experts' add
    nothing: the experts' weighted sum, rounded."""
    keys = ["torch.float16/torch.float32", "torch.float16/torch.float16", "torch.float32/torch.float32"]
    assert run_compare(_COMBINE_CASE, "cpu") == dict.fromkeys(keys + ["zero/" + k for k in keys], True)


@pytest.mark.gpu
def test_identity_combine_rounds_as_longcat_gpu():
    assert all(run_compare(_COMBINE_CASE, "cuda").values())


@pytest.mark.gpu
@pytest.mark.parametrize("T, biases, kind", [(1, False, "identity"), (3, False, "identity"), (300, False, "identity"),
                                             (4096, False, "identity"), (3, True, "identity"),
                                             (4096, True, "identity"), (3, False, "zero"), (4096, True, "zero")])
def test_identity_experts_through_autograd_on_cuda(T, biases, kind, monkeypatch):
    """bf16 with LongCat-Flash's proportions (64 experts + 32 identity experts, top-12, an fp32 router, scaled
    weights), through the op's autograd: the first call runs the launches, the second captures CUDA graphs at few
    tokens (forward and backward), the third replays them, a fourth runs with the graphs off. Every call gives the
    same bits, within bf16 rounding of the reference. With expert biases too (which the GEMM engines of many rows
    add in other places than the Triton kernels). The same with the 32 choices as zero experts."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from mok_compile.ops import reference
    from tests.kernels.cases import four_autograd_calls, rel_err

    g = torch.Generator().manual_seed(T)
    H, I, E, Z, K = 256, 128, 64, 32, 12

    def rnd(*shape, scale, dtype=torch.bfloat16):
        return (torch.randn(shape, generator=g) * scale).to("cuda", dtype)

    x, router = rnd(T, H, scale=1.0), rnd(E + Z, H, scale=H ** -0.5, dtype=torch.float32)
    w1, w2 = rnd(E, 2 * I, H, scale=H ** -0.5), rnd(E, H, I, scale=I ** -0.5)
    b1, b2 = (rnd(E, 2 * I, scale=0.1), rnd(E, H, scale=0.1)) if biases else (None, None)
    go = rnd(T, H, scale=1.0)
    kw = dict(top_k=K, router_fp32=True, routed_scale=6.0, **{f"{kind}_experts": Z})
    weights = [t.clone().requires_grad_() for t in (router, w1, w2, *((b1, b2) if biases else ()))]

    def step():
        leaves = [x.clone().requires_grad_(), *weights]
        lx, lr, l1, l2, lb1, lb2 = leaves + [None] * (6 - len(leaves))
        out, w, ids = torch.ops.mok.fused_moe(lx, lr, None, None, l1, lb1, l2, lb2, **kw)
        return (out, w, ids, *torch.autograd.grad((out * go).sum(), leaves))

    out, w, ids, *grads = four_autograd_calls(step, T, monkeypatch)
    assert (ids >= E).any() and (ids < E).any()
    r_out, r_w, r_ids = reference.fused_moe_reference(x, router, None, None, w1, b1, w2, b2, **kw)
    assert torch.equal(ids.sort(-1).values, r_ids.sort(-1).values)
    assert rel_err(out, r_out) < 2e-2
    r_grads = reference.fused_moe_backward_reference(go, None, x, router, None, None, w1, b1, w2, b2, w, ids, **kw)
    for got, want in zip(grads, [r_grads[i] for i in (0, 1, 3, 5, *((4, 6) if biases else ()))]):
        assert got.dtype == want.dtype and rel_err(got, want) < 3e-2, rel_err(got, want)
