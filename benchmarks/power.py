"""Power, SM clock and energy per call of compiled HF's MoE layer and of the op, while each runs back to back.

    python -m benchmarks.power [--shapes qwen3:4096,mixtral:16384] [--phases fwd,fwd_bwd] [--seconds 1.0]
        [--rounds 4] [--out DIR]

Why: at the issue's shapes the H200 runs these layers at its power limit (about 690 W of 700), where the SM clock
falls to 1.4-1.9 GHz from the 1.98 GHz it boosts to (NOTES v42 (8), v43 (3)). There a call's time is its energy
divided by the limit, so a kernel change pays only where it removes work (FLOPs, bytes moved), not where it
overlaps work with other work; and a side whose glue is memory-bound runs at a higher clock than one that fused the
glue away. The time ratio alone does not show this; this benchmark puts each side's clock, power and
joules per call next to it.

Per shape (`name:T`, a `benchmarks.moe_layer` shape; HF's block with random weights, the layer benchmark's input)
and phase (fwd: no grad; fwd_bwd: forward and backward of the layer benchmark's loss): blocks of back-to-back calls
of about `--seconds` each, the sides alternating (A B, B A, ...) over `--rounds`; nvidia-smi samples power and SM
clock every 20 ms (power as `power.draw.instant` where the driver has it: `power_field`). A block's clock and power
are the means of the samples in its middle (its first 20% and last 5% left out: the clock settles after a change of
load). Sides: "hf+comp" (HF's block under torch.compile, inductor) and "mok" (the op called eagerly, as the layer
table's mok column). Energy per call = mean power x GPU time per call (CUDA events over the block). The floor is the
layer benchmark's (`moe_layer.floors`), from its two ceilings measured the same way, over blocks of back-to-back
calls at the power limit (`sustained_ceilings`): a dense bf16 matmul runs 8-17% slower there than in `do_bench`'s
short bursts (NOTES v43 (3)). Writes power.json under --out.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from datetime import datetime

import torch

from benchmarks.fwd_kernels import parse_shapes
from benchmarks.moe_layer import (SHAPES, _no_grad, build_block, floors, fwd_bwd, make_runners, measure_ceilings,
                                  write_json)

SIDES = ("hf+comp", "mok")
PHASES = ("fwd", "fwd_bwd")
SAMPLE_MS = 20


def power_field() -> str:
    """The nvidia-smi field to sample power from: `power.draw.instant` where the driver has it, else `power.draw`.
    On Ampere and later `power.draw` is a mean over the last second, so in blocks of a second or less it mixes in
    whatever ran before (a run of 0.5 s blocks on the H200 read 481-633 W where runs of 0.8 s blocks had read
    686-695 W for the same calls at the same SM clocks, which are sampled instantly)."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=power.draw.instant", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30)
    try:
        float(out.stdout.split("\n")[0])
    except ValueError:
        return "power.draw"
    return "power.draw.instant"


def parse_samples(lines) -> list[tuple[float, float, float]]:
    """(unix time, SM clock MHz, power W) of each well-formed line of `nvidia-smi --query-gpu=timestamp,clocks.sm,
    <power field> --format=csv,noheader,nounits` (lines it could not parse, e.g. "[N/A]", are skipped)."""
    samples = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            stamp = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((stamp, float(parts[1]), float(parts[2])))
        except ValueError:
            continue
    return samples


def block_means(t0: float, t1: float, samples, skip_head=0.2, skip_tail=0.05):
    """(mean SM clock, mean power, samples used) over the samples in the middle of the block [t0, t1]; NaNs where
    none fall there (a block shorter than a few sampling periods)."""
    lo, hi = t0 + skip_head * (t1 - t0), t1 - skip_tail * (t1 - t0)
    mid = [(clock, power) for stamp, clock, power in samples if lo <= stamp <= hi]
    if not mid:
        return float("nan"), float("nan"), 0
    return statistics.mean(c for c, _ in mid), statistics.mean(p for _, p in mid), len(mid)


def summarize(blocks, samples) -> dict:
    """{side: {ms, mhz, watts, joules, blocks, samples}} from (side, t0, t1, ms per call) blocks: medians over each
    side's blocks (joules = watts * ms / 1000 per block, then the median); samples: how many fell in the blocks."""
    per: dict = {}
    for side, t0, t1, ms in blocks:
        mhz, watts, used = block_means(t0, t1, samples)
        entry = per.setdefault(side, {"ms": [], "mhz": [], "watts": [], "joules": [], "samples": []})
        entry["ms"].append(ms)
        entry["mhz"].append(mhz)
        entry["watts"].append(watts)
        entry["joules"].append(watts * ms / 1000)
        entry["samples"].append(used)
    return {side: {"ms": statistics.median(v["ms"]), "mhz": statistics.median(v["mhz"]),
                   "watts": statistics.median(v["watts"]), "joules": statistics.median(v["joules"]),
                   "blocks": len(v["ms"]), "samples": sum(v["samples"])}
            for side, v in per.items()}


def power_limit() -> str:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,power.limit,clocks.max.sm", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return out.stdout.strip()


