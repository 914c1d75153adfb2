"""mok's GEMM engines against each other on one MoE layer: all Triton, all CUTLASS, and the built-in choice.

    python -m benchmarks.engines --out DIR [--shapes qwen3,mixtral] [--tokens 256,4096] [--kernels] [--host]
        [--engines "triton;cutlass;auto;gathered=triton,sorted=cutlass,wgrad=cutlass"]

For each shape, T and engine (`MOK_GEMM_ENGINE`): forward and forward+backward of the op alone
(no HF baseline: this picks `configs.engine`'s thresholds; benchmarks.moe_layer compares with HF),
called eagerly and replayed from a CUDA graph (GPU time without Python launch cost), and the max
|difference| of the output, input gradient and weight-gradient norms from the first engine's run.
`--kernels` adds the GPU time per kernel name (torch.profiler) of one forward and one fwd+bwd (after it, eager
timings of later engines carry the profiler's hooks: use it alone);
`--host` a cProfile of the eager fwd+bwd's host time (first engine). Peak memory is one fwd+bwd's
max_memory_allocated minus what was allocated before it.
Writes engines.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from benchmarks.moe_layer import SHAPES, bench, build_block, fwd_bwd, graphed, host_profile, peak_bytes
from mok_compile import hf_blocks

ENGINES = ("triton", "cutlass", "auto")


def _set_engine(engine):
    if engine == "auto":
        os.environ.pop("MOK_GEMM_ENGINE", None)
    else:
        os.environ["MOK_GEMM_ENGINE"] = engine


def profiled(step, steps: int):
    """torch.profiler (GPU activity) over `steps` calls of `step`, after 2 calls of warm-up."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return prof


def kernel_times(step, top=16, steps=3) -> dict:
    """GPU ms per `step` of each kernel (torch.profiler over `steps` calls after 2 of warm-up), names cut to 60
    characters, the `top` largest (all: top=None)."""
    return per_kernel_ms(profiled(step, steps), steps, top)


def per_kernel_ms(prof, steps: int, top=16) -> dict:
    """`kernel_times` from a profile of `steps` calls: ms per call of each kernel name, the `top` largest."""
    times = {}
    for ev in prof.key_averages():
        if ev.device_time_total > 0:
            key = ev.key[:60]
            times[key] = times.get(key, 0.0) + ev.device_time_total / steps / 1e3  # ms per step
    return {k: round(v, 4) for k, v in sorted(times.items(), key=lambda kv: -kv[1])[:top]}


def warm_host_profile(step, log):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    log(host_profile(step, steps=20, rows=25)[-6000:])


def run(name, T, engines, with_kernels, with_host, log):
    family, sizes, overrides, _ = SHAPES[name]
    block = build_block(family, sizes, overrides)
    tensors, kw = hf_blocks.op_arguments(family, block)
    params = [p for p in block.parameters() if p.requires_grad]
    x = (torch.randn(T, sizes.hidden, device="cuda", dtype=torch.bfloat16)).requires_grad_()

    def op(inp):
        return torch.ops.mok.fused_moe(inp, *tensors, **kw)[0]

    rows, first = [], None
    for engine in engines:
        _set_engine(engine)
        step = fwd_bwd(op, x, params)
        step()
        if with_host and first is None:
            warm_host_profile(step, log)
        # output and input gradient in full; weight gradients by their norms (a full copy of DeepSeek-V3's
        # weight gradients would not fit next to them)
        result = [op(x).detach(), x.grad.clone()] + [p.grad.float().norm() for p in params if p.grad is not None]
        diff = 0.0 if first is None else max((a.float() - b.float()).abs().max().item() for a, b in zip(result, first))
        first = first or result

        def fwd():
            with torch.no_grad():
                op(x)

        g_fwd, g_fb = graphed(fwd), graphed(step)
        row = dict(shape=name, T=T, engine=engine, fwd_ms=bench(fwd), fwd_bwd_ms=bench(step),
                   graph_fwd_ms=bench(g_fwd) if g_fwd else float("nan"),
                   graph_fwd_bwd_ms=bench(g_fb) if g_fb else float("nan"), max_diff_vs_first=diff,
                   peak_gb=peak_bytes(step) / 1e9)
        if with_kernels:
            row["fwd_kernels_ms"] = kernel_times(fwd)
            row["kernels_ms"] = kernel_times(step)
        log(f"{name:12s} T={T:6d} {engine:8s} fwd {row['fwd_ms']:.3f} (graph {row['graph_fwd_ms']:.3f}) "
            f"f+b {row['fwd_bwd_ms']:.3f} (graph {row['graph_fwd_bwd_ms']:.3f}) peak {row['peak_gb']:.2f} GB "
            f"max|diff| {diff:.2e}")
        if with_kernels:
            log("    fwd: " + ", ".join(f"{k}: {v}" for k, v in row["fwd_kernels_ms"].items()))
            log("    f+b: " + ", ".join(f"{k}: {v}" for k, v in row["kernels_ms"].items()))
        rows.append(row)
        del g_fwd, g_fb
    _set_engine("auto")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="qwen3,mixtral,deepseek_v3,gpt_oss")
    ap.add_argument("--tokens", default="", help="comma list; default: each shape's own")
    ap.add_argument("--engines", default=";".join(ENGINES), help="';'-separated MOK_GEMM_ENGINE values")
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--host", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    def log(msg):
        print(msg, flush=True)

    rows = []
    for name in args.shapes.split(","):
        tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else SHAPES[name][3]
        for T in tokens:
            rows += run(name, T, args.engines.split(";"), args.kernels, args.host, log)
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "engines.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
