"""The layer's expert GEMMs alone, at library speed: how far the GPU issue's targets are from what the fastest
available GEMMs allow.

    python -m benchmarks.gemm_bound --out DIR [--shapes qwen3,mixtral,deepseek_v3,gpt_oss] [--tokens 4096]
        [--rounds 2]

A fused MoE layer is its expert GEMMs plus glue (router, routing, sort, gathers, activation, combine). This times
the GEMMs alone, on the layer block's own weights and layouts and its routing (`moe_layer.layer_routing`'s
token counts per expert), every operand already in expert-sorted order, through two libraries:
  grouped     PyTorch's grouped GEMM (CUTLASS on Hopper), one launch per GEMM: what HF's grouped_mm path runs
  per_expert  one cuBLAS `torch.mm` per expert over its rows (the row counts read on the host before timing, which
              no sync-free layer can do: given for scale; it wins where experts are few and large)
each replayed from a CUDA graph (GPU time). Forward: gate_up (x @ W1[e]) and down (act @ W2[e]); forward+backward
adds g2 (grad @ W2[e]^T), dgrad (dh @ W1[e]^T) and the weight gradients dW2[e] = grad^T act, dW1[e] = dh^T x. A
shared expert (DeepSeek-V3's) runs outside the op on both sides: HF's module, timed eagerly, is added to both.

"x bound" = compiled HF's time / the faster library's GEMM time: the most a layer reaches with GEMMs as fast as
that library's and every other kernel free. A target above it ("x target", the issue's) needs GEMMs faster than
both libraries' at that shape. "x mok" is the op's own ratio in the same run (called eagerly, as in
`moe_layer`), and "x at floor" the ratio at the hardware floor (`moe_layer.floors`). Writes gemm_bound.json.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics

import torch

from benchmarks.moe_layer import (SHAPES, _no_grad, build_block, floors, fwd_bwd, graphed, layer_routing,
                                  make_runners, measure_ceilings, time_in_rounds, write_json)
from mok_compile import hf_blocks
from mok_compile.kernels.cutlass_gemm import _grouped_mm
from mok_compile.kernels.moe import _kn  # W[e] as the op's grouped GEMMs read it

FORWARD = ("gate_up", "down")
GEMMS = FORWARD + ("g2", "dgrad", "dW2", "dW1")
LIBRARIES = ("grouped", "per_expert")

# The GPU issue's speed targets: compiled HF's time / ours, per shape, phase and T (Mixtral: never slower).
TARGETS = {
    ("qwen3", "fwd"): {256: 2.0, 4096: 2.0, 16384: 1.6},
    ("qwen3", "fwd_bwd"): {256: 1.8, 4096: 1.8, 16384: 1.8},
    ("mixtral", "fwd"): {256: 1.0, 4096: 1.0, 16384: 1.0},
    ("mixtral", "fwd_bwd"): {256: 1.0, 4096: 1.0, 16384: 1.0},
    ("deepseek_v3", "fwd"): {4096: 1.8},
    ("gpt_oss", "fwd"): {4096: 1.8},
}


class ExpertGemms:
    """The six expert GEMMs of one layer call, on random expert-sorted operands with `counts[e]` rows for expert e,
    each runnable as one grouped GEMM or as one `torch.mm` per expert (same results up to rounding)."""

    def __init__(self, w1, w2, transposed, counts, generator=None):
        w1, w2 = w1.detach(), w2.detach()  # the block's parameters: times of the GEMMs alone, no autograd
        TK = int(counts.sum())
        H, N1 = (w1.shape[1], w1.shape[2]) if transposed else (w1.shape[2], w1.shape[1])  # N1 = 2I (gated) or I
        I = w2.shape[1] if transposed else w2.shape[2]

        def rows(n):
            return torch.randn(TK, n, device=w1.device, generator=generator).to(w1.dtype)

        x, act, grad, dh = rows(H), rows(I), rows(H), rows(N1)
        self.offs = counts.cumsum(0).to(torch.int32)
        ends = self.offs.tolist()
        self.spans = list(zip([0] + ends[:-1], ends))
        # name -> ("mm", a, b_kn [E, k, n]) for C[rows of e] = A[rows of e] @ B[e], or ("wgrad", p, q) for
        # C[e] = P[rows of e]^T @ Q[rows of e], laid out as the weight it is the gradient of.
        self.problems = {
            "gate_up": ("mm", x, _kn(w1, transposed)),
            "down": ("mm", act, _kn(w2, transposed)),
            "g2": ("mm", grad, _kn(w2, transposed, backward=True)),
            "dgrad": ("mm", dh, _kn(w1, transposed, backward=True)),
            "dW2": ("wgrad", act, grad) if transposed else ("wgrad", grad, act),
            "dW1": ("wgrad", x, dh) if transposed else ("wgrad", dh, x),
        }
        self.flops = {name: 2 * TK * a.shape[1] * b.shape[-1] for name, (kind, a, b) in self.problems.items()}

    def grouped(self, name):
        kind, a, b = self.problems[name]
        return _grouped_mm(a, b, offs=self.offs) if kind == "mm" else _grouped_mm(a.t(), b, offs=self.offs)

    def per_expert(self, name):
        kind, a, b = self.problems[name]
        if kind == "mm":
            out = torch.empty(a.shape[0], b.shape[-1], dtype=a.dtype, device=a.device)
            for e, (s, t) in enumerate(self.spans):
                if t > s:
                    torch.mm(a[s:t], b[e], out=out[s:t])
            return out
        out = torch.empty(len(self.spans), a.shape[1], b.shape[1], dtype=a.dtype, device=a.device)
        for e, (s, t) in enumerate(self.spans):
            if t > s:
                torch.mm(a[s:t].t(), b[s:t], out=out[e])
            else:
                out[e].zero_()  # an expert without rows: a zero gradient, as the grouped GEMM gives
        return out


def _sum(times, names):
    return sum(times[n] for n in names)


def bound_rows(row) -> list[dict]:
    """Per phase: compiled HF's, mok's and the GEMMs' times (ms) and the ratios of the module docstring."""
    out = []
    for phase, names in (("fwd", FORWARD), ("fwd_bwd", GEMMS)):
        base = row[f"hf+comp_{phase}_ms"]
        gemms = {lib: _sum(row[f"{lib}_ms"], names) + row[f"shared_{phase}_ms"] for lib in LIBRARIES}
        best = min(gemms.values())
        out.append({"shape": row["shape"], "T": row["T"], "phase": phase, "hf+comp_ms": base,
                    "mok_ms": row[f"mok_{phase}_ms"], "x_mok": base / row[f"mok_{phase}_ms"],
                    **{f"{lib}_gemms_ms": gemms[lib] for lib in LIBRARIES}, "x_bound": base / best,
                    "x_at_floor": base / row[f"floor_{phase}_ms"],
                    "x_target": TARGETS.get((row["shape"], phase), {}).get(row["T"])})
    return out


