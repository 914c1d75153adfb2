"""The fused op's C++ CPU kernel against transformers' own MoE block on the CPU.

    python -m benchmarks.cpu_op [--tokens 512] [--reps 7] [--threads N]

A Qwen3-MoE block (H=1024, I=512, E=32, top-4, fp32, random weights std 0.02),
built by `mok_compile.hf_blocks.make_block` with
  hf:eager       experts_implementation="eager" (Python loop over the experts hit)
  hf:grouped_mm  experts_implementation="grouped_mm" (transformers' default)
  mok            torch.ops.mok.fused_moe on the block's own weights (router included;
                 CPU dispatch key -> csrc/fused_moe_cpu.cpp)
forward (no_grad) and forward+backward (loss = sum(out * g); x and all weights
require grad). Each time is the median of --reps rounds after two warm-up
rounds, all in one process; in every round each variant runs once, so that load
from other processes on the machine slows all of them alike.

"floor" runs the experts' FLOPs as dense GEMMs of one shared weight
([T*K, H] @ [H, 2I] and [T*K, I] @ [I, H]; forward+backward adds the four
gradient GEMMs). No grouping reaches it: every expert reads its own weights
(192 MB in fp32 here), and per-expert GEMMs have only ~T*K/E rows.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import mok_compile  # noqa: F401  (registers torch.ops.mok.*)
from mok_compile.hf_blocks import BlockSizes, make_block, op_arguments
from mok_compile.ops import cpu

FAMILY = "qwen3_moe"
SIZES = BlockSizes(hidden=1024, intermediate=512, experts=32, top_k=4)


def median_times_ms(runners: dict, reps: int, warmup: int = 2) -> dict:
    """Median time of each runner; runners take turns in every round, so that a busy machine
    (other processes on the same cores) slows them alike instead of whichever ran during a burst."""
    for _ in range(warmup):
        for fn in runners.values():
            fn()
    times = {name: [] for name in runners}
    for _ in range(reps):
        for name, fn in runners.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def hf_runner(block, x, grad_out, backward: bool):
    x, grad_out = x.unsqueeze(0), grad_out.unsqueeze(0)  # HF blocks take [batch, seq, hidden]
    if not backward:
        def run():
            with torch.no_grad():
                return block(x)
        return run
    params = [p for p in block.parameters()]

    def run_backward():
        for p in params:
            p.grad = None
        xg = x.detach().requires_grad_(True)
        out = block(xg)
        out = out[0] if isinstance(out, tuple) else out
        (out * grad_out).sum().backward()
    return run_backward


def mok_runner(tensors, kw, x, grad_out, backward: bool):
    if not backward:
        def run():
            with torch.no_grad():
                return torch.ops.mok.fused_moe(x, *tensors, **kw)
        return run
    leaves = [None if t is None else t.detach().requires_grad_(True) for t in tensors]

    def run_backward():
        for t in leaves:
            if t is not None:
                t.grad = None
        xg = x.detach().requires_grad_(True)
        out, _, _ = torch.ops.mok.fused_moe(xg, *leaves, **kw)
        (out * grad_out).sum().backward()
    return run_backward


def dense_floor_runner(T: int, backward: bool):
    """The experts' FLOPs as dense GEMMs of the same shapes (forward: 2, forward+backward: 6)."""
    H, I, K = SIZES.hidden, SIZES.intermediate, SIZES.top_k
    xs, w1 = torch.randn(T * K, H), torch.randn(2 * I, H)
    a, w2 = torch.randn(T * K, I), torch.randn(H, I)
    dh, dy = torch.randn(T * K, 2 * I), torch.randn(T * K, H)

    def run():
        xs @ w1.t()
        a @ w2.t()
        if backward:
            dy.t() @ a, dy @ w2  # dW2, dA
            dh.t() @ xs, dh @ w1  # dW1, dX
    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    T = args.tokens
    print(f"{FAMILY} block H={SIZES.hidden} I={SIZES.intermediate} E={SIZES.experts} top-{SIZES.top_k}, T={T}, "
          f"fp32, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"CPU kernel in use: {cpu.kernel_name()}")

    torch.manual_seed(0)
    x = torch.randn(T, SIZES.hidden)
    grad_out = torch.randn(T, SIZES.hidden)
    blocks = {impl: make_block(FAMILY, SIZES, experts_implementation=impl) for impl in ("eager", "grouped_mm")}
    tensors, kw = op_arguments(FAMILY, blocks["grouped_mm"])

    # Same numbers before timing anything.
    with torch.no_grad():
        ref = blocks["grouped_mm"](x.unsqueeze(0))
        ref = (ref[0] if isinstance(ref, tuple) else ref).squeeze(0)
        out = torch.ops.mok.fused_moe(x, *tensors, **kw)[0]
    print(f"max |mok - hf:grouped_mm| = {(out - ref).abs().max().item():.2e} (output scale "
          f"{ref.abs().max().item():.2e})")

    rows = []
    for backward in (False, True):
        label = "forward+backward" if backward else "forward"
        runners = {f"hf:{impl}": hf_runner(block, x, grad_out, backward) for impl, block in blocks.items()}
        runners["mok"] = mok_runner(tensors, kw, x, grad_out, backward)
        runners["floor"] = dense_floor_runner(T, backward)
        times = median_times_ms(runners, args.reps)
        best_hf = min(times["hf:eager"], times["hf:grouped_mm"])
        rows.append((label, times, best_hf / times["mok"]))

    print(f"\n{'':18}{'hf:eager':>12}{'hf:grouped_mm':>15}{'mok':>10}{'floor':>10}   mok vs faster hf")
    for label, times, speedup in rows:
        print(f"{label:18}{times['hf:eager']:10.1f}ms{times['hf:grouped_mm']:13.1f}ms{times['mok']:8.1f}ms"
              f"{times['floor']:8.1f}ms   {speedup:.2f}x")


if __name__ == "__main__":
    main()
