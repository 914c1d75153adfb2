"""The weight-gradient kernels alone, against each other: PyTorch's CUTLASS grouped GEMM on sorted rows (with and
without the row gathers the backward pays for it) and the Hopper CUDA kernel (csrc/wgrad_sm90.cu, `wgrad_sm90.py`),
which gathers x and grad_out rows itself.

    python -m benchmarks.wgrad_kernels [--shapes qwen3:4096,deepseek_v3:4096] [--rounds 3] [--routing layer|random]

Per shape (`name:T`; random weights, routed as the layer benchmark's block routes, `moe_layer.layer_routing`, or
with --routing random as the tuner's random router does) and gradient (dW1 = dh^T x[tokens], dW2 = grad_out[tokens]^T
(w act)): median GPU time of each over alternating rounds (`triton.testing.do_bench`, L2 cleared before each call),
TFLOP/s, (CUTLASS + gather) / sm90 (> 1: the CUDA kernel is faster), and whether the two give the same bits. Check a
change in the layer with `benchmarks.configs_ab` too (engine:wgrad=sm90).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton

from benchmarks.moe_layer import ROUTINGS, SHAPES, kernel_problem
from mok_compile.kernels import cutlass_gemm, wgrad_sm90


def compare(name: str, T: int, rounds: int, routing: str = "layer") -> list[dict]:
    sizes = SHAPES[name][1]
    H, I, K = sizes.hidden, sizes.intermediate, sizes.top_k
    pb, note = kernel_problem(name, T, routing)
    d = pb.disp
    xs, gos = cutlass_gemm.gather_rows(pb.x, d), cutlass_gemm.gather_rows(pb.go, d)
    dw1, dw2 = torch.empty_like(pb.w1), torch.empty_like(pb.w2)
    grads = {
        "dW1": {"cutlass+gather": lambda: cutlass_gemm.wgrad(pb.dh, cutlass_gemm.gather_rows(pb.x, d), d),
                "cutlass": lambda: cutlass_gemm.wgrad(pb.dh, xs, d),
                "sm90": lambda: wgrad_sm90.wgrad(pb.dh, pb.x, d, dw1, q_gather=True)},
        "dW2": {"cutlass+gather": lambda: cutlass_gemm.wgrad(cutlass_gemm.gather_rows(pb.go, d), pb.act, d),
                "cutlass": lambda: cutlass_gemm.wgrad(gos, pb.act, d),
                "sm90": lambda: wgrad_sm90.wgrad(pb.go, pb.act, d, dw2, p_gather=True)},
    }
    flops = {"dW1": 2 * T * K * 2 * I * H, "dW2": 2 * T * K * H * I}
    results = []
    for grad, kernels in grads.items():
        equal = torch.equal(kernels["cutlass"](), kernels["sm90"]())
        times = {k: [] for k in kernels}
        for r in range(rounds):
            for k in (list(kernels) if r % 2 == 0 else reversed(list(kernels))):
                times[k].append(triton.testing.do_bench(kernels[k], warmup=5, rep=40, return_mode="median"))
        ms = {k: statistics.median(v) for k, v in times.items()}
        results.append(dict(shape=name, T=T, grad=grad, ms=ms, equal=equal, routing=note,
                            tflops={k: flops[grad] / v / 1e9 for k, v in ms.items()}))
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3:4096,qwen3:16384,deepseek_v3:4096,gpt_oss:4096,mixtral:4096")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--routing", choices=ROUTINGS, default="layer",
                    help="the layer block's routing (default) or the tuner's random router's")
    args = ap.parse_args()
    if not wgrad_sm90.available():
        raise SystemExit("the Hopper CUDA kernels are not available here (needs an sm_90 GPU and nvcc)")
    print("| shape | T | grad | cutlass + gather ms | cutlass ms | sm90 ms | TFLOP/s cutlass / sm90 | "
          "(cutlass + gather) / sm90 | bits equal | routing |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for item in args.shapes.split(","):
        name, T = item.split(":")
        for r in compare(name, int(T), args.rounds, args.routing):
            ms, tf = r["ms"], r["tflops"]
            print(f"| {name} | {T} | {r['grad']} | {ms['cutlass+gather']:.4f} | {ms['cutlass']:.4f} | "
                  f"{ms['sm90']:.4f} | {tf['cutlass']:.0f} / {tf['sm90']:.0f} | "
                  f"{ms['cutlass+gather'] / ms['sm90']:.3f} | {r['equal']} | {r['routing']} |", flush=True)


if __name__ == "__main__":
    main()
