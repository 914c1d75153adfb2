"""`passes.checkpointed`: MoE blocks inside activation-checkpointed regions (Dynamo's `tag_activation_checkpoint`)
are fused in a copy of the region's body; regions without one, and the body Dynamo compiled, are left alone."""

import importlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import mok_compile
from mok_compile import backend
from mok_compile.passes import fuse_moe
from mok_compile.passes.checkpointed import checkpoint_calls

from . import models
from .helpers import count_fused

TOL = dict(atol=1e-5, rtol=1e-5)


class CheckpointedLayers(nn.Module):
    """Residual layers, each run through `torch.utils.checkpoint` as transformers' checkpointed decoder layers are;
    `nested`: each layer's MoE in a checkpoint of its own inside the layer's."""

    def __init__(self, make_mlp, layers=2, reentrant=False, nested=False):
        super().__init__()
        self.mlps = nn.ModuleList(make_mlp() for _ in range(layers))
        self.reentrant, self.nested = reentrant, nested

    def layer(self, mlp, x):
        if self.nested:
            return x + checkpoint(mlp, torch.tanh(x), use_reentrant=self.reentrant)
        return x + mlp(torch.tanh(x))

    def forward(self, x):
        for mlp in self.mlps:
            x = checkpoint(self.layer, mlp, x, use_reentrant=self.reentrant)
        return x


class DenseMLP(nn.Module):
    def __init__(self, hidden=32, inter=16):
        super().__init__()
        self.up, self.down = nn.Linear(hidden, inter), nn.Linear(inter, hidden)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


def _capture(model, x):
    """The one graph Dynamo hands the backend for a training step of `model` (grad enabled: under no_grad Dynamo
    inlines the checkpoint), with its example inputs."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(x)
    (graph,) = graphs
    return graph


def _bodies(gm):
    return [gm.get_submodule(attr.target) for attr in checkpoint_calls(gm)]


def _model(make_mlp=models.StackedGatherMoE, **kwargs):
    torch.manual_seed(0)
    return CheckpointedLayers(make_mlp, **kwargs)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_blocks_in_checkpointed_layers_are_fused_in_copies_of_their_bodies(reentrant):
    model, x = _model(reentrant=reentrant), torch.randn(12, 32)
    gm, example = _capture(model, x)
    originals = _bodies(gm)
    report = fuse_moe(gm, example)

    assert [(b.fused, b.checkpointed) for b in report.blocks] == [(True, True)] * 2
    assert [b.name for b in report.blocks] == ["mlps.0", "mlps.1"]
    fused_bodies = _bodies(gm)
    assert [count_fused(body) for body in fused_bodies] == [1, 1]
    # Dynamo's own bodies are untouched (what the backend restores, and what `explain` runs, call them)
    assert [count_fused(body) for body in originals] == [0, 0]
    assert not set(map(id, fused_bodies)) & set(map(id, originals))
    with torch.no_grad():
        torch.testing.assert_close(gm(*example)[0], model(x), **TOL)


def _eager_grads(model, x):
    model(x).square().sum().backward()
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad(set_to_none=True)
    x.grad = None
    return grads


def _train_fused(model, x):
    """One training step of `model` compiled with the pass then aot_autograd (aot_eager); its gradients, and the
    mok ops in the forward and backward graphs."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    ops = {}

    def counting(name):
        def compiler(g, _inputs):
            ops[name] = [str(n.target) for n in g.graph.nodes if str(n.target).startswith("mok.")]
            return make_boxed_func(g.forward)
        return compiler

    def backend(gm, example_inputs):
        assert sum(b.fused for b in fuse_moe(gm, example_inputs).blocks) == 2
        return aot_module_simplified(gm, example_inputs, fw_compiler=counting("forward"),
                                     bw_compiler=counting("backward"))

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(x).square().sum().backward()
    return [p.grad for p in model.parameters()] + [x.grad], ops


def _assert_same_grads(got, want):
    assert sum(w is not None for w in want) == 7  # all but the selection biases (which only choose)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            torch.testing.assert_close(g, w, **TOL)


TRAIN, BACKWARD = "mok.fused_moe_train.default", "mok.fused_moe_backward.default"


def test_training_through_the_backend_recomputes_the_fused_op():
    """aot_eager: the loss and every gradient as eager's, the fused op run in the forward and again in the backward,
    as the checkpointed region it replaced would be."""
    model, x = _model(), torch.randn(12, 32, requires_grad=True)
    want = _eager_grads(model, x)
    got, ops = _train_fused(model, x)
    _assert_same_grads(got, want)
    # each layer: its op; then its op again and the op's backward
    assert ops == {"forward": [TRAIN] * 2, "backward": [TRAIN, BACKWARD] * 2}


