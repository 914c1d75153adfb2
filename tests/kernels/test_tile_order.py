"""The grouped GEMMs' tile order (`grouped_gemm._tile_of`): every (row block, N tile) exactly once, GROUP_M row
blocks at a time, for grids whose row blocks are not a multiple of GROUP_M. Run under TRITON_INTERPRET=1 in a
subprocess (the variable must be set before Triton is imported)."""

import pytest

from tests.kernels.interpreted import background, run_interpreted, script_argv

pytest.importorskip("triton")

_SCRIPT = r"""
import json
import torch
import triton
import triton.language as tl
from mok_compile.kernels.grouped_gemm import _tile_of

@triton.jit
def order(out_ptr, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    m, n = _tile_of(pid, N, BLOCK_N, GROUP_M)
    tl.store(out_ptr + 2 * pid, m)
    tl.store(out_ptr + 2 * pid + 1, n)

res = []
for num_m, N, group in [(11, 24, 8), (5, 100, 8), (16, 64, 8), (7, 16, 1), (3, 48, 4), (1, 16, 8)]:
    num_n = triton.cdiv(N, 16)
    out = torch.full((num_m * num_n, 2), -1, dtype=torch.int32)
    order[(num_m * num_n,)](out, N, BLOCK_N=16, GROUP_M=group)
    res.append(dict(num_m=num_m, num_n=num_n, group=group, tiles=out.tolist()))
print(json.dumps(res))
"""


@background(script_argv(_SCRIPT))
def test_every_tile_once_in_groups_of_row_blocks():
    for case in run_interpreted(_SCRIPT):
        num_m, num_n, group, tiles = case["num_m"], case["num_n"], case["group"], case["tiles"]
        assert sorted(map(tuple, tiles)) == [(m, n) for m in range(num_m) for n in range(num_n)], case
        for pid, (m, n) in enumerate(tiles):
            first = pid // (group * num_n) * group  # the group's first row block
            size = min(num_m - first, group)
            assert first <= m < first + size, case
            assert (m - first, n) == (pid % (group * num_n) % size, pid % (group * num_n) // size), case
