"""Blocks under autocast (`passes.autocast`): the probe runs the region under the block's autocast, entered around
the compiled call or inside it, and the op's reference without any; a bf16 block fuses, and so does an fp32
transformers block (its bf16 router left in the graph), while fp32 experts that autocast runs in bf16 do not, and
their report says why."""

import pytest
import torch
import torch.nn as nn

from mok_compile.hf_blocks import make_block
from mok_compile.ops import reference
from mok_compile.passes import autocast, fuse_moe, validate
from mok_compile.passes.op_names import op_name, tensor_meta

from . import models
from .helpers import capture, count_fused, run

BF16 = dict(atol=2e-2, rtol=2e-2)


class AutocastInside(nn.Module):
    """The block inside `torch.autocast` in the compiled code: Dynamo writes the span into the graph."""

    def __init__(self, enabled=True):
        super().__init__()
        self.moe, self.enabled = models.StackedGatherMoE(), enabled

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.enabled):
            return self.moe(x)


def _block(where: str, dtype: torch.dtype):
    """(module, input, a context the compiled call runs in) with the block under autocast `where`."""
    torch.manual_seed(0)
    module = models.StackedGatherMoE() if where == "around" else AutocastInside()
    module, x = module.to(dtype), torch.randn(12, 32, dtype=dtype)
    around = torch.autocast("cpu", dtype=torch.bfloat16, enabled=where == "around")
    return module, x, around


def _fuse_under(module, x, around):
    """Capture `module(x)` and run the pass on its graph, both under `around` (as the backend runs, inside the
    compiled call's autocast): (the graph, its code before the pass, the report, the graph's output, eager's)."""
    with around:
        (graph,), eager = capture(module, x)
        gm, example = graph
        code = gm.code
        report = fuse_moe(gm, example)
        got = run(gm, example)[0]
    return gm, code, report, got, eager


@pytest.mark.parametrize("where", ["around", "inside"])
def test_a_bf16_block_under_autocast_is_fused(where):
    gm, _, report, got, eager = _fuse_under(*_block(where, torch.bfloat16))
    assert count_fused(gm) == 1 and report.fused[0].autocast == (("cpu", torch.bfloat16),)
    torch.testing.assert_close(got, eager, **BF16)


def test_an_fp32_transformers_block_under_autocast_is_fused_with_its_router_left_in_the_graph():
    """fp32 weights under bf16 autocast (HF Trainer's `bf16=True`): autocast runs the router's linear in bf16, while
    transformers casts the experts' input back to the fp32 weights and weighs their fp32 rows by bf16 routing
    weights. The linear stays in the graph (its logits in another dtype than the op's own) and the op takes its
    logits; the weights are rounded to bf16 and kept in fp32 (round_weights_to)."""
    block = make_block("qwen3_moe")
    x = torch.randn(2, 6, block.gate.weight.shape[1])
    gm, _, report, got, eager = _fuse_under(block, x, torch.autocast("cpu", dtype=torch.bfloat16))
    assert count_fused(gm) == 1, str(report)
    r = report.fused[0].routing
    assert (r.router_is_logits, r.weights_fp32, r.round_weights_to) == (True, True, torch.bfloat16)
    (op,) = [n for n in gm.graph.nodes if n.op == "call_function" and "mok" in str(n.target)]
    logits = op.args[1]
    assert op_name(logits) == "linear" and tensor_meta(logits).dtype == torch.bfloat16
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("where", ["around", "inside"])
def test_near_miss_an_fp32_block_under_autocast_is_left_unfused_and_says_why(where):
    """Experts on bmm's, which autocast runs in bf16 on fp32 weights: the op runs fp32 experts there."""
    gm, code, report, _, _ = _fuse_under(*_block(where, torch.float32))
    (block,) = report.blocks
    assert not block.fused and gm.code == code
    assert "autocast (cpu, bfloat16) is on around this block" in block.reason
    assert "model.to(torch.bfloat16)" in block.reason


