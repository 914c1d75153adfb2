"""The forward's routing launches (route, scan, scatter) alone, replayed from a CUDA graph, for each (tokens per
routing program, warps) choice: NOTES-gpu.md v46 (4), v47. Not part of the package; run from the repo root on a GPU:

    PYTHONPATH=$PWD python benchmarks/experiments/routing_tiles_probe.py qwen3,dsv3,mixtral,gpt_oss 256,4096,16384 \
        [0x0,32x4,16x4,8x4]

Prints us per call (medians over 3 alternating rounds of `do_bench`'s mean; captured by `moe_layer.graphed`) for
BLOCKxWARPS (the optional third argument; 0x0: the committed `routing_block` / `routing_warps`), and !NE where a
choice's weights, ids or sorted layout (not the layout's padding) differ from the committed choice's.
"""
import statistics
import sys

import torch
import triton

from benchmarks.moe_layer import graphed
from mok_compile.kernels import dispatch, routing
from mok_compile.kernels.dispatch import Dispatch
from mok_compile.kernels.launch import next_power_of_2

orig_block, orig_warps = routing.routing_block, routing.routing_warps
# name -> (E, K, routing, n_group, topk_group, logits dtype)
SHAPES = {"qwen3": (128, 8, "softmax_topk", 1, 1, torch.bfloat16),
          "dsv3": (256, 8, "sigmoid_grouped_topk", 8, 4, torch.float32),
          "mixtral": (8, 2, "softmax_topk", 1, 1, torch.bfloat16),
          "gpt_oss": (32, 4, "topk_softmax", 1, 1, torch.bfloat16)}

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

def run(logits, E, K, rt, ng, tg):
    disp = Dispatch.unsorted(E, K, logits.shape[0] * K, logits.device)
    w, ids, _, _ = routing.route(logits, None, top_k=K, routing=rt, softmax_fp32=True, renormalize=True,
                                 renorm_eps=1e-20, routed_scale=1.0, n_group=ng, topk_group=tg,
                                 weights_dtype=torch.float32, dispatch=disp)
    return (w, ids, disp.expert_count, disp.expert_start, disp.expert_end, disp.sorted_pair, disp.pair_pos)

variants = [(0, 0), (32, 1), (32, 2), (16, 1), (16, 2), (16, 4), (8, 1), (8, 2), (8, 4), (4, 1)]
if len(sys.argv) > 3:
    variants = [tuple(int(n) for n in v.split("x")) for v in sys.argv[3].split(",")]
for name in sys.argv[1].split(","):
    E, K, rt, ng, tg, dt = SHAPES[name]
    for T in [int(t) for t in sys.argv[2].split(",")]:
        logits = torch.randn(T, E, device="cuda", dtype=dt)
        res = {}
        ref = None
        for _ in range(3):
            for v in variants:
                set_variant(*v)
                out = run(logits, E, K, rt, ng, tg)
                if ref is None:
                    ref = out
                eq = all(torch.equal(a, b) for a, b in zip(ref, out))
                replay = graphed(lambda: run(logits, E, K, rt, ng, tg))
                t = triton.testing.do_bench(replay, warmup=10, rep=40) * 1000  # do_bench's mean
                res.setdefault(v, []).append(t)
                res.setdefault((v, "eq"), []).append(eq)
        base = statistics.median(res[(0, 0)])
        line = " ".join(f"{v[0]}x{v[1]}:{statistics.median(res[v]):.1f}{'' if all(res[(v, 'eq')]) else '!NE'}"
                        for v in variants)
        print(f"{name} T={T} E={E} default {base:.1f} us | {line}", flush=True)
