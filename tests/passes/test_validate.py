"""The numerical probe accepts the spec read off the graph and rejects near-miss specs."""

import dataclasses

import pytest
import torch

from mok_compile.hf_blocks import make_block
from mok_compile.ops.spec import op_kwargs
from mok_compile.passes.dataflow import Dataflow
from mok_compile.passes.experts import match_experts
from mok_compile.passes.fuse_moe import _expert_inputs, _roles
from mok_compile.passes.region import block_anchors, find_region
from mok_compile.passes.rewrite import plan_rewrite
from mok_compile.passes.routing import match_router
from mok_compile.passes.validate import probe

from . import models
from .helpers import capture


def _probe_setup(module, x):
    (graph,), _ = capture(module.eval(), x)
    gm, _ = graph
    flow = Dataflow(gm.graph)
    (topk, ids), = block_anchors(gm, flow)
    region = find_region(gm, flow, topk, ids)
    router = match_router(region)
    experts = match_experts(flow, region, router)
    plan = plan_rewrite(flow, region, router.weights, _expert_inputs(experts))
    operands = [region.x, router.weight, router.bias, router.selection_bias, experts.gate_up, experts.gate_up_bias,
                experts.down, experts.down_bias]

    def check(routing=None, expert=None, **operand_changes):
        routing = routing or router.spec
        expert = expert or experts.specs[0]
        ops = list(operands)
        for index, value in operand_changes.items():
            ops[int(index[1:])] = value
        kw = {**op_kwargs(routing, expert), "_intermediate": experts.intermediate}
        return probe(gm, flow, region, _roles(router, experts), ops, kw, plan.exports)

    return check, router.spec, experts.specs[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_probe_separates_renormalisation(dtype):
    check, routing, expert = _probe_setup(make_block("mixtral", dtype=dtype), torch.randn(2, 5, 64, dtype=dtype))
    assert routing.renormalize
    assert check() is None
    assert "outputs differ" in check(routing=dataclasses.replace(routing, renormalize=False))
    assert "outputs differ" in check(routing=dataclasses.replace(routing, routed_scale=1.1))
    assert "outputs differ" in check(expert=dataclasses.replace(expert, activation="gelu_tanh"))


def test_probe_separates_selection_bias_and_groups():
    torch.manual_seed(0)
    check, routing, expert = _probe_setup(make_block("deepseek_v3", dtype=torch.float32), torch.randn(2, 8, 64))
    assert check() is None
    assert "different experts" in check(o3=None)  # selection bias dropped
    assert check(routing=dataclasses.replace(routing, n_group=1, topk_group=1)) is not None


def test_probe_separates_interleaved_and_clamp():
    check, routing, expert = _probe_setup(make_block("gpt_oss", dtype=torch.float32), torch.randn(2, 5, 64))
    assert check() is None
    assert "outputs differ" in check(expert=dataclasses.replace(expert, interleaved=False))
    assert "outputs differ" in check(expert=dataclasses.replace(expert, limit=3.0))


def test_probe_reports_a_region_it_cannot_run():
    torch.manual_seed(0)
    check, routing, expert = _probe_setup(models.StackedGatherMoE(), torch.randn(10, 32))
    assert check() is None
    assert "failed to run" in check(o4=None)


def test_probe_rounds_never_hold_two_copies_of_the_weights(monkeypatch):
    """Each round of the probe draws a fresh copy of the block's inputs, weights included (22 GB for a DeepSeek-V3
    layer): when a round starts drawing, nothing the rounds before it drew is still alive."""
    import weakref

    from mok_compile.passes import validate

    rounds, alive_at_start, real_random = [], [], validate._random
    first_meta = []

    def counted(meta, std, gen, subs=None):
        if not first_meta or meta is first_meta[0]:  # each round draws the same inputs in the same order
            first_meta[:] = [meta]
            alive_at_start.append(sum(ref() is not None for refs in rounds for ref in refs))
            rounds.append([])
        t = real_random(meta, std, gen, subs)
        rounds[-1].append(weakref.ref(t))
        return t

    monkeypatch.setattr(validate, "_random", counted)
    check, _, _ = _probe_setup(make_block("mixtral", dtype=torch.float32), torch.randn(2, 5, 64))
    assert check() is None
    assert len(rounds) >= 2 and all(len(refs) >= 4 for refs in rounds)  # x, router, gate_up, down
    assert alive_at_start == [0] * len(rounds), alive_at_start
