"""GPU time of the forward at a few tokens: mok's op and transformers' block compiled by inductor, each replayed
from a CUDA graph, and the kernels of one replay of each (torch.profiler).

    python benchmarks/few_tokens.py qwen3 1,4,16,64
    python benchmarks/few_tokens.py qwen3 1,16,64,256 --eager
    python benchmarks/few_tokens.py qwen3 1,16,64,256 --train

With --eager it times what a caller without CUDA graphs of its own gets instead (NOTES v49): compiled HF, the op
called eagerly and transformers' block under `backend="mok"` (default mode), each with the op's own few-token
graphs (`mok_compile.kernels.graphs`) off and on, in the same alternating rounds, and the op replayed from an outer
graph (its GPU time) as the bound; x = compiled HF's time / that column's. With --train the same for a training
step (forward + backward of the layer benchmark's loss, x and every weight requiring grad; NOTES v50): the op's
graphs then serve the training forward, and the backward runs its launches.

At a few tokens the eager and compiled columns of `benchmarks.moe_layer` time the host (and under
`--mode reduce-overhead`, inductor's CUDA-graph wrapper); this times the GPU work alone, as a serving stack that
captures its whole decode step sees it (NOTES v25 (2)). Medians of 5 rounds of `do_bench`, the order alternating.
`do_bench` clears L2 before each call, and so does the kernel listing before its replay: back to back, part of a
step's weights would stay in L2 and the kernels would read faster than the timed replays (NOTES v26 (7)).
"""

import functools
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import mok_compile  # noqa: F401  (registers torch.ops.mok.*)
from benchmarks.moe_layer import (SHAPES, build_block, fwd_bwd, graphed, make_runners, time_in_rounds,
                                  with_op_graphs)


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


def eager_ab(name: str, tokens: list, rounds: int = 5, train: bool = False):
    """Per T: ms of compiled HF, mok and mok+comp with the op's graphs off and on, and mok from an outer graph;
    forwards, or with `train` training steps."""
    family, sizes, overrides, _ = SHAPES[name]
    block = build_block(family, sizes, overrides)
    runners = make_runners(family, block)
    params = [p for p in block.parameters() if p.requires_grad]
    torch._dynamo.config.cache_size_limit = 64

    print(f"{name}: ms per {'training step' if train else 'forward'}; x = hf+comp / column", flush=True)
    print("| T | hf+comp | mok, no graphs | mok | mok+comp, no graphs | mok+comp | mok from an outer graph |\n"
          "|---|---|---|---|---|---|---|", flush=True)
    for T in tokens:
        x = torch.randn(1, T, sizes.hidden, device="cuda", dtype=torch.bfloat16)

        def step(which):
            if train:
                return fwd_bwd(runners[which], x.clone().requires_grad_(), params)
            return functools.partial(runners[which], x)

        timed = [("hf+comp", with_op_graphs(step("hf+comp"), False, grad=train))]
        for which in ("mok", "mok+comp"):
            timed += [(f"{which} off", with_op_graphs(step(which), False, grad=train)),
                      (which, with_op_graphs(step(which), True, grad=train))]
        for _, run in timed:  # compile, warm up, capture
            for _ in range(3):
                run()
        with torch.set_grad_enabled(train):
            outer = graphed(step("mok"))
        timed.append(("outer", outer))
        times = {k: statistics.median(v) for k, v in time_in_rounds(timed, rounds).items()}
        hf = times["hf+comp"]
        cells = [f"{hf:.3f}"] + [f"{times[k]:.3f} ({hf / times[k]:.2f}x)" for k, _ in timed[1:]]
        print(f"| {T} | " + " | ".join(cells) + " |", flush=True)


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
    shape, tokens, flags = sys.argv[1], [int(t) for t in sys.argv[2].split(",")], sys.argv[3:]
    if "--eager" in flags or "--train" in flags:
        eager_ab(shape, tokens, train="--train" in flags)
    else:
        main(shape, tokens)