@pytest.mark.parametrize("policy", ["save_the_op", "recompute"])
def test_a_selective_checkpoint_policy_sees_the_fused_op(policy):
    """Selective activation checkpointing (a `context_fn` policy): the policy Dynamo keeps with the region's body
    decides for the fused op as for any op, so a policy that saves it runs no recomputation of it in the backward;
    the near miss, a policy that recomputes everything, recomputes it."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    seen = set()

    def decide(ctx, op, *args, **kwargs):
        seen.add(str(op))
        if policy == "save_the_op" and str(op) == TRAIN:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    class SelectiveLayers(CheckpointedLayers):
        def forward(self, x):
            for mlp in self.mlps:
                x = checkpoint(self.layer, mlp, x, use_reentrant=False,
                               context_fn=functools.partial(create_selective_checkpoint_contexts, decide))
            return x

    torch.manual_seed(0)
    model, x = SelectiveLayers(models.StackedGatherMoE), torch.randn(12, 32, requires_grad=True)
    want = _eager_grads(model, x)
    seen.clear()
    got, ops = _train_fused(model, x)
    _assert_same_grads(got, want)
    assert TRAIN in seen
    recomputed = [TRAIN, BACKWARD] if policy == "recompute" else [BACKWARD]
    assert ops == {"forward": [TRAIN] * 2, "backward": recomputed * 2}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_a_layer_compiled_on_its_own_and_checkpointed_around_the_call_trains(reentrant):
    """transformers < 5.25 checkpoints each decoder layer's `__call__`, so a layer compiled with `layer.compile`
    compiles inside the checkpoint's first forward. The backend's work there must save nothing through the
    checkpoint's hooks: a count that differs from the recomputation's fails the backward (CheckpointError)."""
    torch.manual_seed(0)
    layer, x = models.StackedGatherMoE(), torch.randn(12, 32, requires_grad=True)
    checkpoint(layer, x, use_reentrant=reentrant).square().sum().backward()
    want = [p.grad.clone() for p in layer.parameters() if p.grad is not None] + [x.grad.clone()]
    layer.zero_grad(set_to_none=True)
    x.grad = None

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    layer.compile(backend="mok", options={"compiler": "aot_eager"})
    checkpoint(layer, x, use_reentrant=reentrant).square().sum().backward()
    got = [p.grad for p in layer.parameters() if p.grad is not None] + [x.grad]
    # reentrant: the forward runs under no_grad, the recomputation with grad, each its own graph
    assert torch._dynamo.utils.counters["mok"]["fused_moe"] == (2 if reentrant else 1)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


def test_the_backend_fuses_where_saved_tensor_hooks_are_disabled():
    """The backend's own identity hooks (the test above) are not pushed where hooks are disabled, as inside a
    torch.func transform: pushing them there raises, and the pass would fail and leave the block unfused."""
    torch.manual_seed(0)
    layer, x = models.StackedGatherMoE(), torch.randn(12, 32)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.autograd.graph.disable_saved_tensors_hooks("disabled by the test"):
        got = torch.compile(layer, backend="mok", options={"compiler": "aot_eager", "strict": True})(x)
    assert torch._dynamo.utils.counters["mok"]["fused_moe"] == 1
    torch.testing.assert_close(got, layer(x), **TOL)


def test_a_checkpoint_in_a_checkpoint_is_fused():
    model, x = _model(nested=True), torch.randn(12, 32)
    gm, example = _capture(model, x)
    report = fuse_moe(gm, example)
    assert [(b.fused, b.checkpointed) for b in report.blocks] == [(True, True)] * 2
    with torch.no_grad():
        torch.testing.assert_close(gm(*example)[0], model(x), **TOL)


def test_near_miss_checkpointed_layers_without_moe_are_left_alone():
    model, x = _model(DenseMLP), torch.randn(12, 32)
    gm, example = _capture(model, x)
    targets = [attr.target for attr in checkpoint_calls(gm)]
    code = gm.code
    report = fuse_moe(gm, example)
    assert report.blocks == [] and gm.code == code
    assert [attr.target for attr in checkpoint_calls(gm)] == targets


def test_near_miss_a_checkpointed_block_the_probe_disproves_stays_in_the_body():
    """A routing the op does not compute (weights squared after the top-k): reported, with the checkpointed mark,
    and the graph still calls Dynamo's body."""
    model, x = _model(models.SquaredWeightsMoE), torch.randn(12, 32)
    gm, example = _capture(model, x)
    originals = _bodies(gm)
    report = fuse_moe(gm, example)
    assert report.blocks and all(not b.fused and b.checkpointed for b in report.blocks)
    assert [id(b) for b in _bodies(gm)] == [id(b) for b in originals]


