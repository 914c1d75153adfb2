"""MoE blocks inside activation-checkpointed regions: fused in a copy of the region's body.

Dynamo traces ``torch.utils.checkpoint.checkpoint(layer, ...)`` (how transformers' `activation_checkpointing_enable`
runs each decoder layer, reentrant or not) into a higher-order op whose body is a graph of its own::

    wrap_body_0 = self.wrap_body_0                   # get_attr: the layer's graph, a GraphModule attribute
    out = tag_activation_checkpoint(wrap_body_0, x, w_router, w_gate_up, w_down, ..., use_reentrant=False)
    wrap_body_0:  x, w_router, ... (placeholders) ─ router ─ topk ─ experts ─ ... ──> output

The MoE block is in the body, out of sight of a pass over the outer graph. Each body is fused (recursively: a
checkpoint inside a checkpoint) in a copy; where a block fused, the get_attr is pointed at the copy. So the outer
graph is the one thing changed, the backend's snapshot of it puts everything back, and a graph `explain` works on
never touches the body Dynamo compiles. AOT autograd then treats the fused op as any node of the region: the forward
runs it and keeps only the region's inputs, the backward runs it again before its own backward (recomputation).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

from .op_names import meta_value

# The higher-order ops whose body runs once per call, on the call's operands, with nothing of its own: fusing in it
# is fusing in straight-line code. (Control flow bodies, `cond`'s and `while_loop`'s, and score functions are not.)
CHECKPOINT_OPS = ("tag_activation_checkpoint",)


def checkpoint_calls(gm: fx.GraphModule) -> dict[fx.Node, list[fx.Node]]:
    """{get_attr of a body: the checkpoint calls that run it} in graph order."""
    calls: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        target = node.target
        if (node.op == "call_function" and isinstance(target, torch._ops.HigherOrderOperator)
                and target.name() in CHECKPOINT_OPS and node.args and isinstance(node.args[0], fx.Node)
                and node.args[0].op == "get_attr"):
            calls.setdefault(node.args[0], []).append(node)
    return calls


def body_inputs(call: fx.Node, live: dict) -> list:
    """The body's example inputs at `call`: the outer graph's live input where an operand is one (`live`, from
    `validate.live_inputs`: Dynamo hands the backend the live parameters, which the probe may run on), else the
    operand's recorded (fake) value."""
    return [live[a] if a in live else meta_value(a) if isinstance(a, fx.Node) else a for a in call.args[1:]]


def fuse_checkpointed(gm: fx.GraphModule, live: dict, fuse: Callable,
                      before_rewrite: Callable[[], None] | None = None) -> list:
    """Fuse the MoE blocks in each checkpointed body of `gm`; returns their `BlockReport`s.

    `fuse(body, inputs, call)` is the pass over one graph (returning its FuseReport), `call` the node that runs
    it. A body run by several calls is fused once, on its first call's inputs; the region's operands are what the
    probe draws anew anyway."""
    blocks = []
    for attr, calls in checkpoint_calls(gm).items():
        body = gm.get_submodule(attr.target)
        if not isinstance(body, fx.GraphModule):
            continue
        copy = fx.GraphModule(body, _copy_graph(body.graph), class_name=type(body).__name__)
        copy.meta.update(body.meta)  # Dynamo keeps a selective checkpoint's policy there (`_checkpoint_context_fn`)
        report = fuse(copy, body_inputs(calls[0], live), calls[0])
        for block in report.blocks:
            block.checkpointed = True
        blocks += report.blocks
        if report.fused:
            if before_rewrite is not None:
                before_rewrite()
            name = _free_name(gm, f"{attr.target}_mok")
            gm.add_submodule(name, copy)
            attr.target = name
    return blocks


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of a body's graph with each node's meta (its fake value among it) carried over."""
    new = fx.Graph()
    value, output = new.graph_copy(graph, {}, return_output_node=True)
    new.output(value).meta.update(output.meta)
    return new


def _free_name(gm: fx.GraphModule, base: str) -> str:
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name
