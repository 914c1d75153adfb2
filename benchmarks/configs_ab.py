"""Two tuned block-size tables (`configs.json` files), or two GEMM engine choices, against each other on the op, in
one process, at layer shapes.

    python -m benchmarks.configs_ab OLD.json NEW.json [--shapes deepseek_v3:4096,qwen3:2048] [--rounds 3]
    python -m benchmarks.configs_ab engine:auto engine:sorted=triton [--shapes qwen3:4096]

A side `engine:VALUE` runs the committed table with MOK_GEMM_ENGINE=VALUE (`engine:auto`: the built-in choice,
`configs.engine`), for moving an engine threshold (NOTES v27 (3)).

The tuner (`mok_compile.kernels.tune`) times each kernel alone, on its own routing (ungrouped, over a random
router). A table it picks can lose in the layer, whose routing puts rows into row blocks differently (NOTES v23
(1): 1.06-1.10x per kernel alone at DeepSeek-V3's shape, 0.955x in its layer). Check a new table here before
committing it.

Per shape (`name:T`, a `benchmarks.moe_layer` shape with the benchmark's routing): the op's forward and
forward+backward replayed from CUDA graphs (GPU time, no host cost), rounds alternating A, B, A, B; medians,
A/B ratios (> 1: B is faster), and whether the two tables give bitwise equal outputs (tiles that differ only in
their order or height do; another BLOCK_K or engine need not).
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

import mok_compile  # noqa: F401  (registers torch.ops.mok.*)
from benchmarks.moe_layer import SHAPES, bench, build_block, fwd_bwd, graphed
from mok_compile import hf_blocks
from mok_compile.kernels import configs, moe


def use_table(path: str):
    """The op's configs from the table in `path` from now on. Launch plans and captured graphs hold the kernels they
    recorded and their keys do not cover the table, so they are dropped too."""
    configs._JSON = path
    configs._tuned.cache_clear()
    moe._FORWARD_PLANS.clear()
    moe._BACKWARD_PLANS.clear()
    moe.FORWARD_GRAPHS.clear()
    moe.BACKWARD_GRAPHS.clear()


_COMMITTED = configs._JSON
_ENGINE_AT_START = os.environ.get("MOK_GEMM_ENGINE")


def use_side(side: str):
    """One side of the A/B from now on: `engine:VALUE` (the committed table, MOK_GEMM_ENGINE=VALUE, `auto` unset),
    else a table's path (MOK_GEMM_ENGINE as the process started with it)."""
    kind, _, value = side.partition(":")
    engine = value if kind == "engine" else _ENGINE_AT_START
    if engine is None or engine == "auto":
        os.environ.pop("MOK_GEMM_ENGINE", None)
    else:
        os.environ["MOK_GEMM_ENGINE"] = engine
    use_table(_COMMITTED if kind == "engine" else side)


def compare(name: str, T: int, sides: dict, rounds: int) -> dict:
    family, sizes, overrides, _ = SHAPES[name]
    block = build_block(family, sizes, overrides)
    tensors, kw = hf_blocks.op_arguments(family, block)
    params = [p for p in block.parameters() if p.requires_grad]
    x = torch.randn(T, sizes.hidden, device="cuda", dtype=torch.bfloat16)

    def op(x2):
        return torch.ops.mok.fused_moe(x2, *tensors, **kw)[0]

    times = {which: {"fwd": [], "fwd_bwd": []} for which in sides}
    outs = {}
    for _ in range(rounds):
        for which, side in sides.items():
            use_side(side)
            for p in params:
                p.grad = None
            with torch.no_grad():
                outs[which] = op(x).clone()
                g_fwd = graphed(lambda: op(x))
            g_fb = graphed(fwd_bwd(op, x.clone().requires_grad_(), params))
            times[which]["fwd"].append(bench(g_fwd) if g_fwd else float("nan"))
            times[which]["fwd_bwd"].append(bench(g_fb) if g_fb else float("nan"))
            del g_fwd, g_fb
            torch.cuda.empty_cache()
    a, b = sides
    row = {"shape": name, "T": T, "bitwise_equal": torch.equal(outs[a], outs[b])}
    for phase in ("fwd", "fwd_bwd"):
        for which in sides:
            row[f"{which}_{phase}_ms"] = statistics.median(times[which][phase])
            row[f"{which}_{phase}_all_ms"] = times[which][phase]
        row[f"{phase}_a_over_b"] = row[f"{a}_{phase}_ms"] / row[f"{b}_{phase}_ms"]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="a configs.json (e.g. the committed one), or engine:VALUE")
    ap.add_argument("b", help="another configs.json (e.g. the tuner's output merged into a copy), or engine:VALUE")
    ap.add_argument("--shapes", default="deepseek_v3:4096,qwen3:2048,qwen3:4096",
                    help="comma-separated name:T, names from benchmarks.moe_layer.SHAPES")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    shapes = []
    for item in args.shapes.split(","):
        name, _, T = item.partition(":")
        if name not in SHAPES or not T.isdigit():
            ap.error(f"--shapes: {item!r} is not name:T with a name from {', '.join(SHAPES)}")
        shapes.append((name, int(T)))
    before = configs._JSON
    try:
        print("| shape | T | A fwd ms | B fwd ms | A/B | A f+b ms | B f+b ms | A/B | bits equal |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, T in shapes:
            r = compare(name, T, {"A": args.a, "B": args.b}, args.rounds)
            torch.cuda.empty_cache()  # the shape's layer, freed with compare's frame
            print(f"| {name} | {T} | {r['A_fwd_ms']:.3f} | {r['B_fwd_ms']:.3f} | {r['fwd_a_over_b']:.3f} | "
                  f"{r['A_fwd_bwd_ms']:.3f} | {r['B_fwd_bwd_ms']:.3f} | {r['fwd_bwd_a_over_b']:.3f} | "
                  f"{r['bitwise_equal']} |", flush=True)
    finally:
        use_side(before)


if __name__ == "__main__":
    main()
