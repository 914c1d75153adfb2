"""GPU time of the forward at a few tokens: mok's op and transformers' block compiled by inductor, each replayed
from a CUDA graph, and the kernels of one replay of each (torch.profiler).

    python benchmarks/few_tokens.py qwen3 1,4,16,64

At a few tokens the eager and compiled columns of `benchmarks.moe_layer` time the host (and under
`--mode reduce-overhead`, inductor's CUDA-graph wrapper); this times the GPU work alone, as a serving stack that
captures its whole decode step sees it (NOTES v25 (2)). Medians of 5 rounds of `do_bench`, the order alternating.
`do_bench` clears L2 before each call, and so does the kernel listing before its replay: back to back, part of a
step's weights would stay in L2 and the kernels would read faster than the timed replays (NOTES v26 (7)).
"""

import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import mok_compile  # noqa: F401  (registers torch.ops.mok.*)
from benchmarks.moe_layer import SHAPES, build_block, graphed, make_runners, time_in_rounds


def kernels_of(replay) -> list:
    """(start us, duration us, name) of each kernel of one replay, L2 cleared before it (as `do_bench` does)."""
    for _ in range(3):
        replay()
    l2 = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")  # triton's do_bench clears 256 MB too
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        l2.zero_()
        replay()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)[1:]  # the first is the clearing
    t0 = events[0].time_range.start if events else 0
    return [(e.time_range.start - t0, e.time_range.elapsed_us(), e.name) for e in events]


def main(name: str, tokens: list):
    family, sizes, overrides, _ = SHAPES[name]
    block = build_block(family, sizes, overrides)
    runners = make_runners(family, block)
    torch._dynamo.config.cache_size_limit = 64
    for T in tokens:
        x = torch.randn(1, T, sizes.hidden, device="cuda", dtype=torch.bfloat16)
        replays = {}
        for which in ("mok", "hf+comp"):
            fn = runners[which]
            with torch.no_grad():
                fn(x)
                fn(x)
                replay = graphed(lambda: fn(x))
            if replay is not None:
                replays[which] = replay
        times = time_in_rounds(list(replays.items()), 5)
        line = ", ".join(f"{which} {statistics.median(ts) * 1e3:.1f} us" for which, ts in times.items())
        print(f"{name} T={T} graph replay: {line}", flush=True)
        for which, replay in replays.items():
            kernels = kernels_of(replay)
            span = kernels[-1][0] + kernels[-1][1] if kernels else 0.0
            print(f"  {which}: {len(kernels)} kernels, span {span:.1f} us", flush=True)
            for start, duration, kernel in kernels:
                print(f"    {start:7.1f} +{duration:6.1f}  {kernel[:90]}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], [int(t) for t in sys.argv[2].split(",")])
