"""One MoE layer with fp32 weights under bf16 autocast, HF Trainer's `bf16=True`: compiled transformers against
`backend="mok"`.

    python -m benchmarks.autocast_layer --out DIR [--shapes qwen3,mixtral] [--tokens 4096] [--rounds 3]
        [--without-autocast]

transformers' block (its default `grouped_mm` experts) with fp32 weights (std 0.02), called under
`torch.autocast("cuda", dtype=torch.bfloat16)`: autocast runs the router's linear in bf16 and transformers runs the
experts in fp32 (under torch.compile, on fp32 weights, its `grouped_mm` falls back to one fp32 GEMM per expert).
Columns, all under the same autocast:
  hf        the block, eager
  hf+comp   the block under torch.compile (inductor, static shapes)
  mok+comp  the block under torch.compile(backend="mok"), which must fuse it (checked): the router's bf16 linear
            stays in the graph and the op runs the fp32 experts
forward (no_grad) and forward+backward (loss = mean(out^2), x and all weights require grad), medians over --rounds
rounds of triton.testing.do_bench, the order reversed every other round. x = hf+comp's time / the column's. Also the
output's error against hf's, relative to its norm. `--without-autocast`: the same fp32 block with no autocast (an fp32
model: the router in fp32 too). Writes autocast_layer.json under --out.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch._dynamo.utils import counters

import mok_compile  # noqa: F401  (registers torch.ops.mok.*)
from mok_compile.backend import mok_backend

from .moe_layer import SHAPES, block_output, build_block, fwd_bwd, time_in_rounds, write_json


def under_autocast(fn, enabled: bool):
    def run(x):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=enabled):
            return fn(x)

    return run


def runners(block, autocast: bool) -> dict:
    def hf(x):
        return block_output(block(x))

    def hf_for_mok(x):  # its own code object: Dynamo caches per code object, one backend each
        return block_output(block(x))

    return {"hf": under_autocast(hf, autocast),
            "hf+comp": under_autocast(torch.compile(hf, dynamic=False), autocast),
            "mok+comp": under_autocast(torch.compile(hf_for_mok, backend=mok_backend, dynamic=False), autocast)}


def run_shape(name, tokens, rounds, log, autocast=True) -> list[dict]:
    family, sizes, overrides, _ = SHAPES[name]
    torch._dynamo.reset()
    block = build_block(family, sizes, overrides, dtype=torch.float32)
    fns = runners(block, autocast)
    params = [p for p in block.parameters() if p.requires_grad]
    rows = []
    for T in tokens:
        x = torch.randn(1, T, sizes.hidden, device="cuda")
        row = {"shape": name, "T": T, "autocast": autocast}
        timed = []
        with torch.no_grad():
            ref = fns["hf"](x).float()
        for which, fn in fns.items():
            fused_before = counters["mok"]["fused_moe"]
            with torch.no_grad():
                out = fn(x).float()
            if which == "mok+comp" and counters["mok"]["fused_moe"] == fused_before:
                raise SystemExit(f"{name} T={T}: backend='mok' fused no MoE block (see "
                                 "mok_compile.diagnostics.explain); its column would time plain inductor")
            row[f"{which}_rel_err"] = ((out - ref).norm() / ref.norm()).item()
            step = fwd_bwd(fn, x.clone().requires_grad_(), params)
            step()  # compile / warm up
            step()

            def forward(fn=fn):
                with torch.no_grad():
                    return fn(x)

            timed += [(f"{which}_fwd", forward), (f"{which}_fwd_bwd", step)]
        for key, ts in time_in_rounds(timed, rounds).items():
            row[f"{key}_ms"] = statistics.median(ts)
        for kind in ("fwd", "fwd_bwd"):
            base = row[f"hf+comp_{kind}_ms"]
            log(f"{name} T={T} {kind}: " + ", ".join(
                f"{w} {row[f'{w}_{kind}_ms']:.3f} ms ({base / row[f'{w}_{kind}_ms']:.2f}x)" for w in fns))
        log(f"{name} T={T} output vs hf (relative): " + ", ".join(f"{w} {row[f'{w}_rel_err']:.1e}" for w in fns))
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="qwen3,mixtral")
    ap.add_argument("--tokens", default="4096", help="comma-separated T values")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--without-autocast", action="store_true", help="the fp32 block with no autocast around it")
    args = ap.parse_args()
    under = "no autocast" if args.without_autocast else "bf16 autocast"
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; fp32 weights, {under}; "
          "x = hf+comp's time / the column's", flush=True)
    rows = []
    for name in args.shapes.split(","):
        rows += run_shape(name, [int(t) for t in args.tokens.split(",")], args.rounds,
                          lambda msg: print(msg, flush=True), autocast=not args.without_autocast)
        write_json(args.out, "autocast_layer.json", {"rows": rows})


if __name__ == "__main__":
    main()
