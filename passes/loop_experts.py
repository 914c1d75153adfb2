"""Experts of an ``nn.ModuleList`` traced through a Python loop, stacked in the graph for the op.

transformers 4.x / Mixtral style (needs ``capture_dynamic_output_shape_ops``)::

    mask = one_hot(ids, E).permute(2, 1, 0)
    for e in range(E):
        k_pos, tok = where(mask[e])                       # the constant e selects the expert's tokens
        y_e = down_e(act(gate_e(x[tok])) * up_e(x[tok]))  # or down_e(act(up_e(x[tok])))
        out.index_add_(0, tok, y_e * w[tok, k_pos, None])

dense mask-and-sum (research code)::

    for e in range(E):
        w_e = (w * (ids == e)).sum(-1)                    # the constant e selects the expert's weight
        out = out + w_e[:, None] * expert_e(x)

Each expert's chain is found from its down projection (a linear of the loop
whose output feeds no other expert linear); the expert number is the integer
constant the chain uses to select from the indices (``mask[e]``,
``ids == e``); the numbers must be exactly 0..E-1. The op receives
``cat([stack(gate_e), stack(up_e)], 1)`` and ``stack(down_e)``, built in the graph.
"""

from __future__ import annotations

import torch.fx as fx

from mok_compile.ops.spec import ExpertSpec

from .dataflow import Dataflow
from .experts import ExpertsMatch, Stack, activation_between, check_weight_application
from .op_names import CAST_OPS, arg, op_name, runtime_float_reason, tensor_meta
from .region import NoMatch, Region, same, strip
from .routing import RouterMatch

# Ops that pick an expert's share of the routing weights in a loop: w * (ids == e), .sum(-1), where(...).
_SELECT_OPS = {"mul", "sum", "eq", "where", "masked_fill"}


def _linear_weight(node: fx.Node) -> fx.Node:
    return strip(node.args[1], CAST_OPS)


def _linear_bias(node: fx.Node) -> fx.Node | None:
    b = arg(node, 2, "bias")
    return strip(b, CAST_OPS) if isinstance(b, fx.Node) else None


def _expert_number(flow: Dataflow, region: Region, scope: set[fx.Node], from_ids: set[fx.Node]) -> int:
    """The integer constant with which an expert's chain selects from the router's indices."""
    found = set()
    for n in scope & from_ids:
        name = op_name(n)
        base = n.args[0] if n.args else None
        if name in ("getitem", "select") and tensor_meta(base) is not None and base in from_ids:
            index = n.args[1] if name == "getitem" else n.args[2]
            if isinstance(index, int):
                found.add(index)
        elif name == "eq":
            found.update(a for a in n.args if isinstance(a, int) and not isinstance(a, bool))
    if len(found) != 1:
        raise NoMatch(f"cannot tell which expert a loop iteration computes (constants {sorted(found)})")
    return found.pop()


def match_loop_experts(flow: Dataflow, region: Region, router: RouterMatch, tensors: list[fx.Node]) -> ExpertsMatch:
    E = int(region.E)
    lins = [n for n in region.nodes if op_name(n) == "linear" and n is not region.router_linear]
    if not lins or any(_linear_weight(n) not in tensors for n in lins):
        raise NoMatch("experts are neither stacked 3-D weights nor linear layers of a module list")
    slices = {n: flow.forward_slice([n], within=region.nodes) for n in lins}
    downs = [n for n in lins if not any(m in slices[n] for m in lins if m is not n)]
    if len(downs) != E:
        raise NoMatch(f"found {len(downs)} expert MLPs in the loop but the router has {E} experts")
    from_ids = flow.forward_slice([region.ids], within=region.nodes)
    chains, expert_path = {}, set()
    for down in downs:
        ups = [m for m in lins if m is not down and down in slices[m]]
        if len(ups) not in (1, 2):
            raise NoMatch(f"expert MLP ending in {down.name} has {len(ups)} input projections")
        gated, interleaved, act, alpha, limit, between, runtime = activation_between(flow, region.nodes, ups, down,
                                                                                    set())
        if runtime:
            raise NoMatch(runtime_float_reason(f"the activation's {', '.join(runtime)} in a loop over expert modules"))
        if interleaved:
            raise NoMatch("interleaved gate/up in per-expert modules is not supported")
        if len(ups) == 2:
            acts = [m for m in between if op_name(m) in ("silu", "gelu", "gelu_tanh")]
            gate = [m for m in ups if acts and acts[0] in slices[m]]
            if len(gate) != 1:
                raise NoMatch(f"cannot tell the gate from the up projection in {down.name}'s expert")
            ups = [gate[0], next(m for m in ups if m is not gate[0])]
        joins = [m for m in slices[down] if op_name(m) == "mul" and any(a in from_ids and a not in slices[down]
                                                                        for a in m.all_input_nodes)]
        scope = flow.backward_slice([down, *joins[:1]], stop=lambda m: m not in region.nodes)
        e = _expert_number(flow, region, scope, from_ids)
        if e in chains:
            raise NoMatch(f"two loop iterations compute expert {e}")
        chains[e] = (ups, down, ExpertSpec(activation=act, gated=gated))
        expert_path |= between | set(ups) | {down}
    if sorted(chains) != list(range(E)):
        raise NoMatch(f"loop iterations compute experts {sorted(chains)}, not 0..{E - 1}")
    specs = {c[2] for c in chains.values()}
    if len(specs) != 1:
        raise NoMatch("experts of the loop differ in their activation")
    spec = specs.pop()
    order = [chains[e] for e in range(E)]
    n_up = len(order[0][0])
    if any(len(ups) != n_up for ups, _, _ in order):
        raise NoMatch("experts of the loop differ in structure")

    def stacked(nodes_per_part, of):
        values = [[of(n) for n in part] for part in nodes_per_part]
        present = {v is None for part in values for v in part}
        if present == {True}:
            return None
        if True in present:
            raise NoMatch("some experts have biases and others do not")
        return Stack(tuple(tuple(part) for part in values))

    up_parts = [[ups[i] for ups, _, _ in order] for i in range(n_up)]
    downs_ordered = [[down for _, down, _ in order]]
    gate_up, gate_up_bias = stacked(up_parts, _linear_weight), stacked(up_parts, _linear_bias)
    down, down_bias = stacked(downs_ordered, _linear_weight), stacked(downs_ordered, _linear_bias)
    x_meta = tensor_meta(region.x)
    shapes = {tuple(tensor_meta(n).shape) for part in gate_up.groups for n in part}
    down_shapes = {tuple(tensor_meta(n).shape) for n in down.groups[0]}
    if len(shapes) != 1 or len(down_shapes) != 1:
        raise NoMatch("experts of the loop have different sizes")
    (inter, hidden), (d_out, d_in) = shapes.pop(), down_shapes.pop()
    if not (same(hidden, region.H) and same(d_out, region.H) and same(d_in, inter)):
        raise NoMatch("expert weight shapes do not fit the hidden size")
    for part in gate_up.groups + down.groups:
        if any(tensor_meta(n).dtype != x_meta.dtype for n in part):
            raise NoMatch("expert weights and hidden states have different dtypes")
    check_weight_application(flow, region, router.weights, expert_path, [down for _, down, _ in order],
                             selection_ops=_SELECT_OPS)
    form = "module_loop"
    return ExpertsMatch(form=form, gate_up=gate_up, gate_up_bias=gate_up_bias, down=down, down_bias=down_bias,
                        intermediate=int(inter), specs=[spec])