def test_the_probe_runs_the_region_under_autocast_and_the_reference_without(monkeypatch):
    seen = {"region": set()}
    real_run, real_reference = validate._run_node, reference.fused_moe_reference

    def run_node(*args, **kwargs):
        seen["region"].add(torch.is_autocast_enabled("cpu"))
        return real_run(*args, **kwargs)

    def fused_moe_reference(*args, **kwargs):
        seen["reference"] = torch.is_autocast_enabled("cpu")
        return real_reference(*args, **kwargs)

    monkeypatch.setattr(validate, "_run_node", run_node)
    monkeypatch.setattr(reference, "fused_moe_reference", fused_moe_reference)
    module, x, around = _block("inside", torch.bfloat16)
    (graph,), _ = capture(module, x)  # no autocast around: the span in the graph is the block's
    gm, example = graph
    assert fuse_moe(gm, example).fused
    assert seen == {"region": {True}, "reference": False}


def test_the_autocast_each_node_runs_under():
    """Nested spans (the inner one turning autocast off), and nodes outside any: the compile's own autocast."""
    def fn(x):
        a = x.sin()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            b = a.cos()
            with torch.autocast("cpu", enabled=False):
                c = b.exp()
            d = c.tanh()
        return d.neg()

    (graph,), _ = capture(fn, torch.randn(4))
    gm, _ = graph
    by_name = {n.name: n for n in gm.graph.nodes}
    bf16 = ("cpu", torch.bfloat16)
    of = lambda states, *names: autocast.block_autocast([by_name[n] for n in names], states)  # noqa: E731
    states = autocast.node_states(gm.graph)
    assert [states[by_name[n]] for n in ("a", "b", "c", "d", "neg")] == [(), (bf16,), (), (bf16,), ()]
    assert of(states, "a", "b", "c") == (bf16,)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        states = autocast.node_states(gm.graph)
    assert [states[by_name[n]] for n in ("a", "c", "neg")] == [(bf16,), (), (bf16,)]
    assert autocast.hint(()) is None


def test_a_router_that_turns_autocast_off_inside_the_block_is_fused():
    """Ernie 4.5's router computes its logits in fp32 inside `torch.autocast(..., enabled=False)`: under autocast the
    block's nodes run under two autocasts, each as in the graph."""

    class Fp32RouterMoE(models.StackedGatherMoE):
        def route(self, x):
            with torch.autocast("cpu", enabled=False):
                scores = torch.nn.functional.linear(x.float(), self.router.float()).sigmoid()
            ids = torch.topk(scores + self.choice_bias.float(), self.top_k, dim=-1, sorted=False).indices
            w = scores.gather(1, ids)
            return w / w.sum(dim=-1, keepdim=True) * self.scale, ids.reshape(-1)

    torch.manual_seed(0)
    module, x = Fp32RouterMoE().to(torch.bfloat16), torch.randn(12, 32, dtype=torch.bfloat16)
    gm, _, report, got, eager = _fuse_under(module, x, torch.autocast("cpu", dtype=torch.bfloat16))
    assert count_fused(gm) == 1 and report.fused[0].autocast == (("cpu", torch.bfloat16),)
    torch.testing.assert_close(got, eager, **BF16)


def test_a_checkpointed_block_runs_under_the_autocast_of_its_call():
    """A checkpointed region called inside an autocast span: its body's nodes run under the span's autocast."""
    from torch.utils.checkpoint import checkpoint

    class CheckpointedUnderAutocast(nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = models.StackedGatherMoE()

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return checkpoint(self.moe, torch.tanh(x), use_reentrant=False)

    torch.manual_seed(0)
    module, x = CheckpointedUnderAutocast().to(torch.bfloat16), torch.randn(12, 32, dtype=torch.bfloat16)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(module, backend=backend, fullgraph=True)(x.requires_grad_())
    ((gm, example),) = graphs
    report = fuse_moe(gm, example)
    assert [(b.fused, b.checkpointed, b.autocast) for b in report.blocks] == [(True, True, (("cpu", torch.bfloat16),))]


def test_explain_marks_blocks_under_autocast(capsys):
    import mok_compile

    module, x, around = _block("inside", torch.bfloat16)
    report = mok_compile.explain(module, x)
    assert [b.fused for b in report.blocks] == [True]
    assert "autocast=cpu:bfloat16" in capsys.readouterr().out
