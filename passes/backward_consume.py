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
"""

from __future__ import annotations

import torch
import torch.fx as fx

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
        # same outputs: meta["val"] stays valid
        new = swap_call(graph, node, torch.ops.mok.fused_moe_backward_consume.default,
                        *_consume_arguments(node.args, node.kwargs))
        if "eager_input_vals" in node.meta:  # the call's fake inputs, which inductor matches to the schema
            new.meta["eager_input_vals"] = _consume_arguments(*node.meta["eager_input_vals"])
        done += 1
    return count_swaps("backward_consume", done, "mok: %d compiled backward(s) write dh over the saved h")


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
