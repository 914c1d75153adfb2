"""Which autocast each node of a block runs under, so the probe runs the graph's region as it runs and the op's
reference as the op computes.

Autocast reaches a Dynamo graph two ways: entered around the compiled call (global state when the backend runs;
Dynamo guards on it, so the graph only ever runs under it), or entered inside the compiled code, where the graph
holds the span::

    _enter_autocast(device, dtype, enabled, cache) ─> enter ... block's nodes ... _exit_autocast(enter)

and spans nest: Ernie 4.5's router turns autocast off for its own logits inside the block.

Autocast casts the region's GEMM inputs (and runs some reductions in fp32); the fused op is not autocast-aware
and computes in its operands' dtypes (its kernels run with autocast excluded). So the probe runs each region node
under its autocast and the reference without any, and a block is fused only where the two agree: a bf16 model
under bf16 autocast does. So does an fp32 transformers model: autocast runs its router's linear in bf16, which stays
in the graph (its logits in another dtype than the op's own), while transformers casts the experts' input back to
the fp32 weights, and the bf16 routing weights widen again in their product with the experts' rows (the op's
`round_weights_to`). Experts whose own GEMMs autocast casts are not fused, and their report says why.
"""

from __future__ import annotations

import collections
import contextlib

import torch
import torch.fx as fx

_ENTER, _EXIT = torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast
_DEVICES = ("cuda", "cpu")

HINT = ("autocast ({}) is on around this block: the op computes in its operands' dtypes, and it fuses a block "
        "only where that gives autocast's result. On fp32 weights it takes a router's {} logits from the graph and "
        "runs fp32 experts (transformers' default `grouped_mm` ones), not experts whose GEMMs autocast "
        "runs in {} (linear, matmul, bmm). Give the model {} weights (`model.to(torch.{})`, or FSDP2's "
        "`MixedPrecisionPolicy(param_dtype=torch.{})`) to fuse it")


def node_states(graph: fx.Graph, outer: tuple | None = None) -> dict[fx.Node, tuple]:
    """The autocast each node runs under, as (device, dtype) pairs (empty: none): the innermost in-graph span
    around it, else `outer` (a checkpointed body's: its call's), else the compile's own (global) autocast. A node
    added to the graph later (a rewrite's) reads as outside any span."""
    compiled = tuple((d, torch.get_autocast_dtype(d)) for d in _DEVICES if torch.is_autocast_enabled(d))
    compiled = compiled if outer is None else outer
    states, stack = collections.defaultdict(lambda: compiled), []
    for n in graph.nodes:
        if n.op == "call_function" and n.target is _EXIT and stack:
            stack.pop()
        states[n] = stack[-1] if stack else compiled
        if n.op == "call_function" and n.target is _ENTER:
            device, dtype, enabled = n.args[:3]
            stack.append(((device, dtype),) if enabled else ())
    return states


def block_autocast(nodes, states: dict[fx.Node, tuple]) -> tuple:
    """The autocasts a block's nodes run under, without repeats (empty: none)."""
    return tuple(dict.fromkeys(pair for n in nodes for pair in states[n]))


def running_under(state: tuple):
    """Autocast as `node_states` gave it, in place of the global state (a span's own autocast, or none)."""
    stack = contextlib.ExitStack()
    for device in _DEVICES:
        if torch.is_autocast_enabled(device):
            stack.enter_context(torch.autocast(device, enabled=False))
    for device, dtype in state:
        stack.enter_context(torch.autocast(device, dtype=dtype))
    return stack


def hint(state: tuple) -> str | None:
    """What a rejected block's report adds when it runs under autocast (`block_autocast`), or None."""
    if not state:
        return None
    name = str(state[0][1]).removeprefix("torch.")
    return HINT.format(", ".join(f"{d}, {str(t).removeprefix('torch.')}" for d, t in state), *[name] * 5)
