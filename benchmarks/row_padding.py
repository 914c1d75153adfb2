"""What partly empty row blocks cost the expert GEMMs: the layer's routing against an even one of the same size.

    python -m benchmarks.row_padding [--shapes qwen3:4096,mixtral:4096] [--rounds 3] [--out DIR]

A grouped GEMM cuts each expert's rows into blocks of 128 (the Triton tiles' BLOCK_M at these sizes, the CUDA
kernel's, CUTLASS's); an expert's last block is partly empty but costs a whole tile (its weight-tile loads, and
its MMA work at full height). With
the benchmark's routing an expert gets a few rows more or fewer than the mean, so most experts end in a partial
block; with an even routing (token t's slot k on expert (t * K + k) mod E) every expert gets T * K / E rows, a
multiple of 128 at the issue's shapes and token counts from 4096. Same tokens, same weights, same useful FLOPs: the
ratio of the two times is what the padding and the last partial wave of tiles cost each kernel. cuBLAS, one call per
expert, fits its tile to each expert's rows and loses little to it (NOTES v42 (1)).

Each shape's sizes (H, I, E, K) with random weights in the F.linear layout (W1 [E, 2I, H], gate rows then up rows,
SiLU): the padding is a matter of row counts, not of the model's weight layout or activation. Kernels alone, each
`do_bench`'s median over alternating rounds: the forward gate_up on Triton (gather and SwiGLU fused), on the Hopper
CUDA kernel (same, where it builds), and on CUTLASS (pre-gathered rows, no activation); the down GEMM on Triton and
CUTLASS; all of them at both routings in the same alternating rounds. Writes row_padding.json under --out, if given.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.fwd_kernels import parse_shapes
from benchmarks.moe_layer import SHAPES, layer_routing, time_in_rounds, write_json

BLOCK_ROWS = 128
ROUTINGS = ("layer", "even")


def even_ids(T: int, K: int, E: int, device=None) -> torch.Tensor:
    """[T, K] int32 expert ids: token t's slot k on expert (t * K + k) mod E. A token's K experts are distinct
    (K <= E), and the experts' row counts differ by at most one (all T * K / E where E divides T * K)."""
    if K > E:
        raise ValueError(f"top-{K} routing needs at least {K} experts, got {E}")
    t = torch.arange(T, device=device).view(T, 1)
    return ((t * K + torch.arange(K, device=device).view(1, K)) % E).to(torch.int32)


def padded_blocks(counts, block: int = BLOCK_ROWS) -> int:
    """Row blocks of `block` rows the experts' row counts take, a partial block counted whole."""
    return sum(-(-c // block) for c in counts)


def _bench(fn) -> float:
    """One kernel's time, ms: shorter than `moe_layer.bench`'s, for the many kernels of a call."""
    import triton

    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def _kernels(x, disp, w1, w2, I):
    """label -> (callable, useful FLOPs) for the kernels timed at one routing."""
    from mok_compile.kernels import configs, cutlass_gemm, gate_up_sm90, moe
    from mok_compile.kernels.activation import activation_code

    T, H = x.shape
    TK, E = disp.num_pairs, disp.num_experts
    act = torch.empty(TK, I, device=x.device, dtype=x.dtype)
    y = torch.empty(TK, H, device=x.device, dtype=x.dtype)
    sorted_x = cutlass_gemm.gather_rows(x, disp)
    prec = moe._precision(x.dtype)
    kw = dict(alpha=1.702, limit=7.0)  # read by the clamped SwiGLU only
    cfg_g = configs.config("gate_up", x.dtype, TK / E, x.device)
    cfg_d = configs.config("down", x.dtype, TK / E, x.device)
    gate_up_flops, down_flops = 2 * TK * H * 2 * I, 2 * TK * H * I
    kernels = {
        "gate_up triton": (lambda: moe._gemm(x, disp, w1, moe._gate_up_strides(w1, False), None, act, n=I, kd=H,
                                             gather=True, gated=True, act=activation_code("silu", True), col_mul=1,
                                             up_off=I, kw=kw, cfg=cfg_g, precision=prec), gate_up_flops),
        "gate_up cutlass": (lambda: cutlass_gemm.grouped_mm(sorted_x, w1.transpose(1, 2), disp), gate_up_flops),
        "down triton": (lambda: moe._gemm(act, disp, w2, moe._down_strides(w2, False), None, y, n=H, kd=I,
                                          gather=False, gated=False, act=0, col_mul=1, up_off=0, kw=kw, cfg=cfg_d,
                                          precision=prec), down_flops),
        "down cutlass": (lambda: cutlass_gemm.grouped_mm(act, w2.transpose(1, 2), disp), down_flops),
    }
    op_kw = dict(gated=True, activation="silu", interleaved=False, transposed=False)
    if gate_up_sm90.eligible(x, w1, None, op_kw) and gate_up_sm90.available():
        kernels["gate_up sm90"] = (lambda: gate_up_sm90.gate_up(x, disp, w1, act), gate_up_flops)
    return kernels


def run_shape(name: str, T: int, rounds: int) -> list[dict]:
    from mok_compile.kernels.dispatch import Dispatch

    sizes = SHAPES[name][1]
    H, I, E, K = sizes.hidden, sizes.intermediate, sizes.experts, sizes.top_k
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    w1 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    ids = {"layer": layer_routing(name, T)[2], "even": even_ids(T, K, E, device="cuda")}
    kernels, counts = {}, {}
    for routing in ROUTINGS:  # both routings' kernels in the same alternating rounds: clock drift favours neither
        disp = Dispatch.from_ids(ids[routing].contiguous().to(torch.int32), E)
        counts[routing] = disp.expert_count.tolist()
        for label, kernel in _kernels(x, disp, w1, w2, I).items():
            kernels[(routing, label)] = kernel
    rounds_ms = time_in_rounds([(key, fn) for key, (fn, _) in kernels.items()], rounds, timer=_bench)
    times = {key: statistics.median(ms) for key, ms in rounds_ms.items()}
    rows = {}
    for (routing, label), ms in times.items():
        row = rows.setdefault(label, dict(shape=name, T=T, kernel=label))
        row[f"{routing}_ms"] = ms
        row[f"{routing}_tflops"] = kernels[(routing, label)][1] / ms / 1e9
        row[f"{routing}_rows"] = f"{min(counts[routing])}-{max(counts[routing])}"
        row[f"{routing}_blocks"] = padded_blocks(counts[routing])
    for row in rows.values():
        row["layer_over_even"] = row["layer_ms"] / row["even_ms"]
    return list(rows.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3:4096,mixtral:4096", help="comma-separated name:T (moe_layer's shapes)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="folder for row_padding.json")
    args = ap.parse_args()
    shapes = parse_shapes(args.shapes)
    print("| shape | T | kernel | layer: rows per expert | blocks | ms | TFLOP/s | even: rows | blocks | ms | TFLOP/s "
          "| layer / even |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    results = []
    for name, T in shapes:
        for r in run_shape(name, T, args.rounds):
            results.append(r)
            print(f"| {name} | {T} | {r['kernel']} | {r['layer_rows']} | {r['layer_blocks']} | {r['layer_ms']:.3f} | "
                  f"{r['layer_tflops']:.0f} | {r['even_rows']} | {r['even_blocks']} | {r['even_ms']:.3f} | "
                  f"{r['even_tflops']:.0f} | {r['layer_over_even']:.3f} |", flush=True)
        torch.cuda.empty_cache()
    if args.out:
        write_json(args.out, "row_padding.json", results)


if __name__ == "__main__":
    main()
