"""The configs A/B's table switch, on the CPU (the A/B itself needs a GPU)."""

import json
import os

import torch

from benchmarks import configs_ab
from benchmarks.configs_ab import use_table
from mok_compile.kernels import configs, moe
from tests.kernels.test_configs import gpu_like


def test_use_table_switches_the_configs_and_drops_the_launch_plans(tmp_path, monkeypatch):
    """After `use_table(path)` the op's configs come from `path`, and no plan or graph recorded under the other table
    (whose key does not cover the table) replays."""
    dev = gpu_like(monkeypatch, "NVIDIA H200", (9, 0))
    mine = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
    path = tmp_path / "configs.json"
    path.write_text(json.dumps({"NVIDIA H200": {"gate_up/16bit/m256": mine}}))
    before = configs._JSON
    committed = configs.config("gate_up", torch.bfloat16, 256, dev)
    try:
        moe._FORWARD_PLANS._plans["recorded under the committed table"] = None
        moe.FORWARD_GRAPHS._graphs["captured under the committed table"] = None
        moe.BACKWARD_GRAPHS._graphs["captured under the committed table"] = None
        use_table(str(path))
        assert configs.config("gate_up", torch.bfloat16, 256, dev) == mine != committed
        assert not moe._FORWARD_PLANS._plans and not moe._BACKWARD_PLANS._plans and not len(moe.FORWARD_GRAPHS)
        assert not len(moe.BACKWARD_GRAPHS)
    finally:
        use_table(before)
    assert configs.config("gate_up", torch.bfloat16, 256, dev) == committed


def test_an_engine_side_forces_the_engine_over_the_committed_table_and_a_table_side_gives_it_back(tmp_path,
                                                                                                   monkeypatch):
    """`engine:VALUE` sets MOK_GEMM_ENGINE (`auto` unsets it) with the committed table; a table's path then restores
    the engine setting the process started with."""
    monkeypatch.delenv("MOK_GEMM_ENGINE", raising=False)
    monkeypatch.setattr(configs_ab, "_ENGINE_AT_START", None)
    path = tmp_path / "configs.json"
    path.write_text("{}")
    try:
        configs_ab.use_side(str(path))
        configs_ab.use_side("engine:sorted=triton")
        assert configs._JSON == configs_ab._COMMITTED
        assert configs.engine("down", 10_000) == "triton" and configs.engine("wgrad", 10_000) == "cutlass"
        configs_ab.use_side("engine:auto")
        assert "MOK_GEMM_ENGINE" not in os.environ and configs.engine("down", 10_000) == "cutlass"
        configs_ab.use_side("engine:triton")
        configs_ab.use_side(str(path))
        assert configs._JSON == str(path) and "MOK_GEMM_ENGINE" not in os.environ
    finally:
        configs_ab.use_side(configs_ab._COMMITTED)
    assert configs._JSON == configs_ab._COMMITTED
