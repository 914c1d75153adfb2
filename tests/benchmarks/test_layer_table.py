"""The GPU layer benchmark's table, from a made-up row (the benchmark itself needs a GPU)."""

import dataclasses

import pytest
import torch

from benchmarks.moe_layer import SHAPES, check_expert_sizes, table
from mok_compile import hf_blocks


def _row():
    row = {"shape": "qwen3", "T": 4096, "mok_vs_hf_rel_err": 3.6e-5, "mok_graph_fwd_ms": 0.8,
           "mok_graph_fwd_bwd_ms": 2.8}
    times = {"fwd": (2.0, 1.2, 0.8, 0.75, 0.4), "fwd_bwd": (5.5, 3.4, 2.9, 2.85, 1.25)}
    for phase, (hf, comp, mok, mok_comp, floor) in times.items():
        row.update({f"hf_{phase}_ms": hf, f"hf+comp_{phase}_ms": comp, f"mok_{phase}_ms": mok,
                    f"mok+comp_{phase}_ms": mok_comp, f"floor_{phase}_ms": floor})
    for which in ("hf", "hf+comp", "mok", "mok+comp"):
        row[f"{which}_fwd_bwd_peak_gb"] = 0.25
    row["mok_held_gb"] = 0.0312
    return row


def test_table_gives_each_speedup_and_the_most_a_kernel_at_the_floor_could_give():
    lines = table([_row()], {"matmul_tflops": 736.0, "copy_tbps": 4.26}).splitlines()
    header = [c.strip() for c in lines[1].strip("|").split("|")]
    cells = [c.strip() for c in lines[3].strip("|").split("|")]
    assert len(lines[2].strip("|").split("|")) == len(header) == len(cells)
    assert header[2:10] == ["hf fwd", "hf+comp fwd", "mok fwd", "x", "mok+comp fwd", "x", "floor/mok", "x at floor"]
    # x = 1.2 / 0.8 and 1.2 / 0.75; floor/mok = 0.4 / 0.8; x at floor = 1.2 / 0.4
    assert cells[2:10] == ["2.000", "1.200", "0.800", "1.50", "0.750", "1.60", "0.50", "3.00"]
    assert header[10:18] == ["hf f+b", "hf+comp f+b", "mok f+b", "x", "mok+comp f+b", "x", "floor/mok", "x at floor"]
    assert cells[10:18] == ["5.500", "3.400", "2.900", "1.17", "2.850", "1.19", "0.43", "2.72"]
    assert header[18:20] == ["peak GB hf / comp / mok / mok+comp", "mok held GB"]
    assert cells[18:20] == ["0.25 / 0.25 / 0.25 / 0.25", "0.031"]


def test_time_in_rounds_times_every_column_each_round_in_alternating_order():
    from benchmarks.moe_layer import time_in_rounds

    calls = []

    def timer(fn):
        calls.append(fn())
        return float(len(calls))

    timed = [(key, (lambda k=key: k)) for key in ("a", "b", "c")]
    times = time_in_rounds(timed, 3, timer)
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert dict(times) == {"a": [1.0, 6.0, 7.0], "b": [2.0, 5.0, 8.0], "c": [3.0, 4.0, 9.0]}


def test_floor_reads_only_the_experts_hit_forward_and_writes_every_gradient_backward():
    from benchmarks.moe_layer import floors
    from mok_compile.hf_blocks import BlockSizes

    sizes = BlockSizes(hidden=2048, intermediate=768, experts=128, top_k=8)
    ceilings = {"matmul_tflops": 800.0, "copy_tbps": 4.0}
    expert_ms = 3 * 2048 * 768 * 2 / 4.0e9  # one expert's weights at 4 TB/s
    fwd, fwd_bwd = floors(1, sizes, 8, ceilings)  # one token: bandwidth-bound
    assert abs(fwd - 8 * expert_ms) < 1e-12
    assert abs(fwd_bwd - (2 * 8 + 128) * expert_ms) < 1e-12
    fwd, fwd_bwd = floors(16384, sizes, 128, ceilings)  # compute-bound
    flops = 16384 * 8 * 3 * 2 * 2048 * 768
    assert abs(fwd - flops / 800e9) < 1e-12 and abs(fwd_bwd - 3 * flops / 800e9) < 1e-12


def test_each_shape_builds_experts_of_its_sizes():
    """Every benchmark shape's block (built on the meta device) has expert weights of the sizes its floors are
    computed from (a config may map one size onto another: Inkling2's intermediate_size is its moe_intermediate_size);
    and the check names a block whose sizes differ."""
    def block_of(family, sizes, overrides):
        cfg = hf_blocks.make_config(family, sizes, **overrides)
        with torch.device("meta"):
            return hf_blocks.new_block(family, cfg)

    checked = 0
    for family, sizes, overrides, _ in SHAPES.values():
        if hf_blocks.available([family]) == (family,):
            check_expert_sizes(family, block_of(family, sizes, overrides), sizes)
            checked += 1
    assert checked >= 9
    family, sizes, overrides, _ = SHAPES["qwen3"]
    other = dataclasses.replace(sizes, intermediate=sizes.intermediate * 2)
    with pytest.raises(SystemExit, match="qwen3_moe: the block's experts are E, H, I"):
        check_expert_sizes(family, block_of(family, other, overrides), sizes)
