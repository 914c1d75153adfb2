"""The Triton weight gradient's grid at few rows per expert: one output tile per program against a persistent grid
(`PROGRAMS_PER_SM`), as the number of experts grows at fixed layer widths and rows per expert.

    python -m benchmarks.wgrad_grid [--rows 8,40] [--geometries deepseek_v3,qwen3,mixtral] [--programs-per-sm 3]
        [--rounds 2]

At few rows per expert the kernel is bound by writing the gradients. Growing E at fixed H, I and rows per expert
changes only how many tiles each persistent program runs, so this tells whether that count, the rows per tile or the
layer's widths decide which grid is faster (NOTES v38). Random even routing (the tuner's), the table's m16/m64 tile
with TMA stores; medians over alternating rounds (`moe_layer.time_in_rounds`: `do_bench` medians, L2 cleared before
each call), the gradient's bytes over the time.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton

from benchmarks.moe_layer import SHAPES, time_in_rounds
from mok_compile.kernels import configs
from mok_compile.kernels import moe
from mok_compile.kernels.tune import _Problem

TILE = dict(BLOCK_P=128, BLOCK_Q=128, BLOCK_R=32, num_warps=4, num_stages=2, TMA=True)
EXPERTS = {"deepseek_v3": (16, 64, 256), "qwen3": (64, 256, 1024), "mixtral": (8, 16, 32)}


def compare(geometry: str, E: int, rows: int, per_sm: int, rounds: int = 2) -> list[dict]:
    """dW1 and dW2 of `geometry`'s H and I with E experts and ~rows rows each: ms of both grids."""
    sizes = SHAPES[geometry][1]
    H, I, K = sizes.hidden, sizes.intermediate, sizes.top_k
    T = max(1, rows * E // K)
    pb = _Problem(H, I, E, K, T)
    programs = per_sm * configs.sm_count(pb.x.device)
    results = []
    for grad, (p, q, P, Q, p_gather, q_gather, w) in {"dW1": (pb.dh, pb.x, 2 * I, H, False, True, pb.w1),
                                                      "dW2": (pb.go, pb.act, H, I, True, False, pb.w2)}.items():
        out = torch.empty_like(w)

        def run(cfg):
            moe._wgrad(p, q, pb.disp, None, out, None, P=P, Q=Q, p_gather=p_gather, q_gather=q_gather,
                       strides_pq=(out.stride(1), 1), cfg=cfg, precision="ieee")

        persistent = {**TILE, "PROGRAMS_PER_SM": per_sm}
        run(TILE)
        one = out.clone()
        run(persistent)
        equal = torch.equal(one, out)  # before the timing rounds, which leave either grid's result in `out`
        times = time_in_rounds([("one", lambda: run(TILE)), ("persistent", lambda: run(persistent))], rounds)
        ms_one, ms_persistent = (statistics.median(times[k]) for k in ("one", "persistent"))
        tiles = E * triton.cdiv(P, TILE["BLOCK_P"]) * triton.cdiv(Q, TILE["BLOCK_Q"])
        gb = out.numel() * out.element_size() / 1e9
        results.append(dict(geometry=geometry, E=E, T=T, rows=rows, grad=grad, tiles_per_program=tiles / programs,
                            one=ms_one, persistent=ms_persistent, tbs=(gb / ms_one, gb / ms_persistent),
                            equal=equal))
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="8,40", help="rows per expert, comma-separated")
    ap.add_argument("--geometries", default=",".join(EXPERTS), help=f"of {', '.join(EXPERTS)}")
    ap.add_argument("--programs-per-sm", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    print("| layer widths | rows per expert | E | grad | tiles per program | one tile ms | persistent ms | "
          "one / persistent | TB/s one / persistent | bits equal |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rows in map(int, args.rows.split(",")):
        for geometry in args.geometries.split(","):
            for E in EXPERTS[geometry]:
                for r in compare(geometry, E, rows, args.programs_per_sm, args.rounds):
                    print(f"| {geometry} | {rows} | {E} | {r['grad']} | {r['tiles_per_program']:.0f} | "
                          f"{r['one']:.4f} | {r['persistent']:.4f} | {r['one'] / r['persistent']:.3f} | "
                          f"{r['tbs'][0]:.2f} / {r['tbs'][1]:.2f} | {r['equal']} |", flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
