"""`routing.route_backward` storing d(logits) in the router's dtype (what the backward does for a 16-bit router
without a bias: one cast launch less) gives bit for bit the fp32 result cast afterwards, as before. Run under
TRITON_INTERPRET=1 in a subprocess in fp16 (the interpreter's bf16 is not reliable), and on the GPU in bf16."""

import pytest

from tests.kernels.interpreted import run_interpreted

pytest.importorskip("triton")

_CASES = r"""
import torch
from tests.kernels.cases import generator
from mok_compile.kernels.routing import route_backward

def compare(device, low):
    res = []
    # (T, E, K, routing, renormalize, with d(topk_weights) given): one token; T past one routing block.
    for T, E, K, routing, renorm, extra in [(1, 8, 2, "softmax_topk", True, False),
                                            (37, 16, 4, "softmax_topk", False, True),
                                            (70, 32, 8, "topk_softmax", False, False),
                                            (21, 12, 3, "sigmoid_grouped_topk", True, True)]:
        g = generator(T * 7 + E)  # fresh inputs on the GPU (tests/conftest.py)
        logits = torch.randn(T, E, generator=g).to(low).to(device)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(device)
        pair_pos = torch.randperm(T * K, generator=g).to(torch.int32).to(device)
        parts = torch.randn(3, T * K, generator=g).to(device)
        dw_extra = torch.randn(T, K, generator=g).to(device) if extra else None
        kw = dict(routing=routing, renormalize=renorm, renorm_eps=1e-20, routed_scale=2.5)
        fp32 = route_backward(logits, ids, pair_pos, parts, dw_extra, **kw)
        got = route_backward(logits, ids, pair_pos, parts, dw_extra, **kw, out_dtype=low)
        res.append(dict(case=[T, E, K, routing], dtype=str(got.dtype), equal=bool(torch.equal(got, fp32.to(low))),
                        nonzero=bool(got.abs().sum() > 0)))
    return res
"""


def _check(results, dtype):
    assert len(results) == 4
    for r in results:
        assert r["dtype"] == dtype and r["equal"] and r["nonzero"], r


def test_low_precision_d_logits_equal_the_fp32_ones_cast():
    results = run_interpreted(_CASES + "import json\nprint(json.dumps(compare('cpu', torch.float16)))\n")
    _check(results, "torch.float16")


@pytest.mark.gpu
def test_low_precision_d_logits_equal_the_fp32_ones_cast_on_the_gpu():
    import torch

    scope = {}
    exec(_CASES, scope)
    _check(scope["compare"]("cuda", torch.bfloat16), "torch.bfloat16")