def table(rows) -> str:
    lines = ["| shape | T | phase | hf+comp ms | mok ms | x mok | GEMMs grouped ms | GEMMs per expert ms | x bound "
             "| x at floor | x target |", "|" + "---|" * 11]
    for row in rows:
        for b in bound_rows(row):
            target = "-" if b["x_target"] is None else f"{b['x_target']:.1f}"
            lines.append(f"| {b['shape']} | {b['T']} | {b['phase']} | {b['hf+comp_ms']:.3f} | {b['mok_ms']:.3f} | "
                         f"{b['x_mok']:.2f} | {b['grouped_gemms_ms']:.3f} | {b['per_expert_gemms_ms']:.3f} | "
                         f"{b['x_bound']:.2f} | {b['x_at_floor']:.2f} | {target} |")
    lines += ["", "| shape | T | GEMM | grouped ms | per expert ms | TFLOP/s of the faster |", "|" + "---|" * 6]
    for row in rows:
        for name in GEMMS:
            g, p = row["grouped_ms"][name], row["per_expert_ms"][name]
            lines.append(f"| {row['shape']} | {row['T']} | {name} | {g:.3f} | {p:.3f} | "
                         f"{row['flops'][name] / min(g, p) / 1e9:.0f} |")
    return "\n".join(lines)


