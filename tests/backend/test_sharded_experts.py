"""`backend="mok"` on MoE blocks whose experts are sharded across ranks (transformers' tensor and expert parallelism).

The op computes a whole block on one rank, so a block whose experts are sharded is left unfused, with a reason
that names the sharding (`mok_compile.passes.sharded`), and the model computes what it computes eagerly. Two gloo
ranks on the CPU, each sharded by transformers' own plans (5.17's API and 5.21's).
"""

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import mok_compile
from mok_compile.backend import mok_backend
from mok_compile.passes import sharded

from .distributed import experts_tensor_parallel_exists, process_group, sharded_rank_step, spawn


def test_expert_parallel_inference_left_unfused_with_the_reason():
    spawn(sharded_rank_step, 2, "ep", False)


def test_all_to_all_expert_parallel_reports_the_experts_alone():
    pytest.importorskip("transformers.distributed.expert_parallel", reason="all-to-all EP: transformers 5.21+")
    spawn(sharded_rank_step, 2, "ep_all_to_all", False)


def test_tensor_parallel_training_left_unfused_with_the_reason():
    if not experts_tensor_parallel_exists():
        pytest.skip("this transformers no longer shards experts by tensor parallelism (`moe_tp_experts`: gone in 5.28)")
    spawn(sharded_rank_step, 2, "tp", True)


class ShardedHead(nn.Module):
    def __init__(self):
        super().__init__()
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, distribute_tensor

        weight = torch.randn(32, 32) / 32 ** 0.5
        self.weight = nn.Parameter(distribute_tensor(weight, init_device_mesh("cpu", (1,)), [Replicate()]))

    def forward(self, x):
        return x @ self.weight.to_local()


class ShardOutsideTheBlock(nn.Module):
    """Near miss: a block the pass rejects for its own reason (squared routing weights), followed by a module that
    reads a DTensor shard of its own, downstream of the routing but outside the block's module: the reason must
    not blame sharding."""

    def __init__(self):
        super().__init__()
        from tests.passes.models import SquaredWeightsMoE

        self.moe = SquaredWeightsMoE()
        self.head = ShardedHead()

    def forward(self, x):
        return self.head(self.moe(x))


def test_shard_outside_the_block_is_not_blamed():
    torch.manual_seed(0)
    with process_group():
        model = ShardOutsideTheBlock()
        x = torch.randn(10, 32)
        # The backend as a callable: the GPU machine runs a checkout without the installed entry point.
        got = torch.compile(model, backend=mok_backend, options={"compiler": "aot_eager"})(x)
        torch.testing.assert_close(got, model(x))
        report = mok_compile.explain(model, x)
    assert counters["mok"]["rejected_moe"] >= 1 and not report.fused, str(report)
    (block,) = report.rejected
    assert block.reason and sharded.REASON not in block.reason, block.reason
