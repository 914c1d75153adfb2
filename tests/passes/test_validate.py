"""The numerical probe accepts the spec read off the graph and rejects near-miss specs."""

import dataclasses
import operator

import pytest
import torch

from mok_compile.hf_blocks import FAMILIES, WEIGHT_ON_INPUT_FAMILIES, make_block
from mok_compile.ops.spec import op_kwargs
from mok_compile.passes.dataflow import Dataflow
from mok_compile.passes.experts import match_experts
from mok_compile.passes.fuse_moe import _expert_inputs, _roles
from mok_compile.passes.region import block_anchors, find_region
from mok_compile.passes.rewrite import plan_rewrite
from mok_compile.passes.routing import match_router
from mok_compile.passes.validate import WritesProtected, live_inputs, probe, run_nodes

from . import models
from .helpers import capture, weights_out_of_memory


def _probe_setup(module, x, own_weights=False):
    """(check, routing, expert): check(...) probes the block with its routing, expert spec or operands changed;
    `own_weights`: the graph's live inputs are given to the probe, to fall back on."""
    (graph,), _ = capture(module.eval(), x)
    gm, example_inputs = graph
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
        live = live_inputs(gm, example_inputs) if own_weights else None
        return probe(gm, flow, region, _roles(router, experts), ops, kw, plan.exports, live=live)

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


def test_the_probe_on_the_models_own_weights_still_separates_near_misses(monkeypatch):
    """With no memory for a copy of the weights, the probe runs on the block's own ones and rejects the same near
    misses, saying it ran on them; without the live inputs it can only report the shortage."""
    from torch._dynamo.utils import counters

    weights_out_of_memory(monkeypatch)  # the expert weights ([8, 64, 32] and up)
    module = make_block("mixtral", dtype=torch.float32)
    check, routing, expert = _probe_setup(module, torch.randn(2, 5, 64), own_weights=True)
    counters.clear()
    assert check() is None
    assert counters["mok"]["probe_own_weights"] == 1
    why = check(routing=dataclasses.replace(routing, renormalize=False))
    assert why.startswith("probe on the model's own weights (no memory for a copy of them): probe: outputs differ")
    why = check(expert=dataclasses.replace(expert, activation="gelu_tanh"))
    assert "outputs differ" in why

    check, _, _ = _probe_setup(module, torch.randn(2, 5, 64), own_weights=False)
    why = check()
    assert why.startswith("probe: out of memory on cpu") and "no live graph inputs" in why