def test_the_backend_puts_dynamos_bodies_back_when_the_pass_fails_after_a_body_fused(monkeypatch, caplog):
    """The first layer's body fuses (its get_attr retargeted), the pass then fails in the second layer's: the graph
    compiled calls Dynamo's bodies, without any fused op, and trains as eager does."""
    fuse_moe_module = importlib.import_module("mok_compile.passes.fuse_moe")  # the module, not the function

    calls = []
    real = fuse_moe_module.lone_experts.find_lone_experts

    def failing_in_the_second_body(gm, **kwargs):
        calls.append(gm)
        if len(calls) == 3:  # the outer graph, the first body, the second body
            raise RuntimeError("bug in the pass")
        return real(gm, **kwargs)

    monkeypatch.setattr(fuse_moe_module.lone_experts, "find_lone_experts", failing_in_the_second_body)
    compiled = []

    def inner(gm, example_inputs, opts):
        compiled.append(gm)
        return gm.forward

    monkeypatch.setattr(backend, "compile_inner", inner)
    model, x = _model(), torch.randn(12, 32)
    torch._dynamo.reset()
    with caplog.at_level("WARNING", logger="mok_compile"):
        out = torch.compile(model, backend="mok", fullgraph=True)(x)
    assert "the MoE pass failed" in caplog.text and len(calls) == 3
    (gm,) = compiled
    assert [count_fused(body) for body in _bodies(gm)] == [0, 0]
    assert all(attr.target.startswith("wrap_body") and not attr.target.endswith("_mok")
               for attr in checkpoint_calls(gm))
    torch.testing.assert_close(out, model(x), **TOL)


def test_explain_marks_checkpointed_blocks_and_leaves_the_compiled_bodies_alone(capsys):
    model, x = _model(), torch.randn(12, 32, requires_grad=True)
    report = mok_compile.explain(model, x)
    assert [(b.fused, b.checkpointed) for b in report.blocks] == [(True, True)] * 2
    assert capsys.readouterr().out.count(" checkpointed") == 2
    assert report.checkpoint_hint is None


class _ActiveLayers:
    """A module-level registry set and reset around a call, as transformers' hub-kernel layers set theirs (kernels'
    `CompileableContextVar`, which while compiling keeps a new dict in an attribute)."""

    def __init__(self):
        self.value, self.in_use = None, False

    def set(self, value):
        previous, self.value, self.in_use = self.value, value, True
        return previous

    def reset(self, previous):
        self.value, self.in_use = previous, previous is not None


_ACTIVE = _ActiveLayers()


class SideEffectInCheckpoint(nn.Module):
    """A checkpointed layer that sets and resets `_ACTIVE`: Dynamo cannot trace the region and runs it eagerly."""

    def __init__(self):
        super().__init__()
        self.moe = models.StackedGatherMoE()

    def layer(self, x):
        previous = _ACTIVE.set(dict(_ACTIVE.value or {}, moe=self.moe))
        try:
            return x + self.moe(x)
        finally:
            _ACTIVE.reset(previous)

    def forward(self, x):
        return checkpoint(self.layer, torch.tanh(x), use_reentrant=False)


def test_a_region_dynamo_cannot_trace_is_explained_with_dynamos_hint(capsys, monkeypatch):
    torch.manual_seed(0)
    model, x = SideEffectInCheckpoint(), torch.randn(12, 32, requires_grad=True)
    report = mok_compile.explain(model, x)
    out = capsys.readouterr().out
    assert report.fused == [] and report.checkpoint_hint is not None
    assert "activation checkpointing: Dynamo could not trace" in out and "fix (Dynamo's hint)" in out

    # The backend warns (once): the region never reaches it, so it would otherwise only fuse fewer blocks.
    monkeypatch.setitem(mok_compile.diagnostics._warned, "checkpoint", False)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="could not trace an activation-checkpointed region"):
        torch.compile(model, backend="mok", options={"compiler": "eager"})(x)
