"""The forward (or a training step), kernel by kernel: HF's block under torch.compile (inductor) against the op.

    python -m benchmarks.fwd_kernels [--shapes mixtral:16384,qwen3:4096] [--blocks 2] [--phase fwd|fwd_bwd]
        [--order] [--out DIR]

For each shape (`name:T`: the layer benchmark's block and random tokens): GPU ms per no-grad forward (or per
forward + backward, `--phase fwd_bwd`, the layer benchmark's step) of each kernel (`engines.per_kernel_ms`:
torch.profiler over 5 calls after 2 of warm-up), compiled HF and the op in alternating blocks, each block's total
split into the expert GEMMs and all other work, and the largest other kernels. Why: where both sides run the same
GEMMs (CUTLASS's grouped GEMM, Mixtral from 512 rows per expert), a layer ratio near 1.0 is decided by the other
work and by the GPU's clock, which drifts as the GPU heats; the split and the alternation show which (NOTES v41
(5)). `--order` also lists the op's kernels of one call in launch order: the op launches one Triton GEMM kernel
for several GEMMs (gate_up, down, and in the backward g2 and dgrad), which the per-name times add together.
Writes {phase}_kernels.json under --out, if given.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.engines import per_kernel_ms, profiled
from benchmarks.moe_layer import SHAPES, _no_grad, build_block, fwd_bwd, make_runners, write_json

# Kernel names (as `engines.per_kernel_ms` cuts them) of the expert GEMMs: torch's CUTLASS grouped GEMM (HF's path
# and the op's CUTLASS stages), the op's Triton grouped GEMM and its Hopper CUDA gate_up. The router's GEMM (cuBLAS)
# is other work, on both sides.
EXPERT_GEMM_MARKERS = ("cutlass", "_grouped_gemm_kernel", "gate_up_kernel")
# The backward's expert GEMMs besides those: the op's fused gate_up backward (g2 = go @ W2^T with h recomputed and
# the activation's derivative in its epilogue) and its weight-gradient kernels (Triton's and the CUDA one).
BACKWARD_GEMM_MARKERS = EXPERT_GEMM_MARKERS + ("_gate_up_bwd_kernel", "wgrad_kernel")
SIDES = ("hf+comp", "mok")
CALLS = 5  # profiled calls per block


def parse_shapes(text: str) -> list[tuple[str, int]]:
    """"name:T,name:T" -> [(name, T)], with the layer benchmark's shape names."""
    items = []
    for item in text.split(","):
        name, _, tokens = item.partition(":")
        if name not in SHAPES or not tokens.isdigit() or int(tokens) < 1:
            raise SystemExit(f"--shapes: {item!r} is not name:T with T >= 1 and name one of {', '.join(SHAPES)}")
        items.append((name, int(tokens)))
    return items


def split_gemms(times: dict, markers=EXPERT_GEMM_MARKERS) -> dict:
    """A side's kernel times (ms per call) -> busy total, expert GEMMs (names holding one of `markers`), other work,
    and the other kernels."""
    gemm = {k: v for k, v in times.items() if any(m in k for m in markers)}
    other = {k: v for k, v in times.items() if k not in gemm}
    return dict(busy_ms=sum(times.values()), gemm_ms=sum(gemm.values()), other_ms=sum(other.values()),
                other_kernels=dict(sorted(other.items(), key=lambda kv: -kv[1])))


def launch_order(kernels: list[tuple[str, float, float]], calls: int) -> list[tuple[str, float]]:
    """(name, start, ms) of every kernel of `calls` identical calls -> (name, mean ms) of one call's kernels in
    launch order. Refuses a profile whose calls did not launch the same kernels in the same order."""
    ordered = sorted(kernels, key=lambda k: k[1])
    if not ordered or len(ordered) % calls:
        raise ValueError(f"{len(ordered)} kernels do not split into {calls} calls")
    n = len(ordered) // calls
    per_call = [ordered[c * n:(c + 1) * n] for c in range(calls)]
    names = [k[0] for k in per_call[0]]
    if any([k[0] for k in call] != names for call in per_call[1:]):
        raise ValueError("the profiled calls launched different kernels")
    return [(name, sum(call[i][2] for call in per_call) / calls) for i, name in enumerate(names)]


def kernels_in_order(prof, calls: int) -> list[tuple[str, float]]:
    """One call's GPU kernels in launch order with their mean ms, from a profile of `calls` identical calls."""
    from torch.autograd import DeviceType

    kernels = [(e.name[:60], e.time_range.start, e.time_range.elapsed_us() / 1e3)
               for e in prof.events() if e.device_type == DeviceType.CUDA]
    return launch_order(kernels, calls)


def run_shape(name: str, T: int, blocks: int, phase: str = "fwd", order: bool = False) -> list[dict]:
    family, sizes, overrides, _ = SHAPES[name]
    torch._dynamo.reset()
    block = build_block(family, sizes, overrides)
    runners = make_runners(family, block)
    x = torch.randn(1, T, sizes.hidden, device="cuda", dtype=torch.bfloat16)
    if phase == "fwd":
        steps, markers = {side: _no_grad(runners[side], x) for side in SIDES}, EXPERT_GEMM_MARKERS
    else:
        params = [p for p in block.parameters() if p.requires_grad]
        x.requires_grad_()
        steps, markers = {side: fwd_bwd(runners[side], x, params) for side in SIDES}, BACKWARD_GEMM_MARKERS
    rows, seq = [], None
    for b in range(blocks):
        for side in SIDES if b % 2 == 0 else SIDES[::-1]:
            prof = profiled(steps[side], CALLS)
            row = dict(shape=name, T=T, phase=phase, block=b, side=side,
                       **split_gemms(per_kernel_ms(prof, CALLS, top=None), markers))
            others = ", ".join(f"{k} {v:.3f}" for k, v in list(row["other_kernels"].items())[:6])
            print(f"| {name} | {T} | {b} | {side} | {row['busy_ms']:.3f} | {row['gemm_ms']:.3f} | "
                  f"{row['other_ms']:.3f} | {others} |", flush=True)
            rows.append(row)
            if order and side == "mok" and seq is None:  # from the first block's profile, not a profile of its own
                seq = kernels_in_order(prof, CALLS)
    if seq is not None:
        print(f"mok {name} T={T} {phase}, kernels in launch order (ms): "
              + "; ".join(f"{k} {ms:.3f}" for k, ms in seq), flush=True)
        rows.append(dict(shape=name, T=T, phase=phase, side="mok", launch_order=seq))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="mixtral:16384,qwen3:4096", help="name:T,... (layer benchmark shapes)")
    ap.add_argument("--blocks", type=int, default=2, help="profiled blocks per side, alternating order")
    ap.add_argument("--phase", choices=("fwd", "fwd_bwd"), default="fwd",
                    help="fwd: no-grad forwards; fwd_bwd: the layer benchmark's training step")
    ap.add_argument("--order", action="store_true", help="also list the op's kernels of one call in launch order")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    shapes = parse_shapes(args.shapes)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.fwd_kernels needs a CUDA GPU")
    print("GPU ms per forward (no grad):" if args.phase == "fwd" else "GPU ms per forward + backward:")
    print("| shape | T | block | side | busy | expert GEMMs | other | largest other kernels |")
    print("|---|---|---|---|---|---|---|---|")
    rows = [r for name, T in shapes for r in run_shape(name, T, args.blocks, args.phase, args.order)]
    if args.out:
        write_json(args.out, f"{args.phase}_kernels.json", rows)


if __name__ == "__main__":
    main()
