"""`routing.route_backward` storing d(logits) in the router's dtype (what the backward does for a 16-bit router
without a bias: one cast launch less) gives bit for bit the fp32 result cast afterwards, as before; and its tile,
which follows E and T (`route_backward_block`, NOTES-gpu.md v48), gives the fp32 d(logits) of the many-token tile
up to the last bits (a row's sums may run in another order in another layout). Run under TRITON_INTERPRET=1 in a
subprocess in fp16 (the interpreter's bf16 is not reliable), and on the GPU in bf16."""

import pytest

from tests.kernels.interpreted import background, run_interpreted, script_argv

pytest.importorskip("triton")

_CASES = r"""
import torch
from tests.kernels.cases import generator
from mok_compile.kernels import routing as routing_mod
from mok_compile.kernels.routing import route_backward

def full_tile(call):  # call() with route_backward's tile the many-token one of `routing_block`
    rule = routing_mod.route_backward_block
    routing_mod.route_backward_block = lambda num_experts, num_tokens: routing_mod.routing_block(num_experts)
    try:
        return call()
    finally:
        routing_mod.route_backward_block = rule

def compare(device, low):
    res = []
    # (T, E, K, routing, renormalize, with d(topk_weights) given): one token; T past one routing block; E = 128
    # and 256, whose tiles at these T are smaller than the many-token ones (8 and 4 tokens against 32 and 8).
    for T, E, K, routing, renorm, extra in [(1, 8, 2, "softmax_topk", True, False),
                                            (37, 16, 4, "softmax_topk", False, True),
                                            (70, 32, 8, "topk_softmax", False, False),
                                            (21, 12, 3, "sigmoid_grouped_topk", True, True),
                                            (45, 128, 8, "softmax_topk", True, False),
                                            (21, 256, 8, "sigmoid_grouped_topk", True, True)]:
        g = generator(T * 7 + E)  # fresh inputs on the GPU (tests/conftest.py)
        logits = torch.randn(T, E, generator=g).to(low).to(device)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(device)
        pair_pos = torch.randperm(T * K, generator=g).to(torch.int32).to(device)
        parts = torch.randn(3, T * K, generator=g).to(device)
        dw_extra = torch.randn(T, K, generator=g).to(device) if extra else None
        kw = dict(routing=routing, renormalize=renorm, renorm_eps=1e-20, routed_scale=2.5)
        fp32 = route_backward(logits, ids, pair_pos, parts, dw_extra, **kw)
        got = route_backward(logits, ids, pair_pos, parts, dw_extra, **kw, out_dtype=low)
        full = full_tile(lambda: route_backward(logits, ids, pair_pos, parts, dw_extra, **kw))
        # Relative to the d(topk_weights) the tile's sums start from, not to the result: the renormalisation's and
        # the softmax's backward subtract sums of products (d - sum(d * w)), and where they nearly cancel, a sum in
        # another order moves the small result by many of its own ulps (20 at T=1 on an H100, MOK_TEST_SEED=8073556).
        dw = parts.abs().sum(0).max() + (0.0 if dw_extra is None else dw_extra.abs().max())
        scale = torch.maximum(full.abs().max(), dw).clamp_min(1e-30)
        res.append(dict(case=[T, E, K, routing], dtype=str(got.dtype), equal=bool(torch.equal(got, fp32.to(low))),
                        nonzero=bool(got.abs().sum() > 0), tiles=[routing_mod.route_backward_block(E, T)[0],
                                                                   routing_mod.routing_block(E)[0]],
                        tile_diff=((fp32 - full).abs().max() / scale).item()))
    return res
"""


def _check(results, dtype):
    assert len(results) == 6
    assert [r["tiles"] for r in results] == [[1, 64], [64, 64], [64, 64], [32, 64], [8, 32], [4, 8]]
    for r in results:
        assert r["dtype"] == dtype and r["equal"] and r["nonzero"], r
        assert r["tile_diff"] <= 8 * 2.0**-24, r  # fp32, relative to the largest d(logit) or d(weight)


_CPU_RUN = _CASES + "import json\nprint(json.dumps(compare('cpu', torch.float16)))\n"


@background(script_argv(_CPU_RUN))
def test_low_precision_d_logits_equal_the_fp32_ones_cast():
    results = run_interpreted(_CPU_RUN)
    _check(results, "torch.float16")


@pytest.mark.gpu
def test_low_precision_d_logits_equal_the_fp32_ones_cast_on_the_gpu():
    import torch

    scope = {}
    exec(_CASES, scope)
    _check(scope["compare"]("cuda", torch.bfloat16), "torch.bfloat16")


@pytest.mark.parametrize("E, T, block_t", [(8, 1, 1), (8, 4096, 64), (32, 20, 32), (128, 1, 1), (128, 16, 8),
                                           (128, 16384, 8), (256, 3, 4), (256, 2048, 4), (256, 2049, 16),
                                           (256, 16384, 16)])
def test_route_backward_tile_rule(E, T, block_t):
    """NOTES-gpu.md v48: 8 tokens at E = 128; at E >= 256 4 tokens up to 512 programs, then 16; E <= 64 as the
    forward's `routing_block`; never taller than T's power of 2."""
    from mok_compile.kernels import routing

    assert routing.route_backward_block(E, T) == (block_t, max(E, 2))