def run_shape(name, tokens, ceilings, rounds, log) -> list[dict]:
    family, sizes, overrides, default_tokens = SHAPES[name]
    torch._dynamo.reset()
    block = build_block(family, sizes, overrides)
    tensors, kw = hf_blocks.op_arguments(family, block)
    runners = make_runners(family, block)
    shared = getattr(block, "shared_experts", None) or getattr(block, "shared_expert", None)
    params = [p for p in block.parameters() if p.requires_grad]
    rows = []
    for T in tokens or default_tokens:
        x, _, ids = layer_routing(name, T, block=block)
        counts = torch.bincount(ids.flatten(), minlength=sizes.experts)
        gemms = ExpertGemms(tensors[3], tensors[5], kw["transposed"], counts,
                            torch.Generator(device="cuda").manual_seed(1))
        row = {"shape": name, "T": T, "experts_hit": int((counts > 0).sum()), "flops": gemms.flops}
        row["floor_fwd_ms"], row["floor_fwd_bwd_ms"] = floors(T, sizes, row["experts_hit"], ceilings)
        xb = x.view(1, T, -1).clone().requires_grad_()
        timed = []
        for which in ("hf+comp", "mok"):
            step = fwd_bwd(runners[which], xb, params)
            step()  # compile / warm up
            timed += [(f"{which}_fwd", _no_grad(runners[which], xb)), (f"{which}_fwd_bwd", step)]
        for lib in LIBRARIES:
            for g in GEMMS:
                run = functools.partial(getattr(gemms, lib), g)
                timed.append((f"{lib}:{g}", graphed(run) or run))  # eager where the capture failed (reported)
        if shared is not None:
            timed += [("shared_fwd", _no_grad(shared, xb)), ("shared_fwd_bwd", fwd_bwd(shared, xb, params))]
        times = {k: statistics.median(v) for k, v in time_in_rounds(timed, rounds).items()}
        for k in ("hf+comp_fwd", "hf+comp_fwd_bwd", "mok_fwd", "mok_fwd_bwd"):
            row[f"{k}_ms"] = times[k]
        for phase in ("fwd", "fwd_bwd"):
            row[f"shared_{phase}_ms"] = times.get(f"shared_{phase}", 0.0)
        for lib in LIBRARIES:
            row[f"{lib}_ms"] = {g: times[f"{lib}:{g}"] for g in GEMMS}
        for b in bound_rows(row):
            log(f"  {name} T={T} {b['phase']}: x mok {b['x_mok']:.2f}, x bound {b['x_bound']:.2f}, "
                f"x at floor {b['x_at_floor']:.2f}, target {b['x_target']}")
        rows.append(row)
        del gemms, timed
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="qwen3,mixtral,deepseek_v3,gpt_oss")
    ap.add_argument("--tokens", default="", help="comma-separated T values (default: per shape)")
    ap.add_argument("--rounds", type=int, default=2, help="timing rounds per column, alternating order (medians)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    ceilings = measure_ceilings()
    print(f"ceilings: bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s, copy {ceilings['copy_tbps']:.2f} TB/s",
          flush=True)
    tokens = [int(t) for t in args.tokens.split(",") if t]
    rows = []
    for name in args.shapes.split(","):
        rows += run_shape(name, tokens, ceilings, args.rounds, lambda msg: print(msg, flush=True))
    write_json(args.out, "gemm_bound.json", {"ceilings": ceilings, "rows": rows})
    print(table(rows), flush=True)


if __name__ == "__main__":
    main()
