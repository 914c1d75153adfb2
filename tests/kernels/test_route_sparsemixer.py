"""PhiMoE's sparsemixer in the Triton routing kernels at the logits where it is easy to get wrong: equal logits (the
first of equals is picked, as torch.max promises), zeros (a ratio of 0 / 0 keeps the expert), a negative largest
logit (the clamp then leaves |s|), and many random 16-bit rows, whose differences and ratios the kernel must round
to 16 bits as PyTorch does before comparing them with the threshold, itself rounded. Ids against the reference's
exactly, weights to an ulp of their dtype, d(logits) against the reference backward in fp64. Run under
TRITON_INTERPRET=1 in a subprocess, and on the GPU."""

import pytest

from tests.kernels.interpreted import background, run_interpreted, script_argv

pytest.importorskip("triton")

_CASE = r"""
import torch
from mok_compile.kernels.routing import route, route_backward
from mok_compile.ops import reference
from tests.ops.moe_cases import SPARSEMIXER_EDGE_LOGITS, sparsemixer_logits

EDGES = len(SPARSEMIXER_EDGE_LOGITS)


def compare(device, dtype, jitter_eps=0.1, rows=256, K=2):
    logits = sparsemixer_logits(dtype, rows=rows, device=device)
    res = {}
    for softmax_fp32 in (False, True):
        kw = dict(top_k=K, routing="sparsemixer", softmax_fp32=softmax_fp32, renormalize=False, renorm_eps=0.0,
                  routed_scale=1.0, n_group=1, topk_group=1)
        w, ids, _, _ = route(logits, None, **kw, weights_dtype=dtype, jitter_eps=jitter_eps)
        want_w, want_ids = reference.route(logits, None, x_dtype=dtype, weights_fp32=False, jitter_eps=jitter_eps,
                                           **kw)
        T = logits.shape[0]
        pair_pos = torch.arange(T * K, dtype=torch.int32, device=device)
        dw = torch.linspace(-1.0, 1.0, T * K, device=device).view(1, T * K)
        dl = route_backward(logits, ids, pair_pos, dw, None, routing="sparsemixer", renormalize=False,
                            renorm_eps=0.0, routed_scale=1.0, softmax_fp32=softmax_fp32, jitter_eps=jitter_eps)
        dl_truth = reference.routing_backward(logits, None, want_ids, dw.view(T, K).double(), routing="sparsemixer",
                                              renormalize=False, renorm_eps=0.0, routed_scale=1.0,
                                              softmax_fp32=softmax_fp32, jitter_eps=jitter_eps)[0]
        ulp = torch.finfo(dtype).eps
        res[str(softmax_fp32)] = dict(
            ids_equal=bool(torch.equal(ids, want_ids)), edge_ids=ids[:EDGES].tolist(),
            w_ulps=((w.double() - want_w.double()).abs() / (ulp * want_w.double().abs())).max().item(),
            dl_err=((dl.double() - dl_truth).abs().max() / dl_truth.abs().max()).item(),
            kept=[int(k) for k in (reference.sparsemixer_gates(logits, logits.double(), want_ids, jitter_eps) > 0)
                  .sum(-1).flatten().bincount().tolist()])
    return res
"""


def _check(results, dtype):
    """16-bit weights to an ulp (the rounding of a softmax whose exp is not exactly PyTorch's), fp32 ones to 8."""
    for softmax_fp32, r in results.items():
        assert r["ids_equal"], (softmax_fp32, r)
        assert r["edge_ids"][:3] == [[0, 1], [0, 1], [0, 2]], r["edge_ids"]
        assert r["w_ulps"] <= (8.0 if dtype == "float32" else 1.0), (softmax_fp32, r)
        assert r["dl_err"] <= 1e-5, (softmax_fp32, r)
        assert sum(r["kept"][2:]) > 100 and r["kept"][1] > 100, r["kept"]  # the masks both keep and drop


def _cpu_run(dtype):
    return _CASE + f"import json\nprint(json.dumps(compare('cpu', torch.{dtype})))\n"


@pytest.mark.parametrize("dtype", [pytest.param(dtype, marks=background(script_argv(_cpu_run(dtype))))
                                   for dtype in ("float32", "float16")])  # the interpreter truncates to bf16
def test_sparsemixer_routing_at_edge_logits(dtype):
    _check(run_interpreted(_cpu_run(dtype)), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sparsemixer_routing_at_edge_logits_on_the_gpu(dtype):
    import torch

    scope = {}
    exec(_CASE, scope)
    _check(scope["compare"]("cuda", getattr(torch, dtype)), dtype)
