"""The router kernel sorting the pairs itself when one program holds every token (`route(dispatch=...)`): the
same arrays as the separate count, scan and scatter launches, and the same weights and ids as the routing of the
full-size token tile up to the last bits of the weights (the tile is cut to the call's few tokens, and its row
sums may run in another order). Under TRITON_INTERPRET=1 in a subprocess (fp32), and on the GPU in bf16."""

import pytest

from tests.kernels.interpreted import background, run_interpreted, script_argv

pytest.importorskip("triton")

_CASES = r"""
import torch
from tests.kernels.cases import generator
from mok_compile.kernels import routing
from mok_compile.kernels.dispatch import Dispatch, count_chunks

FIELDS = ("expert_count", "expert_start", "expert_end", "sorted_pair", "pair_pos")

def compare(device, dtype):
    res = []
    # (T, E, K, routing kind): one token; a few; the most tokens one program takes at E=128 (16); past it, where
    # the separate scan and scatter run; an expert count that is no power of 2; grouped sigmoid routing, also at
    # E=256 (DeepSeek-V3's), in one program and in several.
    for T, E, K, kind in [(1, 8, 2, "softmax_topk"), (5, 128, 8, "softmax_topk"), (16, 128, 8, "topk_softmax"),
                          (33, 128, 8, "softmax_topk"), (7, 12, 3, "topk_sigmoid"),
                          (3, 16, 4, "sigmoid_grouped_topk"), (2, 256, 8, "sigmoid_grouped_topk"),
                          (19, 256, 8, "sigmoid_grouped_topk")]:
        g = generator(T * 31 + E)  # fresh inputs on the GPU (tests/conftest.py)
        logits = torch.randn(T, E, generator=g).to(dtype).to(device)
        grouped = kind == "sigmoid_grouped_topk"
        kw = dict(top_k=K, routing=kind, softmax_fp32=True, renormalize=True, renorm_eps=0.0, routed_scale=1.0,
                  n_group=4 if grouped else 1, topk_group=2 if grouped else 1, weights_dtype=torch.float32)
        disp = Dispatch.unsorted(E, K, T * K, device)
        w, ids, counts, block_t = routing.route(logits, None, **kw, dispatch=disp)
        full_t, block_e = routing.routing_block(E)
        built = Dispatch(ids, count_chunks(ids, E, full_t, block_e), E, full_t)
        cut_to = routing.routing_block
        routing.routing_block = lambda num_experts, num_tokens=None: cut_to(num_experts)  # the full tile
        try:
            w_full, ids_full, _, _ = routing.route(logits, None, **kw)
        finally:
            routing.routing_block = cut_to
        res.append(dict(case=[T, E, K, kind], block_t=block_t, full_t=full_t,
                        same_dispatch=all(torch.equal(getattr(disp, f), getattr(built, f)) for f in FIELDS),
                        same_ids=bool(torch.equal(ids, ids_full)),
                        w_rel_diff=((w - w_full).abs() / w_full.abs().clamp_min(1e-30)).max().item(),
                        sorted_ok=bool(torch.equal(torch.sort(ids.flatten()[disp.sorted_pair.long()], stable=True)[0],
                                                   ids.flatten()[disp.sorted_pair.long()]))))
    return res
"""


def _check(results):
    assert len(results) == 8
    # tokens per routing program (`test_routing_tile_rule` has the rule), the tile cut to T's power of 2
    assert [r["block_t"] for r in results] == [1, 8, 16, 8, 8, 4, 2, 4]
    assert [r["full_t"] for r in results] == [64, 32, 32, 32, 64, 64, 8, 8]  # the many-token tile (no T given)
    for r in results:
        assert r["same_dispatch"] and r["same_ids"] and r["sorted_ok"], r
        # fp32 weights: a sum over k or E may run in another order in the smaller tile's layout (last bits only)
        assert r["w_rel_diff"] <= 4 * 2.0**-24, r


@pytest.mark.parametrize("E, T, block_t, warps", [
    (8, 1, 1, 1), (8, 16, 16, 1), (8, 4096, 64, 4), (32, 32, 32, 2), (32, 4096, 64, 4), (64, 100, 64, 4),
    (128, 1, 1, 1), (128, 2, 2, 2), (128, 4, 4, 4), (128, 5, 8, 4), (128, 16, 16, 4), (128, 17, 8, 4),
    (128, 256, 8, 4), (128, 2048, 8, 4), (128, 2049, 16, 4), (128, 4096, 16, 4), (128, 4097, 32, 4),
    (128, 16384, 32, 4), (256, 2, 2, 2), (256, 8, 4, 4), (256, 512, 4, 4), (256, 513, 8, 4), (256, 16384, 8, 4)])
def test_routing_tile_rule(E, T, block_t, warps):
    """NOTES-gpu.md v47's rule: at E = 128 one program up to 16 tokens, then the fewest of 8, 16, 32 tokens
    making at most 256 programs; at E >= 256 4 tokens, 8 past 128 programs; 64 tokens at E <= 64; cut to T's
    power of 2; at E >= 128 a warp per token up to 4, below it 4 warps except for a tile cut to a few tokens."""
    from mok_compile.kernels import routing

    bt, be = routing.routing_block(E, T)
    assert (bt, be, routing.routing_warps(bt, be)) == (block_t, max(E, 2), warps)


_CPU_RUN = _CASES + "import json\nprint(json.dumps(compare('cpu', torch.float32)))\n"


@background(script_argv(_CPU_RUN))
def test_one_program_routes_and_sorts_as_the_separate_launches():
    _check(run_interpreted(_CPU_RUN))


@pytest.mark.gpu
def test_one_program_routes_and_sorts_as_the_separate_launches_on_the_gpu():
    import torch

    scope = {}
    exec(_CASES, scope)
    _check(scope["compare"]("cuda", torch.bfloat16))
