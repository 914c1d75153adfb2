"""The router kernel sorting the pairs itself when one program holds every token (`route(dispatch=...)`): the
same arrays as the separate count, scan and scatter launches, and the same weights and ids as the routing of the
full-size token tile up to the last bits of the weights (the tile is cut to the call's few tokens, and its row
sums may run in another order). Under TRITON_INTERPRET=1 in a subprocess (fp32), and on the GPU in bf16."""

import pytest

from tests.kernels.interpreted import run_interpreted

pytest.importorskip("triton")

_CASES = r"""
import torch
from tests.kernels.cases import generator
from mok_compile.kernels import routing
from mok_compile.kernels.dispatch import Dispatch, count_chunks

FIELDS = ("expert_count", "expert_start", "expert_end", "sorted_pair", "pair_pos")

def compare(device, dtype):
    res = []
    # (T, E, K, routing kind): one token; a few; exactly one full tile (E=128: 32 tokens); past one tile; an
    # expert count that is no power of 2; grouped sigmoid routing, also at E=256 (DeepSeek-V3's).
    for T, E, K, kind in [(1, 8, 2, "softmax_topk"), (5, 128, 8, "softmax_topk"), (32, 128, 8, "topk_softmax"),
                          (33, 128, 8, "softmax_topk"), (7, 12, 3, "topk_sigmoid"),
                          (3, 16, 4, "sigmoid_grouped_topk"), (2, 256, 8, "sigmoid_grouped_topk")]:
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
    assert len(results) == 7
    for r in results:
        T = r["case"][0]
        assert r["block_t"] == min(r["full_t"], 1 << (T - 1).bit_length()), r  # the tile cut to T
        assert r["same_dispatch"] and r["same_ids"] and r["sorted_ok"], r
        # fp32 weights: a sum over k or E may run in another order in the smaller tile's layout (last bits only)
        assert r["w_rel_diff"] <= 4 * 2.0**-24, r


def test_one_program_routes_and_sorts_as_the_separate_launches():
    _check(run_interpreted(_CASES + "import json\nprint(json.dumps(compare('cpu', torch.float32)))\n"))


@pytest.mark.gpu
def test_one_program_routes_and_sorts_as_the_separate_launches_on_the_gpu():
    import torch

    scope = {}
    exec(_CASES, scope)
    _check(scope["compare"]("cuda", torch.bfloat16))
