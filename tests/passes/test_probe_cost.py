"""The probe's cost: one probe per distinct block structure in a graph, and few tokens when T is symbolic."""

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from mok_compile.hf_blocks import init_moe_weights_, make_config
from mok_compile.passes import fuse_moe, validate

from . import models
from .helpers import capture, run


@pytest.fixture
def probe_rows(monkeypatch):
    """Rows of the block input in every region run of the probe."""
    rows, real = [], validate.run_nodes

    def spy(gm, nodes, env, **kwargs):
        first = next(v for v in env.values() if isinstance(v, torch.Tensor))  # the block input comes first
        rows.append(first.reshape(-1, first.shape[-1]).shape[0])
        return real(gm, nodes, env, **kwargs)

    monkeypatch.setattr(validate, "run_nodes", spy)
    return rows


def test_identical_layers_probed_once(probe_rows):
    from transformers import AutoModelForCausalLM

    model = init_moe_weights_(AutoModelForCausalLM.from_config(make_config("qwen3_moe", num_layers=3))).eval()
    ids = torch.randint(0, 128, (2, 7))
    (graph,), eager = capture(model, ids, use_cache=False)
    report = fuse_moe(*graph)
    assert len(report.fused) == 3 and not report.rejected, str(report)
    assert counters["mok"]["probe_runs"] == 1 and counters["mok"]["probe_cached"] == 2
    assert len(probe_rows) >= 2  # the one probe ran its rounds (at least two)
    torch.testing.assert_close(run(*graph)[0], eager.logits, atol=1e-5, rtol=1e-5)


class _TwoBlocks(nn.Module):
    def __init__(self, first, second):
        super().__init__()
        self.first, self.second = first, second

    def forward(self, x):
        return self.second(self.first(x))


def test_blocks_differing_in_one_constant_are_probed_separately():
    """Same ops, shapes and dtypes; only the sentinel threshold differs (8: a no-op, 7: drops expert 7). The first
    block's output feeds the second directly: each is its own region."""
    torch.manual_seed(0)
    module = _TwoBlocks(models.SentinelMaskMoE(), models.SentinelMaskMoE(drop_from=7)).eval()
    (graph,), eager = capture(module, torch.randn(12, 32))
    report = fuse_moe(*graph)
    assert [b.fused for b in report.blocks] == [True, False], str(report)
    assert report.blocks[1].reason.startswith("probe: outputs differ")
    assert counters["mok"]["probe_runs"] == 2 and counters["mok"]["probe_cached"] == 0
    torch.testing.assert_close(run(*graph)[0], eager, atol=1e-5, rtol=1e-5)


def test_symbolic_tokens_probed_at_a_small_size(probe_rows):
    torch.manual_seed(0)
    (graph,), eager = capture(models.SentinelMaskMoE().eval(), torch.randn(300, 32), dynamic=True)
    gm, example = graph
    report = fuse_moe(gm, example)
    assert len(report.fused) == 1, str(report)
    assert probe_rows and max(probe_rows) <= validate.PROBE_TOKENS
    torch.testing.assert_close(run(gm, example)[0], eager, atol=1e-5, rtol=1e-5)


def test_static_tokens_probed_at_the_traced_size(probe_rows):
    """A static token count is baked into the graph's constants: the probe keeps it."""
    torch.manual_seed(0)
    (graph,), eager = capture(models.StackedGatherMoE().eval(), torch.randn(300, 32))
    report = fuse_moe(*graph)
    assert len(report.fused) == 1, str(report)
    assert set(probe_rows) == {300}
