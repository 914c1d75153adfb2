"""The forward, kernel by kernel: HF's block under torch.compile (inductor) against the op, at layer shapes.

    python -m benchmarks.fwd_kernels [--shapes mixtral:16384,qwen3:4096] [--blocks 2] [--out DIR]

For each shape (`name:T`: the layer benchmark's block and random tokens): GPU ms per no-grad forward of each
kernel (`engines.kernel_times`: torch.profiler over 5 forwards after 2 of warm-up), compiled HF and the op in
alternating blocks, each block's total split into the expert GEMMs and all other work, and the largest other
kernels. Why: where both sides run the same GEMMs (CUTLASS's grouped GEMM, Mixtral from 512 rows per expert), a
layer ratio near 1.0 is decided by the other work and by the GPU's clock, which drifts as the GPU heats; the split
and the alternation show which (NOTES v41 (5)). Writes fwd_kernels.json under --out, if given.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.engines import kernel_times
from benchmarks.moe_layer import SHAPES, _no_grad, build_block, make_runners, write_json

# Kernel names (as `kernel_times` cuts them) of the expert GEMMs: torch's CUTLASS grouped GEMM (HF's path and the
# op's CUTLASS stages), the op's Triton grouped GEMM and its Hopper CUDA gate_up. The router's GEMM (cuBLAS) is
# other work, on both sides.
EXPERT_GEMM_MARKERS = ("cutlass", "_grouped_gemm_kernel", "gate_up_kernel")
SIDES = ("hf+comp", "mok")


def parse_shapes(text: str) -> list[tuple[str, int]]:
    """"name:T,name:T" -> [(name, T)], with the layer benchmark's shape names."""
    items = []
    for item in text.split(","):
        name, _, tokens = item.partition(":")
        if name not in SHAPES or not tokens.isdigit() or int(tokens) < 1:
            raise SystemExit(f"--shapes: {item!r} is not name:T with T >= 1 and name one of {', '.join(SHAPES)}")
        items.append((name, int(tokens)))
    return items


def split_gemms(times: dict) -> dict:
    """A side's kernel times (ms per forward) -> busy total, expert GEMMs, other work, and the other kernels."""
    gemm = {k: v for k, v in times.items() if any(m in k for m in EXPERT_GEMM_MARKERS)}
    other = {k: v for k, v in times.items() if k not in gemm}
    return dict(busy_ms=sum(times.values()), gemm_ms=sum(gemm.values()), other_ms=sum(other.values()),
                other_kernels=dict(sorted(other.items(), key=lambda kv: -kv[1])))


def run_shape(name: str, T: int, blocks: int) -> list[dict]:
    family, sizes, overrides, _ = SHAPES[name]
    torch._dynamo.reset()
    block = build_block(family, sizes, overrides)
    runners = make_runners(family, block)
    x = torch.randn(1, T, sizes.hidden, device="cuda", dtype=torch.bfloat16)
    rows = []
    for b in range(blocks):
        for side in SIDES if b % 2 == 0 else SIDES[::-1]:
            row = dict(shape=name, T=T, block=b, side=side,
                       **split_gemms(kernel_times(_no_grad(runners[side], x), top=None, steps=5)))
            others = ", ".join(f"{k} {v:.3f}" for k, v in list(row["other_kernels"].items())[:6])
            print(f"| {name} | {T} | {b} | {side} | {row['busy_ms']:.3f} | {row['gemm_ms']:.3f} | "
                  f"{row['other_ms']:.3f} | {others} |", flush=True)
            rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="mixtral:16384,qwen3:4096", help="name:T,... (layer benchmark shapes)")
    ap.add_argument("--blocks", type=int, default=2, help="profiled blocks per side, alternating order")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    shapes = parse_shapes(args.shapes)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.fwd_kernels needs a CUDA GPU")
    print("GPU ms per forward (no grad):")
    print("| shape | T | block | side | busy | expert GEMMs | other | largest other kernels |")
    print("|---|---|---|---|---|---|---|---|")
    rows = [r for name, T in shapes for r in run_shape(name, T, args.blocks)]
    if args.out:
        write_json(args.out, "fwd_kernels.json", rows)


if __name__ == "__main__":
    main()
