"""The router kernel with a selection bias on every routing (it only chooses: the weights come from the unbiased
values), with a clamp-min renormalisation (Ernie 4.5: w / clamp(sum, min)), forward and backward, and with
group-limited selection on softmax probabilities by group max (DeepSeek-V2) or top-2 sum, against the reference.
Under TRITON_INTERPRET=1 in a subprocess (fp32 and fp16), and on the GPU in bf16."""

import pytest

from tests.kernels.interpreted import background, run_interpreted, script_argv

pytest.importorskip("triton")

_CASES = r"""
import torch
from tests.kernels.cases import generator
from mok_compile.kernels import routing
from mok_compile.kernels.dispatch import Dispatch
from mok_compile.ops import reference

def compare(device, low):
    res = []
    # (T, E, K, routing, logits dtype, renorm_min): each routing family with a bias; 16-bit logits and bias (the
    # biased scores are rounded as PyTorch rounds them); a clamp between the drawn tokens' sums, so that it holds
    # about half of them and no sum sits at it, where rounding decides the side (softmax; sigmoid), and one that holds
    # none.
    for T, E, K, kind, dtype, low_min in [(37, 32, 4, "softmax_topk", torch.float32, "median"),
                                          (40, 12, 3, "topk_sigmoid", low, "median"),
                                          (21, 16, 2, "topk_softmax", low, 0.0),
                                          (19, 16, 4, "sigmoid_grouped_topk", torch.float32, 1e-12)]:
        g = generator(T * 13 + E)  # fresh inputs on the GPU (tests/conftest.py)
        kw = dict(top_k=K, routing=kind, softmax_fp32=True, renormalize=True, renorm_eps=0.0, routed_scale=1.5,
                  n_group=1, topk_group=1)
        while True:  # redrawn while a K-th and (K+1)-th biased score tie (bf16 makes that likely): either pick is right
            logits = (torch.randn(T, E, generator=g) * 2).to(dtype).to(device)
            bias = torch.randn(E, generator=g) * (0.05 if kind in ("softmax_topk", "sigmoid_grouped_topk") else 1.0)
            bias = bias.to(dtype).to(device)
            choice, scores = reference.selection_scores(logits, bias, routing=kind, softmax_fp32=True, n_group=1,
                                                        topk_group=1)
            ranked = choice.sort(1, descending=True)[0]
            if not (ranked[:, K - 1] == ranked[:, K]).any():
                break
        r_ids = reference.route(logits, bias, x_dtype=torch.float32, weights_fp32=True, **kw)[1]
        w0 = scores.float().gather(1, r_ids)
        w0 = w0.sigmoid() if kind == "topk_sigmoid" else w0.softmax(-1) if kind == "topk_softmax" else w0
        if low_min == "median":  # halfway across the widest gap between sums in the middle half: no sum near it
            sums = w0.sum(-1).sort()[0]
            lo, hi = T // 4, 3 * T // 4
            k = lo + int((sums[lo + 1:hi + 1] - sums[lo:hi]).argmax())
            low_min = float(sums[k] + sums[k + 1]) / 2
        clamped = int((w0.sum(-1) < low_min).sum())
        disp = Dispatch.unsorted(E, K, T * K, device)
        w, ids, _, _ = routing.route(logits, bias, **kw, weights_dtype=torch.float32, dispatch=disp,
                                     renorm_min=low_min)
        r_w, r_ids = reference.route(logits, bias, x_dtype=torch.float32, weights_fp32=True, renorm_min=low_min,
                                     **kw)
        order, r_order = ids.sort(1)[1], r_ids.sort(1)[1]
        unbiased = reference.route(logits, None, x_dtype=torch.float32, weights_fp32=True, renorm_min=low_min, **kw)[1]
        # backward: d(logits) from d(topk_weights), against the reference's
        parts = torch.randn(2, T * K, generator=g).to(device)
        dl = routing.route_backward(logits, ids, disp.pair_pos, parts, None, routing=kind, renormalize=True,
                                    renorm_eps=0.0, routed_scale=1.5, renorm_min=low_min)
        d_w = parts.sum(0)[disp.pair_pos.long()].view(T, K)
        r_dl = reference.routing_backward(logits, w, ids, d_w.double(), routing=kind, renormalize=True,
                                          renorm_eps=0.0, routed_scale=1.5, renorm_min=low_min)[0]
        res.append(dict(case=[T, E, K, kind, str(dtype)], ids_equal=bool(torch.equal(ids.gather(1, order),
                                                                                        r_ids.gather(1, r_order))),
                        bias_changed_choice=bool((unbiased.sort(1)[0] != r_ids.sort(1)[0]).any()),
                        w_err=float((w.gather(1, order) - r_w.gather(1, r_order)).abs().max()),
                        dl_err=float((dl.double() - r_dl).abs().max() / r_dl.abs().max()), clamped=clamped))
    return res

def grouped(device):
    # Group-limited selection on softmax probabilities (DeepSeek-V2: group score = its max; V3's: its top-2 sum).
    res = {}
    T, E, K = 45, 16, 4
    g = generator(T * 17 + E)
    logits = (torch.randn(T, E, generator=g) * 2).to(device)
    picks = {}
    for group_top in (1, 2):
        kw = dict(top_k=K, routing="softmax_topk", softmax_fp32=True, renormalize=False, renorm_eps=0.0,
                  routed_scale=2.5, n_group=4, topk_group=2, group_top=group_top)
        w, ids, _, _ = routing.route(logits, None, **kw, weights_dtype=torch.float32)
        r_w, r_ids = reference.route(logits, None, x_dtype=torch.float32, weights_fp32=True, **kw)
        order, r_order = ids.sort(1)[1], r_ids.sort(1)[1]
        res[group_top] = dict(ids_equal=bool(torch.equal(ids.gather(1, order), r_ids.gather(1, r_order))),
                              w_err=float((w.gather(1, order) - r_w.gather(1, r_order)).abs().max()))
        picks[group_top] = ids.sort(1)[0]
    ungrouped = torch.topk(logits, K).indices.sort(1)[0]
    res["top1_vs_top2_differ"] = bool((picks[1] != picks[2]).any())
    res["groups_matter"] = bool((picks[1] != ungrouped).any())
    return res

def rounded_tie(device, low):
    # Expert 1's logit + bias exceeds expert 0's in fp32, but both round to the same 16-bit value: PyTorch sees a
    # tie (top-1 then takes the lower index, as the kernel does), so the kernel must round the sum too.
    logits = torch.tensor([[1.0, 1.0, -3.0, -3.0]]).to(low).to(device)
    eps = torch.finfo(low).eps
    bias = torch.tensor([0.0, eps / 8, 0.0, 0.0]).to(low).to(device)
    w, ids, _, _ = routing.route(logits, bias, top_k=1, routing="topk_sigmoid", softmax_fp32=True, renormalize=False,
                                 renorm_eps=0.0, routed_scale=1.0, n_group=1, topk_group=1, weights_dtype=torch.float32)
    summed = logits + bias
    return dict(bias_nonzero=bool(bias[1] > 0), tie=bool(summed[0, 0] == summed[0, 1]), id=int(ids[0, 0]))
"""


