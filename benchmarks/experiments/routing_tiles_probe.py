"""The forward's routing launches (route, scan, scatter) alone, or with --backward the router backward's
`route_backward`, replayed from a CUDA graph, for each (tokens per routing program, warps) choice: NOTES-gpu.md
v46 (4), v47, v48. Not part of the package; run from the repo root on a GPU:

    PYTHONPATH=$PWD python benchmarks/experiments/routing_tiles_probe.py qwen3,dsv3,mixtral,gpt_oss 256,4096,16384 \
        [0x0,32x4,16x4,8x4] [--backward]

Prints us per call (medians over 3 alternating rounds of `do_bench`'s mean; captured by `moe_layer.graphed`) for
BLOCKxWARPS (the optional third argument; 0x0: the committed `routing_block` / `routing_warps`), and !NE where a
choice's weights, ids or sorted layout (not the layout's padding), or d(logits), differ from the first choice's.
The backward's d(topk_weights) partial sums are random, one per 128 columns of I, as the Triton GEMMs leave them.
"""
import statistics
import sys

import torch
import triton

from benchmarks.moe_layer import graphed
from mok_compile.kernels import dispatch, routing
from mok_compile.kernels.dispatch import Dispatch
from mok_compile.kernels.launch import next_power_of_2

orig_block, orig_warps, orig_bwd = routing.routing_block, routing.routing_warps, routing.route_backward_block
# name -> (E, K, routing, n_group, topk_group, logits dtype, I)
SHAPES = {"qwen3": (128, 8, "softmax_topk", 1, 1, torch.bfloat16, 768),
          "dsv3": (256, 8, "sigmoid_grouped_topk", 8, 4, torch.float32, 2048),
          "mixtral": (8, 2, "softmax_topk", 1, 1, torch.bfloat16, 14336),
          "gpt_oss": (32, 4, "topk_softmax", 1, 1, torch.bfloat16, 2880)}

def set_variant(bt, nw):
    def block(E, T=None):
        if not bt:
            return orig_block(E, T)
        be = next_power_of_2(max(E, 2))
        return (bt if T is None else min(bt, next_power_of_2(max(T, 1)))), be
    def warps(b, be):
        return nw if nw else orig_warps(b, be)
    for m in (routing, dispatch):  # dispatch.py imported both by name
        m.routing_block = block
        m.routing_warps = warps
    routing.route_backward_block = orig_bwd if not bt else block

def run(logits, E, K, rt, ng, tg):
    disp = Dispatch.unsorted(E, K, logits.shape[0] * K, logits.device)
    w, ids, _, _ = routing.route(logits, None, top_k=K, routing=rt, softmax_fp32=True, renormalize=True,
                                 renorm_eps=1e-20, routed_scale=1.0, n_group=ng, topk_group=tg,
                                 weights_dtype=torch.float32, dispatch=disp)
    return (w, ids, disp.expert_count, disp.expert_start, disp.expert_end, disp.sorted_pair, disp.pair_pos)

def backward_of(logits, E, K, rt, ng, tg, I):
    """route_backward on this routing's ids and layout (routed at the committed tile), as a call of no arguments."""
    set_variant(0, 0)
    _, ids, *_, pair_pos = run(logits, E, K, rt, ng, tg)
    parts = torch.randn(triton.cdiv(I, 128), ids.numel(), device="cuda")
    def call():
        return (routing.route_backward(logits, ids, pair_pos, parts, None, routing=rt, renormalize=True,
                                       renorm_eps=1e-20, routed_scale=1.0, out_dtype=logits.dtype),)
    return call

backward = "--backward" in sys.argv
sys.argv = [a for a in sys.argv if a != "--backward"]
variants = [(0, 0), (32, 1), (32, 2), (16, 1), (16, 2), (16, 4), (8, 1), (8, 2), (8, 4), (4, 1)]
if len(sys.argv) > 3:
    variants = [tuple(int(n) for n in v.split("x")) for v in sys.argv[3].split(",")]
for name in sys.argv[1].split(","):
    E, K, rt, ng, tg, dt, I = SHAPES[name]
    for T in [int(t) for t in sys.argv[2].split(",")]:
        logits = torch.randn(T, E, device="cuda", dtype=dt)
        call = backward_of(logits, E, K, rt, ng, tg, I) if backward else lambda: run(logits, E, K, rt, ng, tg)
        res = {}
        ref = None
        for _ in range(3):
            for v in variants:
                set_variant(*v)
                out = call()
                if ref is None:
                    ref = out
                eq = all(torch.equal(a, b) for a, b in zip(ref, out))
                replay = graphed(call)
                t = triton.testing.do_bench(replay, warmup=10, rep=40) * 1000  # do_bench's mean
                res.setdefault(v, []).append(t)
                res.setdefault((v, "eq"), []).append(eq)
        base = statistics.median(res[(0, 0)])
        line = " ".join(f"{v[0]}x{v[1]}:{statistics.median(res[v]):.1f}{'' if all(res[(v, 'eq')]) else '!NE'}"
                        for v in variants)
        print(f"{name}{' backward' if backward else ''} T={T} E={E} default {base:.1f} us | {line}", flush=True)
