"""Replace a proven MoE region by one `torch.ops.mok.fused_moe` call.

    before:  x, W_r, W1, W2 ──> [ router ─ topk ─ experts ─ combine ] ──> out ──> users
                                          └─> w, ids ──> users (aux losses, router outputs)
    after:   x, W_r, W1, W2 ──> fused_moe(x, W_r, b_r?, sel?, W1, b1?, W2, b2?, top_k=K, ...)
                                  ├─[0]──> users of out      (viewed as the block input when out was)
                                  ├─[1]──> users of w        [T, K] routing weights
                                  └─[2]──> users of ids      [T, K] expert ids

Nodes of the region the rest of the graph still reads (router logits for an
auxiliary loss, router probabilities) stay where they are; when the logits
stay, or are an input of the region (its router reads another tensor than its
experts), the op takes them (``router_is_logits=True``) instead of computing
them. Every created node gets ``meta["val"]`` from the fake kernels.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .backward_consume import mark_spent_weights
from .dataflow import Dataflow
from .op_names import meta_value, op_name, tensor_meta
from .region import NoMatch, Region, same_shape
from .validate import materialize


@dataclass
class Plan:
    keep: set[fx.Node]            # region nodes the rest of the graph still reads
    exports: dict[str, fx.Node]   # "weights" / "ids": region nodes replaced by the op's outputs
    router_is_logits: bool        # the op takes the graph's logits (they stay, or the router is outside the region)
    disposable: set[fx.Node]      # outside nodes that only check sizes of region values (Dynamo's runtime asserts)


_ASSERTS = {"_assert_scalar", "_assert_async", "sym_constrain_range", "sym_constrain_range_for_size"}


def _size_checks(region: Region) -> set[fx.Node]:
    """Outside nodes that only read sizes of region tensors to assert on them (e.g. Dynamo's checks that a
    data-dependent size u0 satisfies 0 <= u0 <= T*K); they go with the region."""
    memo: dict[fx.Node, bool] = {}

    def disposable(u: fx.Node) -> bool:
        if u in memo:
            return memo[u]
        memo[u] = False
        value = meta_value(u)
        name = op_name(u)
        ok = u.op in ("call_function", "call_method") and (
            name in _ASSERTS or value is None or isinstance(value, (torch.SymInt, torch.SymBool, int, bool))
            or (name == "getitem" and u.args[0] in region.nodes))
        ok = ok and all(disposable(v) for v in u.users)
        memo[u] = ok
        return ok

    found = set()
    for n in region.nodes:
        for u in n.users:
            if u not in region.nodes and disposable(u):
                found |= {m for m, ok in memo.items() if ok}
    return {m for m, ok in memo.items() if ok} & found


def plan_rewrite(flow: Dataflow, region: Region, weights: fx.Node, expert_inputs: list[fx.Node],
                 keep_logits: bool = False) -> Plan:
    """Which region values must survive the rewrite, and which the op's outputs replace. `keep_logits`: the router
    stays as the graph computes it, and the op takes its logits."""
    out_pos = flow.order[region.out]
    exports, kept = {}, [region.logits] if keep_logits else []
    disposable = _size_checks(region)
    for n in region.nodes:
        outside = [u for u in n.users if u not in region.nodes and u not in disposable]
        if n is region.out or not outside:
            continue
        name = "weights" if n is weights else "ids" if n is region.ids else None
        # The op's [T, K]; weights or ids of another shape ([B, S, K]: Zaya's) stay as the graph computes them.
        if (name and all(flow.order[u] > out_pos for u in outside) and not flow.writers.get(n)
                and tensor_meta(n).dim() == 2):
            exports[name] = n
        else:
            kept.append(n)
    inside = lambda m: m not in region.nodes  # noqa: E731
    keep = flow.backward_slice(kept, stop=inside) & region.nodes
    if region.x in region.nodes:
        keep |= flow.backward_slice([region.x], stop=inside) & region.nodes
    leaks = keep & flow.forward_slice(expert_inputs, within=region.nodes)
    if leaks:
        leak = flow.sorted(leaks)[-1]
        raise NoMatch(f"expert intermediate {leak.name} is used outside the block")
    router_is_logits = region.router_linear is None or region.logits in keep
    return Plan(keep=keep, exports=exports, router_is_logits=router_is_logits, disposable=disposable)


def _set_meta(node: fx.Node, fake_mode, like: fx.Node):
    if fake_mode is None:
        return
    load = lambda a: meta_value(a)  # noqa: E731
    args, kwargs = fx.node.map_arg(node.args, load), fx.node.map_arg(node.kwargs, load)
    with fake_mode:
        if node.op == "call_method":
            val = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            val = node.target(*args, **kwargs)
    node.meta["val"] = val
    if "example_value" in like.meta:
        node.meta["example_value"] = val
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in like.meta:
            node.meta[key] = like.meta[key]


def emit(gm: fx.GraphModule, flow: Dataflow, region: Region, plan: Plan, operands: list, kwargs: dict) -> fx.Node:
    """Insert the op before the region's output, rewire users, erase the dead region. Returns the op node."""
    graph = gm.graph
    # The graph's own fake mode (not the ambient tracing context's, which can differ inside a backend).
    fake_mode = getattr(tensor_meta(region.x), "fake_mode", None)
    like = region.out
    created = []

    def call(target, args, method=False):
        node = graph.call_method(target, args) if method else graph.call_function(target, args)
        created.append(node)
        return node

    with graph.inserting_before(region.out):
        tensors = [materialize(o, lambda n: n, stack=lambda xs, d: call(torch.stack, (xs, d)),
                               cat=lambda xs, d: call(torch.cat, (xs, d)),
                               flat=lambda n, shape: call(torch.reshape, (n, shape))) for o in operands]
        op = graph.call_function(torch.ops.mok.fused_moe.default, tuple(tensors), kwargs)
        created.append(op)
        outputs = [call(operator.getitem, (op, i)) for i in range(3)]
        result = outputs[0]
        if not same_shape(tensor_meta(region.out).shape, tensor_meta(region.x).shape):
            result = call("view_as", (outputs[0], region.root), method=True)
    for node in created:
        _set_meta(node, fake_mode, like)

    for n in reversed(flow.sorted(plan.disposable)):
        graph.erase_node(n)
    doomed = region.nodes - plan.keep
    region.out.replace_all_uses_with(result, delete_user_cb=lambda u: u not in doomed)
    for name, index in (("weights", 1), ("ids", 2)):
        if name in plan.exports:
            plan.exports[name].replace_all_uses_with(outputs[index], delete_user_cb=lambda u: u not in doomed)
    for n in reversed(flow.sorted(doomed)):
        if any(u not in doomed for u in n.users):
            raise RuntimeError(f"mok rewrite: {n.name} is still used after the rewrite (pass bug)")
        graph.erase_node(n)
    for n in outputs:
        if not n.users:
            graph.erase_node(n)
    for n in reversed(flow.sorted(region.inputs)):  # size computations only the region used
        if n.op in ("call_function", "call_method") and not n.users:
            graph.erase_node(n)
    mark_spent_weights(op)
    return op
