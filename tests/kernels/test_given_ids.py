"""Given expert ids (`mok::fused_moe`'s `expert_ids`, DeepSeek-V4's hash routing) in the Triton kernels: the routing
kernel reads the ids instead of choosing them, and the dispatch places a row's repeated ids (an expert named twice)
one after the other. Forward, the training forward's saved layout, and the backward with and without it, against the
reference in fp32, for every routing family, at a token count one routing program holds (the sort in the routing
launch) and at one it does not (scan and scatter launches); one case takes the logits as the router argument
(router_is_logits). Run under TRITON_INTERPRET=1 in a subprocess, and on the GPU."""

import pytest

from tests.kernels.interpreted import background, compare_argv, run_compare

pytest.importorskip("triton")

_CASE = r"""
import torch
from mok_compile.kernels import moe
from mok_compile.ops import reference
from tests.kernels.cases import rel_err, small_layer

ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_grouped_topk", "topk_sigmoid", "sqrtsoftplus_topk")

def compare(device, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    res = {}
    for T in (5, 70):  # 70: more tokens than one routing program holds at E = 8 (64), so scan and scatter run
        H, E, I, K = 32, 8, 16, 3
        tensors = small_layer(T, H, E, I, g, device, dtype)
        ids = torch.randint(0, E, (T, K), generator=g)
        ids[0] = torch.tensor([2, 2, 2])  # one expert three times
        ids[T - 1] = torch.tensor([1, 6, 1])
        ids = ids.to(device)
        go = torch.randn(T, H, generator=g).to(device, dtype)
        # "logits": the router argument is the logits (router_is_logits), as where a top-k the op cannot compute stays
        # in the graph and the op takes its ids and the graph's logits (AXK2's 0-filled group selection)
        logits_layer = (tensors[0], (tensors[0] @ tensors[1].T).float(), *tensors[2:])
        for routing in (*ROUTINGS, "logits") if T < 64 else ROUTINGS[::4]:
            kw = dict(top_k=K, routing=routing, renormalize=routing != "topk_softmax", routed_scale=1.5,
                      renorm_eps=1e-20)
            layer = tensors
            if routing == "logits":
                kw.update(routing="sigmoid_grouped_topk", router_is_logits=True)
                layer = logits_layer
            out, w, got_ids = moe.fused_moe_forward(*layer, expert_ids=ids, **kw)
            r_out, r_w, _ = reference.fused_moe_reference(*layer, expert_ids=ids, **kw)
            grads = moe.fused_moe_backward(go, None, *layer, w, got_ids, **kw)  # counts and sorts the ids itself
            r_grads = reference.fused_moe_backward_reference(go, None, *layer, r_w, ids, **kw)
            *_, h, logits, layout, _ = moe.fused_moe_forward(*layer, expert_ids=ids.int(), save_gate_up=True, **kw)
            saved = moe.fused_moe_backward(go, None, *layer, w, got_ids, gate_up_out=h, router_logits=logits,
                                           routing_layout=layout, **kw)
            names = ("dx", "drouter", None, "dw1", None, "dw2", "db2")
            res[f"{T}/{routing}"] = dict(
                ids_equal=bool(torch.equal(got_ids, ids)), out=rel_err(out, r_out), w=rel_err(w, r_w),
                **{n: rel_err(a, b) for n, a, b in zip(names, grads, r_grads) if n},
                **{"saved_" + n: rel_err(a, b) for n, a, b in zip(names, saved, r_grads) if n})
    return res
"""


def _check(results, tol=2e-5):
    assert len(results) == 8
    for name, r in results.items():
        assert r.pop("ids_equal"), name
        assert max(r.values()) < tol, (name, r)


@background(compare_argv(_CASE))
def test_given_ids_interpreted():
    _check(run_compare(_CASE, "cpu"))


@pytest.mark.gpu
def test_given_ids_gpu():
    _check(run_compare(_CASE, "cuda"))