OWN_WEIGHTS_FAMILIES = [*FAMILIES, *WEIGHT_ON_INPUT_FAMILIES, "deepseek_v2"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", OWN_WEIGHTS_FAMILIES)
def test_every_family_fuses_on_its_own_weights(monkeypatch, family, dtype):
    """With no memory for a copy of the expert weights, every HF family's block is proved on its own weights and
    fuses, its output as eager's: the grown inputs stop where they saturate the router (DeepSeek-V2's group-limited
    softmax underflows to ties at the largest scales)."""
    from torch._dynamo.utils import counters

    from mok_compile.passes.fuse_moe import fuse_moe

    from .helpers import count_fused, run

    weights_out_of_memory(monkeypatch)
    (graph,), eager = capture(make_block(family, dtype=dtype), torch.randn(2, 16, 64, dtype=dtype))
    gm, example = graph
    counters.clear()
    report = fuse_moe(gm, example)
    assert counters["mok"]["probe_own_weights"] == 1 and count_fused(gm) == 1, str(report)
    got = run(gm, example)
    got = got[0] if isinstance(got, (tuple, list)) else got
    want = eager[0] if isinstance(eager, (tuple, list)) else eager
    torch.testing.assert_close(got, want, **({"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}))


def test_grown_inputs_that_tie_the_routing_would_disprove_a_right_block(monkeypatch):
    """The near miss of the tie rule: without it, DeepSeek-V2's block, right as it is, is rejected on its own weights
    at the grown scales (tied experts chosen differently)."""
    from mok_compile.passes import validate

    monkeypatch.setattr(validate, "_tied", lambda weights: False)
    weights_out_of_memory(monkeypatch)
    check, _, _ = _probe_setup(make_block("deepseek_v2"), torch.randn(2, 16, 64), own_weights=True)
    assert "different experts" in check()


@pytest.mark.parametrize("scales", ["grown", "not grown"])
def test_the_probe_grows_the_inputs_on_the_models_own_weights_to_reach_the_clamp(monkeypatch, scales):
    """GPT-OSS's experts at a fresh model's scale (std 0.02) never reach the clamp at 7 on unit inputs: the probe on
    those weights grows its inputs round by round (`OWN_WEIGHTS_SCALES`), so a wrong clamp limit is still disproved;
    without growing them (the near miss) it is not."""
    from mok_compile.passes import validate

    if scales == "not grown":
        monkeypatch.setattr(validate, "OWN_WEIGHTS_SCALES", (1.0,))
    weights_out_of_memory(monkeypatch)
    check, routing, expert = _probe_setup(make_block("gpt_oss", dtype=torch.float32), torch.randn(2, 5, 64),
                                          own_weights=True)
    assert expert.limit == 7.0 and check() is None
    wrong = [check(expert=dataclasses.replace(expert, limit=limit)) for limit in (3.0, 20.0)]
    if scales == "grown":
        assert all(w is not None and "outputs differ" in w for w in wrong), wrong
    else:
        assert wrong[1] is None  # unit inputs on small weights stay below 7 and 20 alike


def test_an_overflow_on_the_own_weights_ends_the_growth_and_is_otherwise_a_failure(monkeypatch):
    """fp16 outputs overflow at the largest scales of the own-weights rounds: those rounds end the growth and the
    verdict stands on the rounds before. On drawn weights an output that is not finite fails the probe."""
    from mok_compile.passes import validate

    monkeypatch.setattr(validate, "OWN_WEIGHTS_SCALES", (1.0, 8.0, 1e6))  # the last overflows fp16
    with monkeypatch.context() as m:
        weights_out_of_memory(m)
        block = make_block("mixtral", dtype=torch.float16)
        check, routing, _ = _probe_setup(block, torch.randn(2, 5, 64, dtype=torch.float16), own_weights=True)
        assert check() is None
        assert "outputs differ" in check(routing=dataclasses.replace(routing, renormalize=False))
    real_random = validate._random

    def overflowing_hidden_states(meta, std, gen, subs=None):
        t = real_random(meta, std, gen, subs)
        return t.fill_(float("inf")) if t.dim() == 3 else t  # the block input [B, S, H]

    monkeypatch.setattr(validate, "_random", overflowing_hidden_states)
    assert "not finite" in check()


def _graph(*writes):
    """A block `x @ w` (w [4, 4], x [3, 4]) after the writes (target, first argument "w", "y" = x @ w or "w[0]",
    args, kwargs; an `out=` of "w" or "y"), as an FX graph and its nodes to run."""
    g = torch.fx.Graph()
    w, x = g.placeholder("w"), g.placeholder("x")
    y = g.call_function(torch.matmul, (x, w))
    named = {"w": w, "y": y, "w[0]": g.call_function(operator.getitem, (w, 0))}
    for op, target, first, args, kwargs in writes:
        kwargs = {k: named.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
        make = g.call_method if op == "call_method" else g.call_function
        make(target, (named[first], *args), kwargs)
    g.output(y)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    return gm, [n for n in g.nodes if n.op not in ("placeholder", "output")]


WRITES_OF_THE_WEIGHT = {
    "in place": ("call_method", "mul_", "w", (2.0,), {}),
    "in place through a view": ("call_method", "add_", "w[0]", (1.0,), {}),
    "assignment": ("call_function", operator.setitem, "w", (1, 0.0), {}),
    "out=": ("call_function", torch.mul, "y", (2.0,), {"out": "w"}),
    "aten in place": ("call_function", torch.ops.aten.mul_.Scalar, "w", (2.0,), {}),
}


@pytest.mark.parametrize("write", WRITES_OF_THE_WEIGHT.values(), ids=WRITES_OF_THE_WEIGHT.keys())
def test_running_a_block_never_writes_a_protected_weight(write):
    """The probe on the model's own weights runs the block's nodes with the weights protected: a node that would
    write one (in place, through a view, by assignment or `out=`) stops the run before it writes."""
    gm, nodes = _graph(write)
    w, x = torch.randn(4, 4), torch.randn(3, 4)
    before = w.clone()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with pytest.raises(WritesProtected, match="writes one of the model's weights"):
        run_nodes(gm, nodes, dict(zip(placeholders, (w, x))), protect=[w])
    assert torch.equal(w, before)


def test_running_a_block_writes_its_own_intermediates_with_weights_protected():
    """The same writes into the block's own intermediate run as they would."""
    writes = [("call_method", "mul_", "y", (2.0,), {}), ("call_function", operator.setitem, "y", (0, 1.0), {}),
              ("call_function", torch.ops.aten.add_.Scalar, "y", (1.0,), {})]
    gm, nodes = _graph(*writes)
    w, x = torch.randn(4, 4), torch.randn(3, 4)
    before = w.clone()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    env = run_nodes(gm, nodes, dict(zip(placeholders, (w, x))), protect=[w])
    want = (x @ w) * 2.0
    want[0] = 1.0
    assert torch.equal(env[nodes[0]], want + 1.0) and torch.equal(w, before)


@pytest.mark.gpu
def test_a_probe_short_of_gpu_memory_proves_the_block_on_its_own_weights():
    """On a GPU whose memory has no room for a copy of the block's weights but room for its activations (the
    allocator capped at what it holds plus 48 MB, its cached blocks taken), the probe's draw runs out of memory and it
    proves the block on the block's own weights instead, leaving them as they were; with 0 MB left it reports the
    shortage."""
    from torch._dynamo.utils import counters

    from mok_compile.hf_blocks import BlockSizes
    from mok_compile.passes.fuse_moe import fuse_moe

    from .helpers import count_fused, run

    sizes = BlockSizes(hidden=512, intermediate=1024, experts=16, top_k=2)  # gate_up: 64 MiB of fp32
    block = make_block("qwen3_moe", sizes, device="cuda")
    x = torch.randn(1, 16, 512, device="cuda")
    weights = {n: p.detach().clone() for n, p in block.named_parameters()}
    for leave_mb, fuses in ((48, True), (0, False)):
        (graph,), eager = capture(block, x)
        gm, example = graph
        counters.clear()
        with _gpu_memory_capped(leave_mb << 20):
            report = fuse_moe(gm, example)
        assert counters["mok"]["probe_own_weights"] == 1
        assert count_fused(gm) == int(fuses), str(report)
        if fuses:
            torch.testing.assert_close(run(gm, example)[0], eager, rtol=1e-4, atol=1e-5)
        else:
            assert "and again on the model's own weights (no copy)" in report.blocks[0].reason
        for n, p in block.named_parameters():
            assert torch.equal(p.detach(), weights[n]), n


class _gpu_memory_capped:
    """Within it, the caching allocator can take `leave` more bytes of the GPU: its free cached blocks taken, then
    capped (set_per_process_memory_fraction: this process only) at what it holds plus `leave`."""

    def __init__(self, leave):
        self.leave, self.held = leave, []

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(torch.cuda.memory_reserved() / total)
        size = 1 << 30
        while size >= 512:
            try:
                self.held.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                size //= 2
        torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + self.leave) / total))

    def __exit__(self, *exc):
        self.held.clear()
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
