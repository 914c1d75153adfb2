"""Host (CPU) time of mok's GPU path per call: what bounds the op at few tokens.

    python -m benchmarks.host_overhead [--tokens 16] [--variant qwen3] [--profile] [--launch-times]

At a few tokens the GPU work is microseconds, so a loop of calls without synchronisation runs at
the speed of the host: the time per call is the Python + launch cost. Measured for the forward op, the
backward op (alone, and reading what the training forward saved, as autograd calls it) and autograd
forward+backward (each also without launch plans, `plan.enabled = False`, and with Triton's own launch path,
`launch.fast_launch = False`, against mok's `Launcher`), one launch of a small kernel both ways, and a few torch
calls for scale (Qwen3-30B-A3B layer shape, bf16).
"""

from __future__ import annotations

import argparse
import time

import torch

import mok_compile  # noqa: F401  (registers torch.ops.mok.*)
from benchmarks.moe_layer import SHAPES
from mok_compile.kernels import launch, plan
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


def launch_times(fn, reps=200) -> dict:
    """{kernel name: (host us per call of fn spent launching it, launches per call)}: the time inside
    `Launcher.run` (mok's launch path: Triton's own launch the first time per argument key, then the
    direct one), with launch plans off (a plan's replay launches without `Launcher.run`)."""
    Launcher = launch.Launcher
    spent, run = {}, Launcher.run
    planned, plan.enabled = plan.enabled, False

    def timed(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return run(self, *a, **k)
        finally:
            t, n = spent.get(self.fn.__name__, (0.0, 0))
            spent[self.fn.__name__] = t + time.perf_counter() - t0, n + 1

    fn()
    Launcher.run = timed
    try:
        for _ in range(reps):
            fn()
    finally:
        Launcher.run, plan.enabled = run, planned
    torch.cuda.synchronize()
    return {name: (t / reps * 1e6, n // reps) for name, (t, n) in spent.items()}


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

    scan_args = (counts, chunk_off, e32, e32, e32, 1, 128)
    h, logits, layout = torch.ops.mok.fused_moe_train(*tensors, **kw)[3:6]  # what autograd's backward reads
    rows = {
        "mok.fused_moe forward (no grad)": lambda: torch.ops.mok.fused_moe(*tensors, **kw),
        "mok.fused_moe_backward": lambda: torch.ops.mok.fused_moe_backward(go, None, *tensors, w, ids, **kw),
        "mok.fused_moe_backward, as autograd calls it (saved h, logits, layout)":
            lambda: torch.ops.mok.fused_moe_backward(go, None, *tensors, w, ids, **kw, gate_up_out=h,
                                                     router_logits=logits, routing_layout=layout),
        "autograd fwd+bwd (loss = out.sum())": lambda: torch.ops.mok.fused_moe(*leaves, **kw)[0].sum().backward(),
        "one launch, Triton's (_scan_kernel, 9 args)": lambda: dispatch._scan_kernel[(1,)](
            *scan_args, BLOCK_C=64, BLOCK_E=128),
        "one launch, mok's Launcher (the same)": lambda: launch.launcher(dispatch._scan_kernel)[(1,)](
            *scan_args, BLOCK_C=64, BLOCK_E=128),
        "torch.empty": lambda: torch.empty((16, 2048), device="cuda", dtype=torch.bfloat16),
        "a @ b.t() (cuBLAS)": lambda: a @ b.t(),
    }
    ops = list(rows)[:4]
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, T={args.tokens}")
    print("| call | host us per call | without launch plans | with Triton's launch |\n|---|---|---|---|")
    host_us = {}
    for name, fn in rows.items():
        host_us[name] = per_call_us(fn)
        unplanned = slow = ""
        if name in ops:  # the same call without plans, and through Triton's own launch path
            planned, plan.enabled = plan.enabled, False
            fast, launch.fast_launch = launch.fast_launch, False
            try:
                slow = f"{per_call_us(fn):.1f}"
                launch.fast_launch = fast
                unplanned = f"{per_call_us(fn):.1f}"
            finally:
                plan.enabled, launch.fast_launch = planned, fast  # as they were (MOK_* variables keep them off)
        print(f"| {name} | {host_us[name]:.1f} | {unplanned} | {slow} |", flush=True)
    for name in ops[:3]:
        per_kernel = launch_times(rows[name], reps=200 if args.launch_times else 1)
        line = f"{name}: {sum(n for _, n in per_kernel.values())} Triton launches"
        if args.launch_times:
            line += (f", {sum(t for t, _ in per_kernel.values()):.1f} us of {host_us[name]:.1f} per call: "
                     + ", ".join(f"{k} {t:.1f}" for k, (t, _) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])))
        print(line)
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
