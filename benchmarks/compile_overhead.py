"""Compile-time overhead of `backend="mok"` over plain `backend="inductor"` (or aot_eager) on tiny HF MoE models.

    python -m benchmarks.compile_overhead [--families qwen3_moe mixtral] [--repeats 2] [--train]
                                          [--layers 48] [--compiler aot_eager]

Every measurement runs in its own fresh Python process with a fresh, empty
inductor cache directory and inductor's caches disabled, so neither backend
profits from the other's work (in-process code caches included). The time is
that of the first call (Dynamo trace + MoE pass + inductor compile + one tiny
run), taken as the median over `--repeats` processes. The MoE pass's own time
(`fuse_graph`, validation included) is reported separately. `--layers` deepens
the models (the pass's time should grow with the number of blocks, not with its
square); `--compiler aot_eager` compiles with aot_eager on both sides (and under
`mok` after the pass), which leaves the pass a larger share.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

BACKENDS = ("baseline", "mok")  # baseline: `--compiler` itself


def measure_once(family: str, backend: str, train: bool, layers: int = 2, compiler: str = "inductor") -> dict:
    """In this (fresh) process: seconds of the first compiled call, and of the MoE pass inside it."""
    import torch
    from torch._dynamo.utils import counters

    torch._inductor.config.force_disable_caches = True
    import mok_compile.backend as mok_backend
    from mok_compile.demo import make_causal_lm

    pass_seconds = []
    fuse_graph = mok_backend.fuse_graph

    def timed_fuse_graph(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fuse_graph(*args, **kwargs)
        finally:
            pass_seconds.append(time.perf_counter() - start)

    mok_backend.fuse_graph = timed_fuse_graph
    model = make_causal_lm(family, num_layers=layers).train(train)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    if backend == "mok":
        compiled = torch.compile(model, backend="mok", options={"compiler": compiler})
    else:
        compiled = torch.compile(model, backend=compiler)
    torch._dynamo.reset()
    start = time.perf_counter()
    with torch.set_grad_enabled(train):
        out = compiled(ids, labels=ids if train else None)
        if train:
            out.loss.backward()
    seconds = time.perf_counter() - start
    return {"family": family, "backend": backend, "seconds": seconds, "pass_seconds": sum(pass_seconds),
            "fused": counters["mok"]["fused_moe"], "graphs": counters["stats"]["unique_graphs"]}


def measure_in_fresh_process(family: str, backend: str, train: bool, layers: int, compiler: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="mok_bench_inductor_") as cache_dir:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
        cmd = [sys.executable, "-m", "benchmarks.compile_overhead", "--worker", family, backend, "--layers",
               str(layers), "--compiler", compiler]
        if train:
            cmd.append("--train")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{family}/{backend} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    from mok_compile.hf_blocks import FAMILIES

    p = argparse.ArgumentParser(prog="python -m benchmarks.compile_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--repeats", type=int, default=1, help="fresh processes per (family, backend); median taken")
    p.add_argument("--train", action="store_true", help="time a training step (forward + backward graphs)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers of each model")
    p.add_argument("--compiler", choices=("inductor", "aot_eager"), default="inductor",
                   help="the baseline backend, and mok's inner compiler")
    p.add_argument("--worker", nargs=2, metavar=("FAMILY", "BACKEND"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.layers < 1:
        p.error(f"--layers must be at least 1, not {args.layers}")
    if args.worker:
        print(json.dumps(measure_once(*args.worker, train=args.train, layers=args.layers, compiler=args.compiler)))
        return 0

    print(f"compile time of the first call, {'training' if args.train else 'inference'}, "
          f"median of {args.repeats} fresh process(es); tiny {args.layers}-layer CausalLMs, input 2x32, CPU; "
          f"baseline and inner compiler: {args.compiler}")
    print(f"{'family':<12} {args.compiler + ' s':>10} {'mok s':>8} {'mok pass s':>10} {'fused':>5} {'overhead':>9}")
    ratios = []
    for family in args.families:
        runs = {b: [] for b in BACKENDS}
        for _ in range(args.repeats):
            for backend in BACKENDS:  # interleaved, so machine load drifts hit both alike
                runs[backend].append(measure_in_fresh_process(family, backend, args.train, args.layers,
                                                              args.compiler))
        base = statistics.median(r["seconds"] for r in runs["baseline"])
        mok = statistics.median(r["seconds"] for r in runs["mok"])
        pass_s = statistics.median(r["pass_seconds"] for r in runs["mok"])
        fused = runs["mok"][0]["fused"]
        ratios.append(mok / base)
        print(f"{family:<12} {base:>10.2f} {mok:>8.2f} {pass_s:>10.3f} {fused:>5} {100 * (mok / base - 1):>+8.1f}%")
    geo = statistics.geometric_mean(ratios)
    print(f"geometric mean: mok / {args.compiler} = {geo:.3f} ({100 * (geo - 1):+.1f}% compile-time overhead; "
          "target < +10%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
