"""`Dispatch.block_table`: each row block's (expert, first row, end of the expert's rows) as the grouped GEMMs read
it, against the same table built in Python from the expert counts. Under TRITON_INTERPRET=1 in a subprocess, and on
the GPU."""

import pytest

from tests.kernels.interpreted import background, run_interpreted, script_argv

pytest.importorskip("triton")

_CASES = r"""
import torch
from tests.kernels.cases import generator
from mok_compile.kernels.dispatch import Dispatch, grid_rows

def expected(counts, starts, E, rows, block_m):
    blocks = [[e, s + block_m * b, s + c, 0] for e, (c, s) in enumerate(zip(counts, starts))
              for b in range(-(-c // block_m))]
    return blocks + [[E, 0, 0, 0]] * (rows - len(blocks))

def compare(device):
    res = []
    # (T, K, E, skew): one token; most experts empty (every token on experts 0..K-1); an expert count that is
    # no power of 2; more experts than one program's row blocks; DeepSeek-V3's 256 experts; no token at all.
    for T, K, E, skew in [(1, 2, 8, False), (300, 4, 16, True), (37, 3, 12, False), (200, 2, 130, False),
                          (64, 8, 256, False), (0, 2, 8, False)]:
        g = generator(T * 7 + E)
        if skew:
            ids = torch.arange(K).repeat(T, 1)
        else:
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K)
        disp = Dispatch.from_ids(ids.to(torch.int32).to(device), E)
        counts, starts = disp.expert_count.tolist(), disp.expert_start.tolist()
        for block_m in (16, 64, 128):
            table = disp.block_table(block_m)
            rows = grid_rows(T * K, E, block_m)
            res.append(dict(case=[T, K, E, block_m], shape=list(table.shape), rows=rows,
                            equal=table.tolist() == expected(counts, starts, E, rows, block_m),
                            kept=disp.block_table(block_m) is table,
                            surplus=rows - sum(-(-c // block_m) for c in counts)))
    return res
"""


def _check(results):
    assert len(results) == 18
    for r in results:
        assert r["shape"] == [r["rows"], 4] and r["equal"] and r["kept"], r
    # Coverage: most cases have grid rows past the last block, whose entries `equal` checked as (E, 0, 0, 0).
    assert sum(r["surplus"] > 0 for r in results) >= 10


_CPU_RUN = _CASES + "import json\nprint(json.dumps(compare('cpu')))\n"


@background(script_argv(_CPU_RUN))
def test_block_table_lists_each_experts_row_blocks_in_order():
    _check(run_interpreted(_CPU_RUN))


@pytest.mark.gpu
def test_block_table_lists_each_experts_row_blocks_in_order_on_the_gpu():
    scope = {}
    exec(_CASES, scope)
    _check(scope["compare"]("cuda"))
