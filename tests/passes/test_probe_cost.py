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


@pytest.mark.parametrize("scales", [(1.5, 1.5), (1.5, 2.0)], ids=["identical", "near_miss_other_scale"])
def test_identical_layers_probed_once_under_dynamic_shapes(scales):
    """dynamic=True: the first layer reads the hidden size through a `size()` node of constant value where the second
    reads the int, and each layer's routed scale is a symbol of its own. Identical layers still share one probe; a
    layer whose scale differs (its symbol's value) is probed on its own."""
    torch.manual_seed(0)
    module = _TwoBlocks(*(models.StackedGatherMoE(scale=scale) for scale in scales)).eval()
    (graph,), eager = capture(_Residual(module), torch.randn(12, 32), dynamic=True)
    gm, example = graph
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True, True], str(report)
    identical = scales[0] == scales[1]
    assert (counters["mok"]["probe_runs"], counters["mok"]["probe_cached"]) == ((1, 1) if identical else (2, 0))
    torch.testing.assert_close(run(gm, example)[0], eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_identical_hf_layers_probed_once_under_dynamic_shapes(family):
    """Their routed scale (DeepSeek-V3) or clamp limit and alpha (GPT-OSS) is a graph input of its own in each layer
    under dynamic=True, met by the first layer's region in another order than by the others'."""
    from mok_compile.demo import make_causal_lm

    model = make_causal_lm(family, num_layers=4)
    (graph,), eager = capture(model, torch.randint(0, 128, (2, 7)), dynamic=True, use_cache=False)
    gm, example = graph
    report = fuse_moe(gm, example)
    assert len(report.fused) == 4 and not report.rejected, str(report)
    assert (counters["mok"]["probe_runs"], counters["mok"]["probe_cached"]) == (1, 3)
    torch.testing.assert_close(run(gm, example)[0], eager.logits, atol=1e-5, rtol=1e-5)


class _Residual(nn.Module):
    """x + block(tanh(x)) for each of the module's two blocks, as decoder layers chain them."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = blocks

    def forward(self, x):
        for block in (self.blocks.first, self.blocks.second):
            x = x + block(torch.tanh(x))
        return x


def test_the_key_names_symbols_by_first_use():
    """Two sizes of one symbol key apart from two symbols of the same value; renamed symbols key alike."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()

    def size(name):
        symbol = env.create_symbol(12, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC)
        return env.create_symintnode(symbol, hint=12)

    a, b, c = size("a"), size("b"), size("c")
    key = lambda *sizes: validate._Keyer().freeze(sizes)  # noqa: E731
    assert key(a, a) == key(c, c) and key(a, b * 2) == key(b, c * 2)
    assert key(a, a) != key(a, b) and key(a, b * 2) != key(a, a * 2)
    assert key(a, 32) == key(b, 32)


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
