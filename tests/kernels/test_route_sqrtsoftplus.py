"""DeepSeek-V4's router scores, sqrt(softplus(logits)), in the Triton routing kernels at the logits where softplus is
hard to get right: far below zero (where log(1 + exp(x)) computed naively is 0 and PyTorch's log1p is not), around
PyTorch's threshold 20 (past it softplus(x) is x), far above, and where softplus underflows to 0 in fp32 (the score's
gradient is then 0, not 0 / 0). The weights and d(logits) against PyTorch's softplus and the reference backward in
fp64. Run under TRITON_INTERPRET=1 in a subprocess, and on the GPU."""

import pytest

from tests.kernels.interpreted import background, run_interpreted, script_argv

pytest.importorskip("triton")

_CASE = r"""
import torch
from mok_compile.kernels.routing import route, route_backward
from mok_compile.ops import reference

LOGITS = [-200.0, -120.0, -60.0, -30.0, -17.0, -5.0, -1e-3, 0.0, 0.7, 5.0, 19.9, 20.0, 20.1, 35.0, 80.0, -90.0]

# The largest |got - want| over rel * |want| + floor: at most 1 within a few fp32 ulps (tl.exp and tl.log are not
# exactly libm's) or within `floor` of a value that fp32 cannot hold (exp(x) below fp32's denormals).
def excess(got, want, rel=1e-6, floor=1e-18):
    return ((got.double() - want.double()).abs() / (rel * want.double().abs() + floor)).max().item()

def compare(device):
    E = len(LOGITS)
    # Each row a rotation of LOGITS: every logit is picked in some row (top-k of 3 and of all 16).
    logits = torch.tensor([LOGITS[i:] + LOGITS[:i] for i in range(E)], dtype=torch.float32, device=device)
    res = {}
    for K in (3, E):
        kw = dict(top_k=K, routing="sqrtsoftplus_topk", softmax_fp32=True, renormalize=False, renorm_eps=0.0,
                  routed_scale=1.0, n_group=1, topk_group=1)
        w, ids, _, _ = route(logits, None, **kw, weights_dtype=torch.float32)
        # PyTorch's fp32 scores (0 where exp(x) underflows fp32, x < -104); the choice from the fp64 ones.
        want_w = torch.nn.functional.softplus(logits).sqrt().gather(1, ids)
        want_ids = torch.nn.functional.softplus(logits.double()).sqrt().topk(K, dim=-1).indices.sort(-1).values
        T = logits.shape[0]
        pair_pos = torch.arange(T * K, dtype=torch.int32, device=device)
        dw = torch.linspace(-1.0, 1.0, T * K, device=device).view(1, T * K)
        dl = route_backward(logits, ids, pair_pos, dw, None, routing="sqrtsoftplus_topk", renormalize=False,
                            renorm_eps=0.0, routed_scale=1.0)
        dl_truth = reference.routing_backward(logits.double(), None, ids, dw.view(T, K).double(),
                                              routing="sqrtsoftplus_topk", renormalize=False, renorm_eps=0.0,
                                              routed_scale=1.0)[0]
        res[K] = dict(ids_equal=bool(torch.equal(ids.sort(-1).values, want_ids)),
                      w_excess=excess(w, want_w), finite=bool(torch.isfinite(dl).all()),
                      dl_excess=excess(dl, dl_truth, rel=2e-6))
    return res
"""


def _check(results):
    assert sorted(map(int, results)) == [3, 16]  # int keys here, str ones through JSON
    for K, r in results.items():
        assert r["ids_equal"] and r["finite"], (K, r)
        assert r["w_excess"] <= 1 and r["dl_excess"] <= 1, (K, r)


_CPU_RUN = _CASE + "import json\nprint(json.dumps(compare('cpu')))\n"


@background(script_argv(_CPU_RUN))
def test_sqrtsoftplus_scores_and_gradients_at_extreme_logits():
    _check(run_interpreted(_CPU_RUN))


@pytest.mark.gpu
def test_sqrtsoftplus_scores_and_gradients_at_extreme_logits_on_the_gpu():
    scope = {}
    exec(_CASE, scope)
    _check(scope["compare"]("cuda"))
