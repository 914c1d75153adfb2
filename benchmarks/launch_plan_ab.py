"""Launch plans on and off, alternating in one process: the op's time per call at a few tokens.

Host time at few tokens moves +-30% between runs on the GPU machine's host, so only an in-process A/B separates
a change of this size from the noise.

    python -m benchmarks.launch_plan_ab [--variants qwen3,gpt_oss] [--tokens 256]

For the op's forward, its backward as autograd calls it (reading the saved h, logits and layout) and an autograd
fwd+bwd (`loss = out.sum()`, gradients accumulating): 24 alternating blocks of 30 calls with plans on and off
(`plan.enabled`), each block ended by a synchronize, so a block's time per call is max(host, GPU); medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import mok_compile  # noqa: F401  (registers torch.ops.mok.*)
from benchmarks.host_overhead import layer_sizes
from benchmarks.moe_layer import time_in_rounds
from mok_compile.kernels import plan
from tests.kernels.cases import make_case


def alternate(fn, blocks=24, calls=30) -> dict:
    """{plans on?: median us per call} over `blocks` rounds of one block with plans on and one off, the order
    alternating (`moe_layer.time_in_rounds`)."""
    before = plan.enabled

    def block(on):
        def run():
            plan.enabled = on
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / calls * 1e6

        return run

    for on in (True, False):
        plan.enabled = on
        for _ in range(10):
            fn()
    res = time_in_rounds([(True, block(True)), (False, block(False))], blocks, timer=lambda run: run())
    plan.enabled = before
    return {on: statistics.median(v) for on, v in res.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="qwen3,gpt_oss")
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    T = args.tokens
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, T={T}")
    for variant in args.variants.split(","):
        tensors, kw = make_case(variant, T=T, **layer_sizes(variant), dtype=torch.bfloat16, device="cuda")
        out, w, ids = torch.ops.mok.fused_moe(*tensors, **kw)
        go = torch.randn_like(out)
        leaves = [t.detach().requires_grad_(t.is_floating_point()) if t is not None else None for t in tensors]
        h, logits, layout = torch.ops.mok.fused_moe_train(*tensors, **kw)[3:6]
        calls = {
            "forward": lambda: torch.ops.mok.fused_moe(*tensors, **kw),
            "backward as autograd calls it": lambda: torch.ops.mok.fused_moe_backward(
                go, None, *tensors, w, ids, **kw, gate_up_out=h, router_logits=logits, routing_layout=layout),
            "autograd fwd+bwd": lambda: torch.ops.mok.fused_moe(*leaves, **kw)[0].sum().backward(),
        }
        for name, fn in calls.items():
            us = alternate(fn)
            print(f"{variant} T={T} {name}: plans on {us[True]:.1f} / off {us[False]:.1f} us per call "
                  f"({us[False] / us[True]:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
