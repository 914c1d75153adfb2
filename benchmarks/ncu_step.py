"""One fwd+bwd step of mok's op at a benchmark shape, between cudaProfilerStart and Stop, for Nsight Compute.

    python benchmarks/ncu_step.py qwen3 4096

NOTES v25 (1) ran it on the H200 as (ncu works on that lease; leave the clocks alone):
    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --metrics breakdown:sm__throughput.avg.pct_of_peak_sustained_elapsed,\
breakdown:gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct \
        python3 benchmarks/ncu_step.py qwen3 4096
The step is the layer benchmark's (loss = mean(out^2)), after three warm-up steps.
"""

import sys

import torch

import mok_compile  # noqa: F401  (registers torch.ops.mok.*)
from benchmarks.moe_layer import SHAPES, build_block, fwd_bwd, make_runners


def main(name: str, T: int):
    family, sizes, overrides, _ = SHAPES[name]
    block = build_block(family, sizes, overrides)
    mok = make_runners(family, block)["mok"]
    params = [p for p in block.parameters() if p.requires_grad]
    x = torch.randn(1, T, sizes.hidden, device="cuda", dtype=torch.bfloat16).requires_grad_()
    step = fwd_bwd(mok, x, params)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