def ms_per_call(fn, calls: int) -> float:
    """GPU ms per call over `calls` back-to-back calls (CUDA events around them); returns once they have run."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def run_blocks(fns: dict, seconds: float, rounds: int) -> tuple[list, list]:
    """Alternating blocks of back-to-back calls of each fn in `fns` while nvidia-smi samples; (blocks, samples)."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    calls = {side: max(5, int(seconds * 1000 / ms_per_call(fn, 10))) for side, fn in fns.items()}
    # to a file, not a pipe: a pipe's buffer (64 KB, about 25 s of samples) would fill and stall the sampling
    log = tempfile.TemporaryFile(mode="w+")
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu=timestamp,clocks.sm,{power_field()}",
                            "--format=csv,noheader,nounits", "-lms", str(SAMPLE_MS)], stdout=log, text=True)
    try:
        time.sleep(0.5)
        blocks, order = [], list(fns)
        for r in range(rounds):
            for side in (order if r % 2 == 0 else order[::-1]):
                torch.cuda.synchronize()
                t0 = time.time()
                ms = ms_per_call(fns[side], calls[side])
                blocks.append((side, t0, time.time(), ms))
        time.sleep(0.2)
    finally:
        smi.terminate()
        smi.wait()
        log.seek(0)
        lines = log.read().splitlines()
        log.close()
    return blocks, parse_samples(lines)


def sustained_ceilings(seconds: float, rounds: int) -> dict:
    """The layer benchmark's two ceilings (`moe_layer.measure_ceilings`), each timed over blocks of back-to-back calls
    like the layers here, with their clock and power: at the power limit a dense matmul runs slower than in
    `do_bench`'s short bursts, so floors from these ceilings are the ones to hold sustained layer times against."""
    stats = {}

    def time_all(fns):
        blocks, samples = run_blocks(fns, seconds, rounds)
        stats.update(summarize(blocks, samples))
        return {name: s["ms"] for name, s in stats.items()}

    ceilings = measure_ceilings(time_all)
    for name, s in stats.items():
        ceilings[f"{name}_mhz"], ceilings[f"{name}_watts"] = s["mhz"], s["watts"]
    return ceilings


def run_shape(name: str, T: int, phases, seconds: float, rounds: int, ceilings: dict) -> list[dict]:
    family, sizes, overrides, _ = SHAPES[name]
    torch._dynamo.reset()
    block = build_block(family, sizes, overrides)
    runners = make_runners(family, block)
    params = [p for p in block.parameters() if p.requires_grad]  # as moe_layer's fwd+bwd steps
    x = torch.randn(1, T, sizes.hidden, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        topk_ids = runners["mok"](x, with_ids=True)[1]
    experts_hit = int(torch.unique(topk_ids).numel())
    floor = dict(zip(PHASES, floors(T, sizes, experts_hit, ceilings)))
    rows = []
    for phase in phases:
        if phase == "fwd":
            fns = {side: _no_grad(runners[side], x) for side in SIDES}
        else:
            fns = {side: fwd_bwd(runners[side], x.clone().requires_grad_(), params) for side in SIDES}
        blocks, samples = run_blocks(fns, seconds, rounds)
        rows.append({"shape": name, "T": T, "phase": phase, "experts_hit": experts_hit, "floor_ms": floor[phase],
                     "sides": summarize(blocks, samples)})
    return rows


def table(rows) -> str:
    lines = ["| shape | T | phase | side | ms per call | SM MHz | W | J per call | time ratio | energy ratio "
             "| floor / time |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = r["sides"]["hf+comp"]
        for side, s in r["sides"].items():
            lines.append(f"| {r['shape']} | {r['T']} | {r['phase']} | {side} | {s['ms']:.3f} | {s['mhz']:.0f} | "
                         f"{s['watts']:.0f} | {s['joules']:.3f} | {base['ms'] / s['ms']:.2f} | "
                         f"{base['joules'] / s['joules']:.2f} | {r['floor_ms'] / s['ms']:.2f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3:4096,mixtral:16384")
    ap.add_argument("--phases", default="fwd")
    ap.add_argument("--seconds", type=float, default=1.0, help="length of one block of calls")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    phases = args.phases.split(",")
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        raise SystemExit(f"--phases: unknown {', '.join(unknown)} (known: {', '.join(PHASES)})")
    shapes = parse_shapes(args.shapes)
    print(f"GPU, power limit, max SM clock: {power_limit()}; power sampled as {power_field()}")
    ceilings = sustained_ceilings(args.seconds, args.rounds)
    print("sustained ceilings: matmul {matmul_tflops:.0f} TFLOP/s at {matmul_mhz:.0f} MHz, {matmul_watts:.0f} W; copy "
          "{copy_tbps:.2f} TB/s at {copy_mhz:.0f} MHz, {copy_watts:.0f} W".format(**ceilings), flush=True)
    rows = []
    for name, T in shapes:
        rows += run_shape(name, T, phases, args.seconds, args.rounds, ceilings)
        print(table(rows[-len(phases):]).split("\n", 2)[2], flush=True)
    print(table(rows))
    print("time / energy ratio = compiled HF's / the side's (> 1: the side is faster / uses less energy per call); "
          "floor / time: the fraction of the floor (moe_layer.floors) from the sustained ceilings above")
    if args.out:
        write_json(args.out, "power.json", {"ceilings": ceilings, "rows": rows})


if __name__ == "__main__":
    main()