def _check_grouped(res):
    for group_top in ("1", "2"):
        assert res[group_top]["ids_equal"] and res[group_top]["w_err"] < 1e-6, res
    assert res["top1_vs_top2_differ"] and res["groups_matter"], res


def _check(results, tie):
    assert len(results) == 4
    for r in results:
        assert r["ids_equal"] and r["w_err"] < 1e-6 and r["dl_err"] < 1e-5, r
        if r["case"][3] != "sigmoid_grouped_topk":
            assert r["bias_changed_choice"], r
    clamped = {r["case"][3]: r["clamped"] for r in results}
    assert 0 < clamped["softmax_topk"] < 37 and 0 < clamped["topk_sigmoid"] < 40, clamped
    assert clamped["sigmoid_grouped_topk"] == 0
    assert tie == {"bias_nonzero": True, "tie": True, "id": 0}


def _run(device, low):
    return (f"import json\nprint(json.dumps([compare('{device}', torch.{low}), "
            f"rounded_tie('{device}', torch.{low}), grouped('{device}')]))\n")


_CPU_RUN = _CASES + _run("cpu", "float16")


@background(script_argv(_CPU_RUN))
def test_selection_bias_and_clamped_renorm():
    results, tie, groups = run_interpreted(_CPU_RUN)
    _check(results, tie)
    _check_grouped(groups)


@pytest.mark.gpu
def test_selection_bias_and_clamped_renorm_on_the_gpu():
    import torch

    scope = {}
    exec(_CASES, scope)
    _check(scope["compare"]("cuda", torch.bfloat16), scope["rounded_tie"]("cuda", torch.bfloat16))
    _check_grouped({str(k): v for k, v in scope["grouped"]("cuda").items()})
