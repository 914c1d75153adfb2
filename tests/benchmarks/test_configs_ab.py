"""The configs A/B's table switch, on the CPU (the A/B itself needs a GPU)."""

import json

import torch

from benchmarks.configs_ab import use_table
from mok_compile.kernels import configs, moe
from tests.kernels.test_configs import gpu_like


def test_use_table_switches_the_configs_and_drops_the_launch_plans(tmp_path, monkeypatch):
    """After `use_table(path)` the op's configs come from `path`, and no plan recorded under the other table (whose
    signature does not cover the table) replays."""
    dev = gpu_like(monkeypatch, "NVIDIA H200", (9, 0))
    mine = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
    path = tmp_path / "configs.json"
    path.write_text(json.dumps({"NVIDIA H200": {"gate_up/16bit/m256": mine}}))
    before = configs._JSON
    committed = configs.config("gate_up", torch.bfloat16, 256, dev)
    try:
        moe._FORWARD_PLANS._plans["recorded under the committed table"] = None
        use_table(str(path))
        assert configs.config("gate_up", torch.bfloat16, 256, dev) == mine != committed
        assert not moe._FORWARD_PLANS._plans and not moe._BACKWARD_PLANS._plans
    finally:
        use_table(before)
    assert configs.config("gate_up", torch.bfloat16, 256, dev) == committed
