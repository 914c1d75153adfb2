"""The forward gate_up kernels alone, against each other: the Triton gate_up (gather and activation fused), the
Hopper CUDA kernel (csrc/gate_up_sm90.cu, `gate_up_sm90.py`) and PyTorch's CUTLASS grouped GEMM on gathered rows
(no activation: its activation pass is not counted).

    python -m benchmarks.gate_up_kernels [--shapes qwen3:4096,mixtral:4096,deepseek_v3:4096] [--rounds 3]
        [--routing layer|random]

Per shape (`name:T`; random weights, routed as the layer benchmark's block routes, `moe_layer.layer_routing`, or
with --routing random as the tuner's random router does): median GPU time of each kernel over alternating rounds
(`triton.testing.do_bench`, L2 cleared before each call), TFLOP/s, triton / sm90 (> 1: the CUDA kernel is faster),
and whether the CUDA kernel's output equals the Triton kernel's bit for bit. The routing decides the ranking: on
the tuner's routing the CUDA kernel won at DeepSeek-V3, Mixtral and Qwen3 T=16384, on the layer's it lost (NOTES
v31). A kernel alone can still win where the layer does not (NOTES v28): check a change in the layer with
`benchmarks.configs_ab`.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton

from benchmarks.moe_layer import ROUTINGS, SHAPES, kernel_problem
from mok_compile.kernels import configs, cutlass_gemm, gate_up_sm90


def compare(name: str, T: int, rounds: int, routing: str = "layer") -> dict:
    sizes = SHAPES[name][1]  # the layer benchmark's (the CUDA kernel fits qwen3, mixtral, deepseek_v3)
    H, I, E, K = sizes.hidden, sizes.intermediate, sizes.experts, sizes.top_k
    p, note = kernel_problem(name, T, routing)
    cfg = configs.config("gate_up", torch.bfloat16, T * K / E, torch.device("cuda"))
    out = torch.empty_like(p.act)
    w1_kn = p.w1.transpose(1, 2)
    kernels = {
        "triton": lambda: p.launch("gate_up", cfg),
        "sm90": lambda: gate_up_sm90.gate_up(p.x, p.disp, p.w1, out),
        "cutlass": lambda: cutlass_gemm.grouped_mm(cutlass_gemm.gather_rows(p.x, p.disp), w1_kn, p.disp),
    }
    kernels["triton"]()
    kernels["sm90"]()
    equal = torch.equal(out, p.act)
    times = {k: [] for k in kernels}
    for r in range(rounds):
        for k in (list(kernels) if r % 2 == 0 else reversed(list(kernels))):
            times[k].append(triton.testing.do_bench(kernels[k], warmup=5, rep=40, return_mode="median"))
    ms = {k: statistics.median(v) for k, v in times.items()}
    return dict(shape=name, T=T, ms=ms, tflops={k: 4 * T * K * H * I / v / 1e9 for k, v in ms.items()},
                equal=equal, routing=note)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3:4096,qwen3:16384,mixtral:4096,deepseek_v3:4096")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--routing", choices=ROUTINGS, default="layer",
                    help="the layer block's routing (default) or the tuner's random router's")
    args = ap.parse_args()
    if not gate_up_sm90.available():
        raise SystemExit("the Hopper gate_up kernel is not available here (needs an sm_90 GPU and nvcc)")
    print("| shape | T | triton ms | sm90 ms | cutlass (gathered, no activation) ms | TFLOP/s triton / sm90 | "
          "triton / sm90 | bits equal | routing |")
    print("|---|---|---|---|---|---|---|---|---|")
    for item in args.shapes.split(","):
        name, T = item.split(":")
        r = compare(name, int(T), args.rounds, args.routing)
        ms, tf = r["ms"], r["tflops"]
        print(f"| {name} | {T} | {ms['triton']:.4f} | {ms['sm90']:.4f} | {ms['cutlass']:.4f} | "
              f"{tf['triton']:.0f} / {tf['sm90']:.0f} | {ms['triton'] / ms['sm90']:.3f} | {r['equal']} | "
              f"{r['routing']} |", flush=True)


if __name__ == "__main__":
    main()
