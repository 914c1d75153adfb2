"""Let the compiled backward write dh over the saved h, as the eager backward does (post-grad, inductor).

    before:  h (saved by fused_moe_train; a placeholder of the backward graph, read by this node alone)
               └──> fused_moe_backward(go, gw, x, ..., w, ids, gate_up_out=h[, post_norm_input=y]) ──> grads
    after:   h ──> fused_moe_backward_consume(go, gw, x, ..., w, ids, h, if_graph_freed=True[, post_norm_input=y])
                     ──> grads      (y too a placeholder read by this node alone; the op writes dy over it)

aot_autograd keeps the functional `fused_moe_backward` in the backward graph (graphs stay functional), so a
compiled backward holds h and a second [T*K, 2I] buffer for dh at once: one h more than the eager op's
backward, which writes dh over h (`fused_moe_backward_consume`). Saved tensors reach the backward graph as
its inputs, so this pass runs after aot_autograd (inductor's `post_grad_custom_post_pass`, `post_grad`) where no
functionalization undoes the mutation. Whether h is dead is only known at run time (a backward under
retain_graph must leave it intact), so the op decides per call (`if_graph_freed`). Not installed under
CUDA graphs (`mode="reduce-overhead"`): a graph that mutates its inputs is not captured.
Counted in `counters["mok"]["backward_consume"]` when inductor compiles a backward graph: one that inductor loads
from its FX graph cache instead (a piece equal to one compiled before, as DDP's cut layers can be) runs the
rewritten code uncounted (benchmarks/NOTES-gpu.md v52 (5)).

Spent weights. Where the graph computes a block's expert weight for the op alone (a LoRA delta added by a
parametrization, experts stacked from a module list), aot_autograd saves that tensor for this backward only, and the
backward held it beside its gradient: both weights and both gradients at once, one weight's worth more than HF's
eager backward. The forward pass marks such a weight (`mark_spent_weights`: a computing node the op alone reads);
here, where that mark reaches a saved tensor read by this node alone, it is passed again as `spent_gate_up_proj` /
`spent_down_proj`, and the CUDA kernels free it once read (if the graph is freed, and only where the tensor holds
its memory alone; `MOK_SPENT_WEIGHTS=0` turns it off). Counted in `counters["mok"]["spent_weights"]`.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .op_names import LAYOUT_OPS_NAMES, op_name
from .swap_call import count_swaps, swap_call


def consume_saved_gate_up(graph: fx.Graph) -> int:
    """Rewrite every `fused_moe_backward` whose `gate_up_out` (and `post_norm_input`, where given) is a graph input
    read by it alone; returns how many."""
    backward = torch.ops.mok.fused_moe_backward.default
    done = 0
    for node in list(graph.nodes):
        if node.target is not backward:
            continue
        if not _dead_input(node.kwargs.get("gate_up_out")):
            continue
        norm_input = node.kwargs.get("post_norm_input")
        if norm_input is not None and not _dead_input(norm_input):
            continue
        spent = {key: node.args[position] for key, position in _SPENT_POSITIONS.items()
                 if _spent_weight(node.args[position])}
        # same outputs: meta["val"] stays valid
        new = swap_call(graph, node, torch.ops.mok.fused_moe_backward_consume.default,
                        *_consume_arguments(node.args, {**node.kwargs, **spent}))
        if "eager_input_vals" in node.meta:  # the call's fake inputs, which inductor matches to the schema
            args, kwargs = node.meta["eager_input_vals"]
            new.meta["eager_input_vals"] = _consume_arguments(args, {**kwargs, **{k: args[_SPENT_POSITIONS[k]]
                                                                                   for k in spent}})
        done += 1
        count_swaps("spent_weights", len(spent), "mok: %d weight(s) passed as spent to a compiled backward")
    return count_swaps("backward_consume", done, "mok: %d compiled backward(s) write dh over the saved h")


# Where `fused_moe_backward` takes the weights that `spent_*` repeat (grad_out, grad_topk_weights, hidden_states,
# router, router_bias, selection_bias, gate_up_proj, gate_up_bias, down_proj, ...).
_SPENT_POSITIONS = {"spent_gate_up_proj": 6, "spent_down_proj": 8}
SPENT_MARK = "mok_weight_for_the_op_alone"  # in node.meta["custom"], which aot_autograd copies to what it traces


def mark_spent_weights(op: fx.Node):
    """Mark the expert weights of a new `fused_moe` node that the graph computes for it alone (a computing node: no
    graph input, view or cast, which may alias one; no other reader): saved for its backward, they may be freed there
    once read."""
    for weight in (op.args[4], op.args[6]):  # gate_up_proj, down_proj
        if (isinstance(weight, fx.Node) and weight.op in ("call_function", "call_method")
                and op_name(weight) not in LAYOUT_OPS_NAMES and list(weight.users) == [op]):
            weight.meta["custom"] = {**(weight.meta.get("custom") or {}), SPENT_MARK: True}


def _spent_weight(value) -> bool:
    """A saved tensor (a backward graph input read by the op alone) that the forward computed from a marked node, by
    an op that is no view, and not a forward input (those carry an input descriptor)."""
    if not (_dead_input(value) and (value.meta.get("custom") or {}).get(SPENT_MARK)):
        return False
    aten = value.meta.get("original_aten")
    return value.meta.get("desc") is None and not getattr(aten, "is_view", False)


def _dead_input(value) -> bool:
    """A graph input that no node but the one reading it reads (whether the graph is freed is the op's own check)."""
    return isinstance(value, fx.Node) and value.op == "placeholder" and len(value.users) == 1


def _consume_arguments(args, kwargs) -> tuple[tuple, dict]:
    """A `fused_moe_backward` call's (args, kwargs) as `fused_moe_backward_consume(..., if_graph_freed=True)`'s,
    in schema order: positional arguments by position (a graph may pass some by keyword, and inductor's
    fallback lowering expects them positional), keyword-only ones by name."""
    backward = torch.ops.mok.fused_moe_backward.default
    named = {**dict(zip((a.name for a in backward._schema.arguments), args)), **kwargs, "if_graph_freed": True}
    new_args, new_kwargs = [], {}
    for arg in torch.ops.mok.fused_moe_backward_consume.default._schema.arguments:
        if arg.kwarg_only:
            if arg.name in named:
                new_kwargs[arg.name] = named[arg.name]
        else:
            new_args.append(named[arg.name] if arg.name in named else arg.default_value)
    return tuple(new_args), new_kwargs
