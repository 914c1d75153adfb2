"""Host (CPU) time of mok's GPU path per call: what bounds the op at few tokens.

    python -m benchmarks.host_overhead [--tokens 16] [--variant qwen3] [--profile] [--launch-times]

At a few tokens the GPU work is microseconds, so a loop of calls without synchronisation runs at
the speed of the host: the time per call is the Python + launch cost. Measured for the forward op,
the backward op, autograd forward+backward, one Triton launch of a small kernel, and a few torch
calls for scale (Qwen3-30B-A3B layer shape, bf16).
"""

from __future__ import annotations

import argparse
import time

import torch

import mok_compile  # noqa: F401  (registers torch.ops.mok.*)
from benchmarks.moe_layer import SHAPES
from tests.kernels.cases import make_case


def layer_sizes(name) -> dict:
    """H, I, E, K of `benchmarks.moe_layer`'s shape `name`, as `make_case` takes them."""
    sizes = SHAPES[name][1]
    return dict(H=sizes.hidden, I=sizes.intermediate, E=sizes.experts, K=sizes.top_k)


def per_call_us(fn, reps=300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) / reps * 1e6
    torch.cuda.synchronize()
    return host


def launches(fn) -> int:
    """Triton kernel launches in one call of fn."""
    from triton.runtime.jit import JITFunction

    count, run = [0], JITFunction.run

    def counting(self, *a, **k):
        count[0] += 1
        return run(self, *a, **k)

    JITFunction.run = counting
    try:
        fn()
    finally:
        JITFunction.run = run
    return count[0]


def launch_times(fn, reps=200) -> dict:
    """Host us per call of fn spent inside each Triton kernel's launch (`JITFunction.run`: argument
    binding, cache lookup, the driver call), by kernel name."""
    from triton.runtime.jit import JITFunction

    spent, run = {}, JITFunction.run

    def timed(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return run(self, *a, **k)
        finally:
            name = self.fn.__name__
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0

    fn()
    JITFunction.run = timed
    try:
        for _ in range(reps):
            fn()
    finally:
        JITFunction.run = run
    torch.cuda.synchronize()
    return {name: t / reps * 1e6 for name, t in spent.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16)
    # big layers (mixtral, llama4) make their weights on the host: slow
    ap.add_argument("--variant", default="qwen3", choices=sorted(SHAPES))
    ap.add_argument("--profile", action="store_true", help="cProfile of the autograd fwd+bwd (host time by function)")
    ap.add_argument("--launch-times", action="store_true",
                    help="host time inside each Triton launch of the forward and backward ops")
    args = ap.parse_args()
    from mok_compile.kernels import dispatch

    tensors, kw = make_case(args.variant, T=args.tokens, **layer_sizes(args.variant), dtype=torch.bfloat16, device="cuda")
    out, w, ids = torch.ops.mok.fused_moe(*tensors, **kw)
    go = torch.randn_like(out)
    leaves = [t.detach().requires_grad_(t.is_floating_point()) if t is not None else None for t in tensors]
    counts = torch.zeros((1, 128), dtype=torch.int32, device="cuda")
    chunk_off = torch.empty_like(counts)
    e32 = torch.empty(128, dtype=torch.int32, device="cuda")
    a = torch.randn(16, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(128, 2048, device="cuda", dtype=torch.bfloat16)

    rows = {
        "mok.fused_moe forward (no grad)": lambda: torch.ops.mok.fused_moe(*tensors, **kw),
        "mok.fused_moe_backward": lambda: torch.ops.mok.fused_moe_backward(go, None, *tensors, w, ids, **kw),
        "autograd fwd+bwd (loss = out.sum())": lambda: torch.ops.mok.fused_moe(*leaves, **kw)[0].sum().backward(),
        "one Triton launch (_scan_kernel, 9 args)": lambda: dispatch._scan_kernel[(1,)](
            counts, chunk_off, e32, e32, e32, 1, 128, BLOCK_C=64, BLOCK_E=128),
        "torch.empty": lambda: torch.empty((16, 2048), device="cuda", dtype=torch.bfloat16),
        "a @ b.t() (cuBLAS)": lambda: a @ b.t(),
    }
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, T={args.tokens}")
    print(f"Triton launches: forward {launches(rows['mok.fused_moe forward (no grad)'])}, "
          f"backward {launches(rows['mok.fused_moe_backward'])}")
    print("| call | host us per call |\n|---|---|")
    host_us = {}
    for name, fn in rows.items():
        host_us[name] = per_call_us(fn)
        print(f"| {name} | {host_us[name]:.1f} |", flush=True)
    if args.launch_times:
        for name in ("mok.fused_moe forward (no grad)", "mok.fused_moe_backward"):
            per_kernel = launch_times(rows[name])
            print(f"{name}: Triton launches {sum(per_kernel.values()):.1f} us per call of {host_us[name]:.1f}: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in sorted(per_kernel.items(), key=lambda kv: -kv[1])))
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            rows["autograd fwd+bwd (loss = out.sum())"]()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
